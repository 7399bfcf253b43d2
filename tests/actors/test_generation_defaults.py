"""The model's own sampling defaults (actors/generation_defaults.py), as vLLM's
`--generation-config auto`: generation_config.json's temperature, top_p, top_k, min_p and
repetition_penalty are the defaults of requests that set none, whatever `do_sample` says;
`vllm` ignores them; a request's own values win; Serve's unset fields take them."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from transformers import GenerationConfig

from actors import EngineConfig, LLMEngine, SamplingParams
from pipeline.serve.config import ServeConfig
from pipeline.serve.service import OpenAIService
from tests.tiny_models import save_tiny_model

MODEL_DEFAULTS = dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose generation config samples (Qwen2.5-Instruct's values), EOS 2."""
    folder = save_tiny_model(tmp_path_factory.mktemp("gen") / "model")
    GenerationConfig(
        do_sample=True, bos_token_id=1, eos_token_id=2, pad_token_id=2, **MODEL_DEFAULTS
    ).save_pretrained(folder)
    return folder


def test_auto_takes_the_models_sampling_values(model_dir: Path, caplog) -> None:  # noqa: ANN001
    with caplog.at_level(logging.INFO, logger="actors.generation_defaults"):
        engine = LLMEngine(EngineConfig(dtype="float32", model=str(model_dir), num_kv_blocks=32))
    assert engine.sampling_defaults == MODEL_DEFAULTS
    assert engine.default_params == SamplingParams(**MODEL_DEFAULTS)
    lines = [r.getMessage() for r in caplog.records if r.name == "actors.generation_defaults"]
    assert len(lines) == 1 and "temperature" in lines[0] and "--generation-config vllm" in lines[0]
    # a request without params samples with them (seeded: the same tokens again)
    out = engine.generate(["Hello there"] * 2, None)
    assert all(o.error is None for o in out)


def test_vllm_ignores_them(model_dir: Path, caplog) -> None:  # noqa: ANN001
    with caplog.at_level(logging.INFO, logger="actors.generation_defaults"):
        engine = LLMEngine(
            EngineConfig(
                dtype="float32", model=str(model_dir), num_kv_blocks=32, generation_config="vllm"
            )
        )
    assert engine.sampling_defaults == {} and engine.default_params == SamplingParams()
    lines = [r.getMessage() for r in caplog.records if r.name == "actors.generation_defaults"]
    assert len(lines) == 1 and "ignored" in lines[0]


def test_a_model_without_sampling_values_stays_greedy(tmp_path: Path) -> None:
    engine = LLMEngine(
        EngineConfig(dtype="float32", model=str(save_tiny_model(tmp_path / "m")), num_kv_blocks=32)
    )
    assert engine.sampling_defaults == {} and engine.default_params.greedy


def test_bad_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="generation_config must be 'auto' or 'vllm'"):
        EngineConfig(dtype="float32", generation_config="hf")  # type: ignore[arg-type]


def test_serve_fills_only_the_fields_a_request_leaves_unset(model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(dtype="float32", model=str(model_dir), num_kv_blocks=32))
    service = OpenAIService(
        ServeConfig(served_model_name="m", api_keys_env=None), None, engine.tokenizer, 512,
        49152, engine.sampling_defaults,  # type: ignore[arg-type]
    )  # fmt: skip

    def params(**fields: object) -> SamplingParams:
        body = json.dumps({"model": "m", "prompt": "Hi", **fields}).encode()
        return service.prepare_completion(body).params

    unset = params()
    assert (unset.temperature, unset.top_p, unset.top_k, unset.repetition_penalty) == (
        0.7, 0.8, 20, 1.05,
    )  # fmt: skip
    greedy = params(temperature=0, top_k=0)  # a request's own values win, 0 included
    assert greedy.greedy and greedy.top_k == 0 and greedy.top_p == 0.8
