"""The job resolves its model and its input once each (issue 30, item 5): `prepare` turns
`--model` into an `actors.loader.ResolvedModel` and `--input` into a `read.InputSource`, and
everything after (model facts, lineage, the tokenizer and engine stages, the columns, the
strict check of every file, the partition count) is handed those values. Counted with a
wrapper around the real resolvers, which still run. No Ray: the stages are built in process
from the arguments the job gives its actors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors import loader
from pipeline.config import InputConfig, JobConfig, PromptConfig
from pipeline.io import storage
from pipeline.io.read import check_input, input_columns, resolve_input
from pipeline.job.run import claim_output, job_processor, prepare
from pipeline.stages.infer import InferStage
from pipeline.stages.tokenize import TokenizeStage


def _counted(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[str]:
    """The calls of `module.name` from now on (its argument each), the function still run."""
    calls: list[str] = []
    real = getattr(module, name)

    def counting(path, *args, **kwargs):  # noqa: ANN001, ANN202
        calls.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


def _inputs(folder: Path, files: int = 3) -> Path:
    folder.mkdir()
    for i in range(files):
        rows = [{"prompt": f"say {i} {j}"} for j in range(2)]
        (folder / f"part-{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_a_job_resolves_its_model_once_driver_and_stages_alike(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from actors.config import EngineConfig

    config = JobConfig(
        input=InputConfig(str(_inputs(tmp_path / "in"))),
        prompt=PromptConfig(prompt_column="prompt"),
        output=str(tmp_path / "out"),
        engine=EngineConfig(model=str(tiny_model_dir), dtype="float32", max_num_seqs=4),
    )
    resolved = _counted(monkeypatch, loader, "resolve")
    prepared = prepare(config)  # the checks and the model facts
    claim_output(config, prepared).release()  # the lineage: model and tokenizer identity
    processor = job_processor(config, prepared)
    _, args = processor._tokenizer(())  # what the tokenizer actors are built from
    tokenizer = TokenizeStage(*args["fn_constructor_args"], **args["fn_constructor_kwargs"])
    engine = InferStage(config.engine, config.sampling, resolved_model=processor.resolved_model())
    assert tokenizer.tokenizer is not None and engine.engine is not None
    assert resolved == [str(tiny_model_dir)]  # was 8: prepare 2, lineage 2, stages 4
    assert processor.resolved_model() is prepared.resolved_model


def test_nothing_after_resolve_input_looks_a_path_up_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = resolve_input(InputConfig(str(_inputs(tmp_path / "in"))))
    assert source.num_bytes == sum(p.stat().st_size for p in (tmp_path / "in").iterdir())
    looked_up = _counted(monkeypatch, storage, "resolve")
    assert input_columns(source) == ["prompt"]
    check_input(source)  # every file read, strictly
    assert looked_up == []  # was 4 for these 3 files (columns 1, check 3), and 3 more for sizes


def test_a_node_without_the_drivers_files_resolves_the_name_itself(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    here = loader.resolve_model(str(tiny_model_dir))
    assert here.files() == here.source == loader.ModelSource(tiny_model_dir)
    # what another node gets from the driver: files at paths its own disk does not have
    elsewhere = loader.ModelSource(tmp_path / "driver-only" / "snapshot")
    for source in (elsewhere, loader.ModelSource(tmp_path, "driver-only.gguf")):
        assert loader.ResolvedModel(here.name, source).files() == here.source
