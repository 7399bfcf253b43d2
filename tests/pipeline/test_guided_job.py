"""Guided decoding through the offline job's command line: `--json-schema FILE` for every
row, a per-row `guided_decoding` column (`--sampling-columns`) for some, every schema row's
output parsing and validating, an invalid per-row schema an error row, the schema part of the
lineage, bad flags exit 2 naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.actors.test_guided import SCHEMA
from tests.pipeline.refusals import refusals
from tests.pipeline.test_job import read_output

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [
    "Which animal barked?",
    "Tell me about birds.",
    "The cat sat on the mat.",
    "Score this review: fine.",
    "A dog and a cat met in the park.",
    "Return a label.",
]
CHOICES = ["yes", "no"]
PER_ROW = {
    "choice": {"choice": CHOICES},
    "regex": {"regex": "[0-9]{3}-[a-z]{2}"},
    "bad": {"json": {"type": "nonsense"}},
}


def _args(folder: Path, model: Path, schema: Path) -> list[str]:
    return [
        "--input", str(folder / "in.parquet"),
        "--output", str(folder / "out"),
        "--model", str(model),
        "--prompt-column", "prompt",
        "--sampling-columns", "guided_decoding",
        "--json-schema", str(schema),
        "--max-tokens", "48",
        "--num-partitions", "1",
        "--num-cpus-per-actor", "0.25",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def job(ray_cluster, tiny_model_dir, tmp_path_factory) -> tuple[Path, list[str]]:  # noqa: ANN001
    """One job run: the schema rows and the per-row rows; its folder and arguments."""
    folder = tmp_path_factory.mktemp("guided-job")
    schema = folder / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    rows = [{"id": f"row{i}", "prompt": p, "guided_decoding": None} for i, p in enumerate(PROMPTS)]
    rows += [
        {"id": key, "prompt": PROMPTS[0], "guided_decoding": json.dumps(value)}
        for key, value in PER_ROW.items()
    ]
    pq.write_table(pa.Table.from_pylist(rows), folder / "in.parquet")
    args = _args(folder, tiny_model_dir, schema)
    # The command's main in this process, on the package's Ray (a command process of its own
    # would import torch and Ray again: ~4 s of CPU; the refusals below share one process).
    from pipeline.commands.generate import main

    assert main(args) == 0
    return folder, args


def test_every_schema_row_parses_and_validates(job) -> None:  # noqa: ANN001
    folder, _ = job
    out = read_output(folder / "out")
    assert set(out) == {f"row{i}" for i in range(len(PROMPTS))} | set(PER_ROW)
    for i in range(len(PROMPTS)):
        row = out[f"row{i}"]
        assert row["error"] is None and row["finish_reason"] == "stop", row
        jsonschema.validate(json.loads(row["generated_text"]), SCHEMA)
        # Per-row guidance is on, so `parsed` is the object as JSON text.
        assert json.loads(row["parsed"]) == json.loads(row["generated_text"])
    assert out["choice"]["generated_text"] in CHOICES and out["choice"]["parsed"] is None
    assert out["regex"]["error"] is None
    assert len(out["regex"]["generated_text"]) == 6 and out["regex"]["generated_text"][3] == "-"
    assert "invalid guided json" in out["bad"]["error"]
    assert out["bad"]["generated_token_ids"] == []


BAD_FLAGS = [
    (["--json-schema", "{missing}"], "--json-schema: "),
    (["--json-schema", "{bad}"], "--json-schema: invalid guided json"),
    (["--regex", "[a-z"], "--regex: invalid guided regex"),
    (["--choice", " , "], "--choice: guided choice must list at least one"),
    (["--regex", "a", "--choice", "a,b"], "give one of --json-schema"),
]


def test_another_schema_and_bad_guided_flags_exit_2_before_ray(job, tmp_path) -> None:  # noqa: ANN001
    """Another schema on the job's folder is another lineage, refused; each bad guided flag
    exits 2 naming the flag. All of them before Ray starts, in one command process (each
    command in a process of its own cost ~2.5 s of imports)."""
    folder, args = job
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**SCHEMA, "required": ["label"]}))
    lineage = [*args[: args.index("--json-schema")], "--json-schema", str(other), *args[-6:]]
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "nonsense"}')
    pq.write_table(pa.Table.from_pylist([{"prompt": "x"}]), tmp_path / "in.parquet")
    base = ["--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out")]
    argvs = [lineage] + [
        [
            *base,
            "--prompt-column",
            "prompt",
            *(
                f.replace("{missing}", str(tmp_path / "nope.json")).replace("{bad}", str(bad))
                for f in flags
            ),
        ]
        for flags, _ in BAD_FLAGS
    ]
    runs, _ = refusals(argvs)
    messages = ["sampling.guided_decoding.json", *(message for _, message in BAD_FLAGS)]
    for run, message in zip(runs, messages, strict=True):
        assert run.returncode == 2, run.stderr[-2000:]
        assert message in run.stderr, (message, run.stderr[-2000:])
        assert not run.ray_started, message
