"""Lineage records and their comparison (no Ray): what a rerun into the same folder must agree
on, the refusal that names the differing fields and leaves the folder as it was, and
`overwrite`, which deletes only the job's own files."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from actors.config import EngineConfig, SamplingParams
from actors.loader import resolve_model
from pipeline.config import InputConfig, JobConfig, PromptConfig
from pipeline.io import lineage
from pipeline.io.output import OutputFolder


def _config(model: Path, out: Path, **sampling) -> JobConfig:
    return JobConfig(
        input=InputConfig("in.parquet"),
        prompt=PromptConfig(prompt_column="prompt"),
        output=str(out),
        engine=EngineConfig(dtype="float32", model=str(model)),
        sampling=SamplingParams(**{"max_tokens": 4, **sampling}),
    )


def _record(config: JobConfig) -> dict:
    return lineage.job_lineage(config, "id", (), 512, resolve_model(config.engine.model))


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_record_is_stable_and_names_what_changed(tiny_model_dir, tmp_path):
    config = _config(tiny_model_dir, tmp_path / "out")
    first = _record(config)
    assert first == _record(config)  # cheap and deterministic
    assert first["raypack"] == lineage.raypack_version() != ""
    assert first["model"]["path"] == str(tiny_model_dir.resolve())
    assert first["prompt"]["prompt_column"] == "prompt" and first["prompt"]["id_column"] == "id"

    other = _record(replace(config, sampling=SamplingParams(max_tokens=8)))
    assert lineage.differences(first, other) == [("sampling.max_tokens", 4, 8)]
    chat = replace(config, prompt=PromptConfig(prompt_column="prompt", chat=True))
    assert [d[0] for d in lineage.differences(first, _record(chat))] == ["prompt.chat"]
    words = lineage.describe(lineage.differences(first, other))
    assert "sampling.max_tokens: 4 (folder) != 8 (this job)" in words
    assert "(absent)" in lineage.describe(lineage.differences({"a": 1}, {}))


def test_model_fingerprint_follows_the_weights(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    resolved = resolve_model(str(model))
    before = lineage.model_identity(resolved)
    tokenizer = lineage.tokenizer_identity(resolved)
    assert before == lineage.model_identity(resolved)
    (model / ".cache" / "huggingface").mkdir(parents=True)  # a download tool's metadata
    (model / ".cache" / "huggingface" / "x.metadata").write_text("changes on every download")
    assert before == lineage.model_identity(resolved)
    weights = next(model.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten in place
    after = lineage.model_identity(resolved)
    assert after["fingerprint"] != before["fingerprint"] and after["path"] == before["path"]
    assert lineage.tokenizer_identity(resolved) == tokenizer  # the tokenizer did not change
    (model / "tokenizer_config.json").write_text(
        (model / "tokenizer_config.json").read_text().replace("}", ', "x": 1}', 1)
    )
    assert lineage.tokenizer_identity(resolved) != tokenizer


def test_settle_writes_checks_refuses_untouched_and_overwrites_own_files(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    config = _config(tiny_model_dir, out)
    with OutputFolder.claim(str(out)) as folder:
        lineage.settle(folder, _record(config))
        prefix = folder.filename_prefix()
    written = json.loads((out / lineage.LINEAGE_FILE).read_text())
    assert written["sampling"]["max_tokens"] == 4
    (out / f"{prefix}_000000_000000.parquet").write_bytes(b"this job's data")
    (out / "_summary.json").write_text("{}")
    (out / "theirs.parquet").write_bytes(b"a file the job did not write")

    before = _snapshot(out)
    with OutputFolder.claim(str(out)) as folder:  # the same lineage: a resume, nothing written
        lineage.settle(folder, _record(config))
    assert _snapshot(out) == before

    other = _config(tiny_model_dir, out, max_tokens=8, temperature=0.5)
    with OutputFolder.claim(str(out)) as folder:
        with pytest.raises(lineage.LineageMismatch) as info:
            lineage.settle(folder, _record(other))
    message = str(info.value)
    assert "sampling.max_tokens: 4 (folder) != 8 (this job)" in message
    assert "sampling.temperature: 0.0 (folder) != 0.5 (this job)" in message
    assert "--overwrite" in message
    assert _snapshot(out) == before  # the lock came and went; every file as it was

    with OutputFolder.claim(str(out)) as folder:
        lineage.settle(folder, _record(other), overwrite=True)
    left = _snapshot(out)
    assert f"{prefix}_000000_000000.parquet" not in left and "_summary.json" not in left
    assert left["theirs.parquet"] == b"a file the job did not write"  # foreign: stays
    assert lineage.read(str(out))["sampling"]["max_tokens"] == 8


def test_unreadable_record_is_refused_unless_overwritten(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / lineage.LINEAGE_FILE).write_text("not json")
    config = _config(tiny_model_dir, out)
    with OutputFolder.claim(str(out)) as folder:
        with pytest.raises(lineage.LineageMismatch, match="unreadable"):
            lineage.settle(folder, _record(config))
        lineage.settle(folder, _record(config), overwrite=True)
    assert lineage.read(str(out)) == _record(config)


def test_a_folder_from_before_dtype_auto_continues_with_auto_or_float32(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    old = _record(
        replace(_config(tiny_model_dir, out), engine=EngineConfig(model=str(tiny_model_dir)))
    )
    old["engine"]["dtype"] = None  # what the default wrote before dtype="auto"
    out.mkdir()
    (out / lineage.LINEAGE_FILE).write_text(json.dumps(old))
    for dtype in ("auto", "float32"):
        config = replace(
            _config(tiny_model_dir, out),
            engine=EngineConfig(model=str(tiny_model_dir), dtype=dtype),
        )
        with OutputFolder.claim(str(out)) as folder:
            lineage.settle(folder, _record(config))
    bf16 = replace(
        _config(tiny_model_dir, out),
        engine=EngineConfig(model=str(tiny_model_dir), dtype="bfloat16"),
    )
    with OutputFolder.claim(str(out)) as folder, pytest.raises(lineage.LineageMismatch):
        lineage.settle(folder, _record(bf16))
