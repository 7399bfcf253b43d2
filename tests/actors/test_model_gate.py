"""The architecture gate (actors/architectures.py): a model whose attention does not go
through transformers' attention interface (gptj, bloom) and every refused config feature is
refused at load with a message naming the model type and the feature, from the config before
any weight is read; the commands exit 2 with it before Ray starts; a model type outside the
tested matrix that passes the checks runs, with one warning."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from actors import EngineConfig, LLMEngine, SamplingParams
from actors.architectures import REFUSED_FEATURES, UnsupportedModelError, causal_lm_class
from actors.loader import checked_config
from tests.fresh_python import run_python
from tests.model_matrix import matrix_config, matrix_model

TINY = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, vocab_size=256)


def _tiny(model_type: str, **fields: Any) -> Any:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**TINY, **fields})
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


# A config carrying each refused feature: (matrix entry or model type, fields). Every entry of
# REFUSED_FEATURES needs one (test below); a case whose feature is no longer refused is unused.
# Features once refused, now run by every backend (tests/actors/test_sliding_window.py,
# test_rope_scaling.py): the gate lets them through.
IMPLEMENTED_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "sliding_window": ("mistral", {"sliding_window": 32}),
    "attn_logit_softcapping": ("gemma2", {"attn_logit_softcapping": 50.0}),
    "query_pre_attn_scalar": ("gemma2", {"query_pre_attn_scalar": 256}),
    "rope_type longrope": (
        "phi3",
        {
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 128,
            }
        },
    ),
    "rope_type dynamic": (
        "llama",
        {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
    ),
}

FEATURE_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "sliding window outside the attention call": (
        "model_type:qwen2_moe",  # its first layer below max_window_layers is a sliding one
        {"sliding_window": 32, "use_sliding_window": True, "max_window_layers": 1},
    ),
    "bidirectional attention": ("gemma3_text", {"use_bidirectional_attention": True}),
    "alibi": ("model_type:falcon", {"alibi": True, "new_decoder_architecture": True}),
    "cross-attention": ("model_type:mllama", {}),
    "multimodal": ("model_type:gemma3", {}),
    "non-attention layers": ("model_type:granitemoehybrid", {}),
    "multi-head latent attention": ("model_type:deepseek_v3", {}),
    "attention sinks": ("model_type:gpt_oss", {}),
}


def _feature_config(
    feature: str, cases: dict[str, tuple[str, dict[str, Any]]] = FEATURE_CASES
) -> Any:
    base, fields = cases[feature]
    if base.startswith("model_type:"):
        return AutoConfig.for_model(base.removeprefix("model_type:"), **fields)
    return matrix_config(base, **fields)


def test_every_refused_feature_has_a_case() -> None:
    assert {f.name for f in REFUSED_FEATURES} <= set(FEATURE_CASES)


@pytest.mark.parametrize("feature", [f.name for f in REFUSED_FEATURES])
def test_a_refused_feature_is_named_with_the_model_type(feature: str) -> None:
    config = _feature_config(feature)
    with pytest.raises(UnsupportedModelError) as info:
        checked_config_of(config)
    message = str(info.value)
    assert f"model type {config.model_type!r}" in message and f"{feature}:" in message
    reason = next(f.reason for f in REFUSED_FEATURES if f.name == feature)
    assert reason in message
    assert isinstance(info.value, ValueError)  # the commands' exit 2


@pytest.mark.parametrize("feature", list(IMPLEMENTED_CASES))
def test_implemented_features_pass_the_gate(feature: str) -> None:
    checked_config_of(_feature_config(feature, IMPLEMENTED_CASES))


def checked_config_of(config: Any) -> None:
    """The gate on a config alone, as the loader runs it before the weights."""
    from actors.architectures import check_config

    check_config(config, causal_lm_class(config))


def test_irrelevant_windows_and_final_softcapping_pass() -> None:
    # a window as long as the context never cuts; qwen2's window only with use_sliding_window
    checked_config_of(matrix_config("gemma2"))
    checked_config_of(matrix_config("qwen2", sliding_window=32, use_sliding_window=False))
    checked_config_of(matrix_config("mistral", sliding_window=512))
    assert matrix_config("gemma2").final_logit_softcapping is not None  # applied by transformers


@pytest.mark.parametrize("model_type", ["gptj", "bloom"])
def test_own_attention_models_are_refused_by_the_engine(model_type: str) -> None:
    model = _tiny(model_type)
    assert not type(model).is_backend_compatible()
    with pytest.raises(UnsupportedModelError) as info:
        LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=8), model=model, tokenizer=object())
    message = str(info.value)
    assert f"model type {model_type!r}" in message and type(model).__name__ in message
    assert "attention interface" in message


@pytest.fixture(scope="module")
def gptj_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A gptj folder with its config only: refused from the config, no weight ever read."""
    folder = tmp_path_factory.mktemp("gptj")
    AutoConfig.for_model("gptj", **TINY).save_pretrained(folder)
    return folder


