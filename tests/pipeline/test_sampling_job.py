"""Per-row sampling overrides through the offline job change what is generated, as vLLM
defines them: checked against first-principles greedy references of the tiny model
(Hugging Face forward passes), in one job run where greedy and random rows share batches.

Logprobs are not an output column of the job; tests/actors/test_logprobs_hf.py checks them
on the engine. Penalties and logit_bias are compared with first-principles references (the
model's logits adjusted by hand, tests/sampling_cases.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.config import EngineConfig, SamplingParams
from pipeline.config import ComputeConfig, InputConfig, JobConfig, PlanConfig, PromptConfig
from pipeline.io.lineage import LINEAGE_FILE
from pipeline.job.run import run_job
from tests.actors.reference import torch_threads
from tests.pipeline.test_job import read_output
from tests.sampling_cases import (
    EOS_AT,
    EOS_ID,
    EOS_PROMPT,
    STOP_PROMPT,
    greedy_loop,
    penalised_greedy,
    stop_string,
    tokens_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).parents[2]
PROMPT = "Once upon a time"
N = 12
BAD_PENALTIES = (1e-300, 1e300)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):  # noqa: ANN201
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return tokenizer, model


@pytest.fixture(scope="module")
def cases(reference) -> dict[str, tuple[str, dict]]:  # noqa: ANN001
    """Row id -> (prompt, sampling overrides)."""
    tokenizer, model = reference
    ids = tokenizer.encode(STOP_PROMPT, add_special_tokens=False)
    with torch_threads(1):
        full = greedy_loop(model, ids, 16)
    stop = stop_string(tokenizer.decode(full, skip_special_tokens=True))
    return {
        "greedy": (PROMPT, {}),
        "seed7-a": (PROMPT, {"temperature": 1.0, "seed": 7}),
        "seed7-b": (PROMPT, {"temperature": 1.0, "seed": 7}),
        "seed8": (PROMPT, {"temperature": 1.0, "seed": 8}),
        "top-k-1": (PROMPT, {"temperature": 1.0, "seed": 3, "top_k": 1}),
        "top-p-tiny": (PROMPT, {"temperature": 1.0, "seed": 3, "top_p": 1e-5}),
        "stop": (STOP_PROMPT, {"max_tokens": 16, "stop": [stop]}),
        "eos": (EOS_PROMPT, {"max_tokens": 10}),
        "ignore-eos": (EOS_PROMPT, {"max_tokens": 10, "ignore_eos": True}),
        "min-tokens": (EOS_PROMPT, {"max_tokens": 10, "min_tokens": EOS_AT + 2}),
        "presence": (PROMPT, {"presence_penalty": -2.0, "ignore_eos": True}),
        "bias": (
            PROMPT,
            {"logit_bias": {"42": 5.0}, "frequency_penalty": 2.0, "ignore_eos": True},
        ),
        # 0 and inf in float32: the sampler's logits were infinite, the text garbage (issue 31)
        **{f"rep-{value:g}": (PROMPT, {"repetition_penalty": value}) for value in BAD_PENALTIES},
    }


@pytest.fixture(scope="module")
def job_folder(ray_cluster, tiny_model_dir, cases, tmp_path_factory) -> Path:  # noqa: ANN001
    """The job's output folder (one run for the module)."""
    folder = tmp_path_factory.mktemp("sampling-job")
    table = [
        {"id": key, "prompt": prompt, "sampling": json.dumps(overrides)}
        for key, (prompt, overrides) in cases.items()
    ]
    pq.write_table(pa.Table.from_pylist(table), folder / "in.parquet")
    run_job(_config(folder / "in.parquet", tiny_model_dir, folder / "out"))
    return folder / "out"


def _config(table: Path, model: Path, output: Path, max_tokens: int = N) -> JobConfig:
    return JobConfig(
        input=InputConfig(str(table)),
        prompt=PromptConfig(prompt_column="prompt", sampling_column="sampling"),
        output=str(output),
        engine=EngineConfig(dtype="float32", model=str(model), max_num_seqs=16),
        sampling=SamplingParams(max_tokens=max_tokens),
        plan=PlanConfig(num_partitions=1),
        compute=ComputeConfig(num_actors=1, num_cpus_per_actor=0.25, resources=(("fake_gpu", 1),)),
    )


@pytest.fixture(scope="module")
def job_output(job_folder, cases) -> dict[str, dict]:  # noqa: ANN001
    out = read_output(job_folder)
    assert set(out) == set(cases)
    assert all(r["error"] is None for key, r in out.items() if not key.startswith("rep-"))
    return out


def test_a_penalty_float32_cannot_hold_is_an_error_row(job_output) -> None:  # noqa: ANN001
    for value in BAD_PENALTIES:
        row = job_output[f"rep-{value:g}"]
        assert row["error"] is not None and "repetition_penalty" in row["error"], row
        assert "float32" in row["error"] and not row["generated_token_ids"], row


def test_temperature_seed_top_k_top_p(job_output, reference) -> None:  # noqa: ANN001
    tokenizer, model = reference
    with torch_threads(1):
        greedy = greedy_loop(model, tokenizer.encode(PROMPT, add_special_tokens=False), N)
    ids = {key: row["generated_token_ids"] for key, row in job_output.items()}
    assert ids["greedy"] == greedy
    assert ids["seed7-a"] != greedy and len(ids["seed7-a"]) == N  # sampling samples
    assert ids["seed7-a"] == ids["seed7-b"]  # same seed, same tokens (in one batch too)
    assert ids["seed8"] != ids["seed7-a"]
    assert ids["top-k-1"] == greedy
    assert ids["top-p-tiny"] == greedy


