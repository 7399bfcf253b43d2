"""The job's default sampling (pipeline/commands/cli.py `job_sampling`): flags given win, else the
model's generation_config.json values (vLLM's --generation-config auto), else SamplingParams'
defaults; `--generation-config vllm` ignores the model's; resolved when the config is built,
so the lineage records what the rows are generated with. No Ray."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
from transformers import GenerationConfig

from actors import SamplingParams
from pipeline.commands.generate import build_config, build_parser
from tests.tiny_models import save_tiny_model

MODEL_DEFAULTS = dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = save_tiny_model(tmp_path_factory.mktemp("gen") / "model")
    GenerationConfig(do_sample=True, eos_token_id=2, **MODEL_DEFAULTS).save_pretrained(folder)
    return folder


def sampling(model: Path, *flags: str) -> SamplingParams:
    args = build_parser().parse_args(
        ["--input", "in.jsonl", "--output", "out", "--prompt-column", "p", "--model", str(model),
         *flags]
    )  # fmt: skip
    return build_config(args).sampling


def test_unset_flags_take_the_models_values(model_dir: Path) -> None:
    got = sampling(model_dir)
    assert {k: asdict(got)[k] for k in MODEL_DEFAULTS} == MODEL_DEFAULTS
    assert got.max_tokens == SamplingParams().max_tokens  # max_new_tokens is not taken


def test_flags_given_win_greedy_included(model_dir: Path) -> None:
    got = sampling(model_dir, "--temperature", "0", "--top-k", "0", "--repetition-penalty", "1")
    assert got.greedy and got.top_k == 0 and got.repetition_penalty == 1.0
    assert got.top_p == 0.8  # not given: the model's


def test_vllm_mode_and_a_model_without_values_keep_our_defaults(model_dir, tmp_path) -> None:  # noqa: ANN001
    assert sampling(model_dir, "--generation-config", "vllm") == SamplingParams()
    assert sampling(save_tiny_model(tmp_path / "plain")) == SamplingParams()


def test_an_unknown_model_is_named_with_its_flag(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--model: "):
        sampling(tmp_path / "missing")