def test_a_folder_is_refused_from_its_config_before_the_weights(gptj_folder: Path) -> None:
    assert not any(gptj_folder.glob("*.safetensors"))  # loading weights would fail otherwise
    with pytest.raises(UnsupportedModelError, match="'gptj' \\(GPTJForCausalLM\\)"):
        checked_config(str(gptj_folder))
    with pytest.raises(UnsupportedModelError, match="attention interface"):
        LLMEngine(EngineConfig(dtype="float32", model=str(gptj_folder), num_kv_blocks=8))


def test_a_refused_feature_in_a_saved_model(tmp_path: Path) -> None:
    folder = tmp_path / "gemma3_text"
    matrix_config("gemma3_text", use_bidirectional_attention=True).save_pretrained(folder)
    with pytest.raises(UnsupportedModelError, match="'gemma3_text'.*bidirectional attention"):
        LLMEngine(EngineConfig(dtype="float32", model=str(folder), num_kv_blocks=8))


def test_an_untested_model_type_runs_with_one_warning(tokenizer, caplog) -> None:  # noqa: ANN001
    from tests.model_matrix import VOCAB

    model = _tiny("phi", vocab_size=VOCAB, num_key_value_heads=2)
    with caplog.at_level(logging.WARNING, logger="actors.architectures"):
        engine = LLMEngine(
            EngineConfig(dtype="float32", num_kv_blocks=32), model=model, tokenizer=tokenizer
        )
    warnings = [r for r in caplog.records if r.name == "actors.architectures"]
    assert len(warnings) == 1 and "'phi'" in warnings[0].getMessage()
    assert engine.generate(["Hello"], SamplingParams(max_tokens=2))[0].error is None
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="actors.architectures"):
        LLMEngine(
            EngineConfig(dtype="float32", num_kv_blocks=32),
            model=matrix_model("llama"),
            tokenizer=tokenizer,
        )
    assert not [r for r in caplog.records if r.name == "actors.architectures"]


# Both commands' `main` in one fresh Python process (each imports the commands' modules and
# torch before it refuses, ~3-4 s of CPU per process on the 2-core box): each run's exit
# status, whether Ray was started by then (the process has none of its own), and its stderr
# (between the markers: the commands log to the process's stderr).
COMMANDS_SCRIPT = """
import json, sys
import ray
from pipeline.commands import generate, serve
out = []
for name, argv in json.loads(sys.stdin.read()):
    print(f"=== {name}", file=sys.stderr, flush=True)
    code = {"generate": generate.main, "serve": serve.main}[name](argv)
    sys.stderr.flush()
    out.append([code, ray.is_initialized()])
print(json.dumps(out))
"""


def _run_commands(runs: list[tuple[str, list[str]]]) -> list[tuple[int, bool, str]]:
    """Each (command, argv)'s exit status, whether Ray had started, and its stderr."""
    done = run_python(COMMANDS_SCRIPT, input=json.dumps(runs))
    results = json.loads(done.stdout.strip().splitlines()[-1])
    stderrs = done.stderr.split("=== ")[1:]
    assert [e.split("\n", 1)[0] for e in stderrs] == [name for name, _ in runs], done.stderr
    return [
        (code, ray_started, err) for (code, ray_started), err in zip(results, stderrs, strict=True)
    ]


@pytest.mark.timeout(300)
def test_commands_exit_2_naming_the_model_and_feature(gptj_folder: Path, tmp_path: Path) -> None:
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"id": "a", "prompt": "hello"}) + "\n")
    generated, served = _run_commands(
        [
            ("generate", ["--input", str(data), "--output", str(tmp_path / "out"),
                          "--prompt-column", "prompt", "--model", str(gptj_folder)]),
            ("serve", ["--model", str(gptj_folder)]),
        ]
    )  # fmt: skip
    code, ray_started, stderr = generated
    assert code == 2, stderr[-2000:]
    assert f"--model {gptj_folder}" in stderr and "'gptj'" in stderr
    assert "attention interface" in stderr
    assert not ray_started and "Started a local Ray" not in stderr
    assert not (tmp_path / "out").exists()
    code, ray_started, stderr = served
    assert code == 2, stderr[-2000:]
    assert "--model" in stderr and "'gptj'" in stderr
    assert not ray_started and "Started a local Ray" not in stderr


def test_parallel_engines_take_only_verified_model_types(tmp_path: Path) -> None:
    """Before Ray: the commands' check (tests/parallel/test_parallel_architectures.py runs
    the engines)."""
    folder = tmp_path / "gemma"
    matrix_config("gemma").save_pretrained(folder)
    checked_config(str(folder))
    with pytest.raises(UnsupportedModelError, match="'gemma' is not supported with tensor par"):
        checked_config(str(folder), tensor_parallel_size=2)
    with pytest.raises(UnsupportedModelError, match="'gemma' is not supported with pipeline"):
        checked_config(str(folder), pipeline_parallel_size=2)
    phi3 = tmp_path / "phi3"  # pipeline stages take it, tensor parallel does not split it
    matrix_config("phi3").save_pretrained(phi3)
    checked_config(str(phi3), pipeline_parallel_size=2)
    with pytest.raises(UnsupportedModelError, match="'phi3' is not supported with tensor"):
        checked_config(str(phi3), tensor_parallel_size=2)
    llama = tmp_path / "llama"
    matrix_config("llama").save_pretrained(llama)
    checked_config(str(llama), tensor_parallel_size=2, pipeline_parallel_size=2)