def test_stop_string_cut_eos_ignore_eos_min_tokens(job_output, cases, reference) -> None:  # noqa: ANN001
    tokenizer, model = reference
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    with torch_threads(1):
        stop_ids = tokenizer.encode(STOP_PROMPT, add_special_tokens=False)
        full = greedy_loop(model, stop_ids, 16)
        eos_ids = tokenizer.encode(EOS_PROMPT, add_special_tokens=False)
        natural = greedy_loop(model, eos_ids, 10)
        past = greedy_loop(model, eos_ids, 10, eos_stops=False)
        late = greedy_loop(model, eos_ids, 10, min_tokens=EOS_AT + 2)

    stop = cases["stop"][1]["stop"][0]
    row = job_output["stop"]
    assert row["generated_text"] == decode(full)[: decode(full).index(stop)]  # cut, OpenAI-like
    assert row["finish_reason"] == "stop"
    assert row["generated_token_ids"] == full[: tokens_until(tokenizer, full, stop)]

    assert natural[-1] == EOS_ID and len(natural) == EOS_AT + 1  # the precondition
    row = job_output["eos"]
    assert (row["generated_token_ids"], row["finish_reason"]) == (natural, "stop")
    assert row["generated_text"] == decode(natural)

    row = job_output["ignore-eos"]
    assert (row["generated_token_ids"], row["finish_reason"]) == (past, "length")
    assert EOS_ID in past

    row = job_output["min-tokens"]
    assert row["generated_token_ids"] == late and EOS_ID not in late[: EOS_AT + 2]
    assert late[:EOS_AT] == natural[:EOS_AT]  # the same until the EOS it could not choose


def test_penalties_and_logit_bias(job_output, cases, reference) -> None:  # noqa: ANN001
    tokenizer, model = reference
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    with torch_threads(1):
        plain = greedy_loop(model, ids, N, eos_stops=False)
        for key in ("presence", "bias"):
            params = SamplingParams(max_tokens=N, **cases[key][1])
            expected, _ = penalised_greedy(model, ids, params)
            assert expected != plain  # a visible effect
            assert job_output[key]["generated_token_ids"] == expected
    # +5 makes token 42 win until frequency_penalty 2 per use has taken the bias back
    assert 1 < job_output["bias"]["generated_token_ids"].count(42) < N


def test_output_parquet_schema(job_folder) -> None:  # noqa: ANN001
    """Every output file has the documented columns, in order, with their Arrow types (written
    out here, not taken from the code that writes them)."""
    files = sorted(job_folder.glob("*.parquet"))
    assert files
    expected = {
        "id": pa.string(),
        # a sampling column may ask for n > 1: each row's samples are numbered
        "sample_index": pa.int32(),
        "generated_text": pa.string(),
        "generated_token_ids": pa.list_(pa.int32()),
        "finish_reason": pa.string(),
        "num_prompt_tokens": pa.int32(),
        "num_cached_tokens": pa.int32(),
        "num_generated_tokens": pa.int32(),
        "time_to_first_token_s": pa.float64(),
        "error": pa.string(),
        "shard": pa.string(),
        "prefix_group": pa.string(),
        "shared_prefix_len": pa.int32(),
    }
    for path in files:
        schema = pq.read_schema(path)
        assert [(f.name, f.type) for f in schema] == list(expected.items()), path


def test_rerun_with_another_lineage_exits_2_untouched_and_overwrite_starts_over(
    job_folder, tiny_model_dir, tmp_path
) -> None:  # noqa: ANN001
    """The module's finished folder, rerun by the CLI with another --max-tokens: exit 2 naming
    the field, before Ray, every file byte for byte as it was; then `overwrite` regenerates
    everything with the new lineage, the earlier run's files gone and a foreign file kept."""
    out = tmp_path / "out"
    shutil.copytree(job_folder, out)
    (out / "theirs.txt").write_text("the user's own file")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert LINEAGE_FILE in before
    table = job_folder.parent / "in.parquet"
    args = [
        "--input",
        str(table),
        "--output",
        str(out),
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
    ]
    args += ["--prompt-column", "prompt", "--sampling-column", "sampling"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "jobs/generate.py", *args, "--max-tokens", str(N + 1)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"sampling.max_tokens: {N} (folder) != {N + 1} (this job)" in done.stderr
    assert "Started a local Ray" not in done.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    old = {p.name for p in out.glob("*.parquet")}
    run_job(replace(_config(table, tiny_model_dir, out, max_tokens=2), overwrite=True))
    assert (out / "theirs.txt").read_text() == "the user's own file"  # foreign: stays
    (out / "theirs.txt").unlink()  # (pyarrow would read it as data)
    rows, earlier = read_output(out), read_output(job_folder)
    assert set(rows) == set(earlier)
    assert all((r["error"] is None) == (not key.startswith("rep-")) for key, r in rows.items())
    greedy = earlier["greedy"]["generated_token_ids"]
    assert rows["greedy"]["generated_token_ids"] == greedy[:2]  # regenerated: 2 tokens now
    assert not old & {p.name for p in out.glob("*.parquet")}  # the earlier files are gone
    assert json.loads((out / LINEAGE_FILE).read_text())["sampling"]["max_tokens"] == 2
