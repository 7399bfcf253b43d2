"""Settings of the serving app: each replica's engine, admission rule and protective limits,
and how many replicas serve."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from actors import EngineConfig, SamplingParams
from actors.allocator import check_allocator
from packing.admission import AdmissionConfig
from pipeline.serve.replicas import Replicas

API_KEYS_ENV = "RAYPACK_API_KEYS"


DEFAULT_MAX_QUEUE_WAIT_S = 30.0  # ServeConfig.max_queue_wait_s (why: there)


@dataclass(frozen=True)
class ServeConfig:
    """What each replica serves and how it protects itself, and how many replicas serve.
    Validated once, here."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    # The name clients pass as `model`; None: the engine's model name (its folder's name).
    served_model_name: str | None = None
    # Requests waiting in the staging queue at most; one more is answered 429.
    max_waiting: int = 256
    # Seconds a client is told to wait (Retry-After) when the queue is full.
    retry_after_s: int = 1
    # Seconds a request may wait in the staging queue for the engine; one still waiting then
    # is answered 429 with Retry-After (shed, as Triton's queue policy rejects on timeout), so
    # an overloaded replica answers every request within about this plus its run time.
    # None: requests wait as long as it takes (vLLM's and Serve's behaviour). The default,
    # 30 s, is under the 60 s idle timeout of common proxies and load balancers (nginx's
    # proxy_read_timeout, AWS ALB), so an interactive client hears a 429 before its proxy
    # gives up, and far under the openai SDK's 600 s; a batch client retries the 429 (the SDK
    # does, honouring Retry-After) and loses no throughput: the engine stays full. Without a
    # default, 300 requests of 2,048 tokens kept neighbours waiting over 120 s (issue 31).
    max_queue_wait_s: float | None = DEFAULT_MAX_QUEUE_WAIT_S
    # Largest request body accepted, in bytes (413 beyond).
    max_body_bytes: int = 1 << 20
    # Prompt tokens at most; None: the model's context length minus one.
    max_prompt_tokens: int | None = None
    # Upper bound on a request's max_tokens.
    max_tokens_limit: int = 2048
    # max_tokens of a completion that does not say: the engine's default (16, OpenAI's too).
    default_completion_tokens: int = SamplingParams.max_tokens
    # Environment variable holding API keys (comma-separated); unset or empty: no key needed
    # unless api_keys_file is set.
    api_keys_env: str | None = API_KEYS_ENV
    # File with one API key per line ('#' starts a comment).
    api_keys_file: str | None = None
    # Seconds a request's whole body may take to arrive (408 beyond).
    body_timeout_s: float = 10.0
    # Requests whose body is still arriving after its headers (slow bodies), per client address
    # and in all; one more is a 429 at once (pipeline/serve/guard.py).
    max_slow_bodies_per_client: int = 16
    max_slow_bodies: int = 64
    # Requests in progress per client address (429 beyond); None: no cap (behind a load
    # balancer every client has its address).
    max_requests_per_client: int | None = None
    # Requests the deployment accepts at once (Ray Serve's max_ongoing_requests); None: room for
    # a full staging queue, a full engine, the slow bodies and 64 more (e.g. /health), so the
    # replica answers 429 itself and Serve never queues /health behind held requests.
    max_ongoing_requests: int | None = None
    # Requests Serve's proxy (or the routing front) holds for the engine deployment before a
    # replica takes them; one more is answered 503 with Retry-After at once by Serve (its
    # back-pressure: max_queued_requests, BackpressureConfig), never reaching a replica. Serve
    # counts a request there from its arrival until a replica has accepted it, so also while
    # replicas with room are being asked (a round trip each, long on a loaded box), not only
    # while every replica is full: a bound near the staging queue's turns away requests the
    # replica has room for. None: as many as the replicas take at once (max_ongoing_requests
    # times the highest replica count); -1: no limit (Serve's default).
    max_queued_requests: int | None = None
    # CPUs reserved for each replica's actor (fractions allowed); on GPUs, one GPU each too.
    # None: fitted to the Ray cluster when the app is built (pipeline/serve/fit.py).
    num_cpus: float | None = None
    # Torch threads of each replica's engine. None: Ray's (OMP_NUM_THREADS, the floor of the
    # replica's CPUs), except that a fitted share sets it to the cluster's CPUs per replica
    # (pipeline/serve/fit.py): the share is capped at one CPU for scheduling, not for compute.
    torch_threads: int | None = None
    # The replicas' malloc (actors/allocator.py): tcmalloc where the machine has it.
    allocator: str = "auto"
    # Text inside chat messages that spells a special token (`<|im_end|>`) is tokenized as
    # plain text, so a client cannot forge a turn; True tokenizes it as the token (HF's default).
    allow_special_tokens_in_messages: bool = False
    # A chat template's text used instead of the tokenizer's (vLLM's --chat-template); a
    # request's own `chat_template` field overrides it for that request.
    chat_template: str | None = None
    # A request's own `chat_template` runs a client's Jinja in the replica (transformers renders
    # it in a sandbox, which bounds what it reaches but not what it costs): refused unless the
    # operator trusts the clients, as vLLM's --trust-request-chat-template.
    trust_request_chat_template: bool = False
    # How many replicas serve (each with its own engine): fixed, or Serve's autoscaling.
    replicas: Replicas = field(default_factory=Replicas)
    # With more than one replica, a front reads each request and Serve's request router sends
    # it to the replica holding its prompt's longest prefix (pipeline/serve/router.py).
    prefix_routing: bool = True

    def __post_init__(self) -> None:
        check_allocator(self.allocator)
        if self.engine.chunk_size is None:  # online: a long prompt shares steps with newcomers
            object.__setattr__(
                self, "engine", replace(self.engine, chunk_size=serve_chunk_size(self.engine))
            )
        for name in (
            "max_waiting",
            "max_body_bytes",
            "max_tokens_limit",
            "max_slow_bodies_per_client",
            "max_slow_bodies",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("max_ongoing_requests", "max_requests_per_client"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 (or None), got {value!r}")
        queued = self.max_queued_requests
        if queued is not None and (not isinstance(queued, int) or (queued < 1 and queued != -1)):
            raise ValueError(
                f"max_queued_requests must be an integer >= 1, or -1 for no limit (or None), "
                f"got {queued!r}"
            )
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s}")
        if self.max_queue_wait_s is not None and not self.max_queue_wait_s > 0:
            raise ValueError(f"max_queue_wait_s must be > 0 (or None), got {self.max_queue_wait_s}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if not 1 <= self.default_completion_tokens <= self.max_tokens_limit:
            raise ValueError(
                "default_completion_tokens must be in [1, max_tokens_limit="
                f"{self.max_tokens_limit}], got {self.default_completion_tokens}"
            )
        if self.num_cpus is not None and self.num_cpus < 0:
            raise ValueError(f"num_cpus must be >= 0, got {self.num_cpus}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {self.torch_threads}")

    @property
    def ongoing_limit(self) -> int:
        """Serve's max_ongoing_requests for the replica (see max_ongoing_requests)."""
        if self.max_ongoing_requests is not None:
            return self.max_ongoing_requests
        return self.max_waiting + self.engine.max_num_seqs + self.max_slow_bodies + 64

    @property
    def queued_limit(self) -> int:
        """Serve's max_queued_requests for the engine deployment (see max_queued_requests)."""
        if self.max_queued_requests is not None:
            return self.max_queued_requests
        return self.ongoing_limit * self.replicas.highest

    @property
    def model_name(self) -> str:
        """The name served in /v1/models and expected in `model`."""
        if self.served_model_name:
            return self.served_model_name
        return Path(self.engine.model).name or self.engine.model


def serve_chunk_size(engine: EngineConfig) -> int:
    """Serving's prefill tokens per request per step when the engine names none: half the
    step budget, so one long prompt leaves half of every step to decodes and newcomers (and
    with a chunk size the scheduler keeps room for a newcomer however many prompts prefill)."""
    return max(1, engine.max_num_batched_tokens // 2)


def prefix_routed(config: ServeConfig) -> bool:
    """Whether the app routes by prefix: on unless turned off, when there can be more than one
    replica."""
    return config.prefix_routing and config.replicas.highest > 1
