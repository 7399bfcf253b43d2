"""The tokenizer actors get the tokenizer the driver loaded (pickled to them, as Ray sends
their constructor's arguments) instead of each loading it: a fresh actor that loads it imports
torch through transformers' AutoConfig (~2 s on 2 cores), one that unpickles it does not. The
rows it tokenizes are the ones a tokenizer loaded in the actor gives. The engine actors get the
same tokenizer (loaded once on the driver) and build their engine on it. No Ray: the stage is
built in process from the arguments the job gives its actors, after a pickle round trip."""

from __future__ import annotations

import json
import pickle
from dataclasses import replace
from pathlib import Path

import pyarrow as pa

from actors import LLMEngine
from actors.config import EngineConfig, SamplingParams
from pipeline.config import InputConfig, JobConfig, PromptConfig
from pipeline.job.run import job_processor, prepare
from pipeline.stages import stage
from pipeline.stages.infer import InferStage
from pipeline.stages.tokenize import TokenizeStage
from tests.fresh_python import run_python


def _config(tiny_model_dir: Path, tmp_path: Path, prompt: PromptConfig) -> JobConfig:
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "hello"}) + "\n")
    return JobConfig(
        input=InputConfig(str(tmp_path / "in.jsonl")),
        prompt=prompt,
        output=str(tmp_path / "out"),
        engine=EngineConfig(model=str(tiny_model_dir), dtype="float32"),
    )


def _rows(tokenizer_stage: TokenizeStage, prompts: list[str]) -> list[dict]:
    ids = [str(i) for i in range(len(prompts))]
    return tokenizer_stage(pa.table({stage.ID: ids, "prompt": prompts})).to_pylist()


def test_the_actors_tokenize_with_the_drivers_tokenizer_as_with_their_own(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    prompts = ["hello there", "", "a longer prompt, with punctuation: ok?", "é ü 字"]
    for prompt in (
        PromptConfig(prompt_column="prompt"),
        PromptConfig(prompt_column="prompt", chat=True),
    ):
        config = _config(tiny_model_dir, tmp_path, prompt)
        _, args = job_processor(config, prepare(config))._tokenizer(())
        kwargs = pickle.loads(pickle.dumps(args["fn_constructor_kwargs"]))  # as Ray sends them
        assert kwargs["tokenizer"] is not None  # loaded on the driver
        sent = TokenizeStage(*args["fn_constructor_args"], **kwargs)
        own = TokenizeStage(*args["fn_constructor_args"], **{**kwargs, "tokenizer": None})
        assert _rows(sent, prompts) == _rows(own, prompts)
        assert any(r[stage.PROMPT_TOKEN_IDS] for r in _rows(sent, prompts))


def test_the_engine_actor_builds_its_engine_on_the_drivers_tokenizer(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = _config(tiny_model_dir, tmp_path, PromptConfig(prompt_column="prompt"))
    prepared = prepare(config)
    processor = job_processor(config, prepared)
    loaded = processor._driver_tokenizer()
    assert loaded is not None
    # loaded once on the driver: the tokenizer actors get the same one
    assert processor._tokenizer(())[1]["fn_constructor_kwargs"]["tokenizer"] is loaded
    sent = pickle.loads(pickle.dumps(loaded))  # as Ray sends it
    sampling = SamplingParams(max_tokens=5)
    infer = InferStage(
        config.engine, sampling, tokenizer=sent, resolved_model=prepared.resolved_model
    )
    assert infer.engine.tokenizer is sent
    own = LLMEngine(config.engine)  # loads its own tokenizer
    prompts = [sent.encode(p) for p in ("hello there", "é ü 字", "a b c d e f")]
    got = infer.engine.generate(prompts, sampling)
    want = own.generate(prompts, sampling)
    assert [(o.token_ids, o.text) for o in got] == [(o.token_ids, o.text) for o in want]
    assert any(o.text for o in got)


def test_a_remote_code_tokenizer_is_still_loaded_by_the_actors(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = _config(tiny_model_dir, tmp_path, PromptConfig(prompt_column="prompt"))
    prepared = prepare(config)
    config = replace(config, engine=replace(config.engine, trust_remote_code=True))
    _, args = job_processor(config, prepared)._tokenizer(())
    assert args["fn_constructor_kwargs"]["tokenizer"] is None


def test_a_tokenizer_actor_never_imports_torch(tiny_model_dir: Path, tmp_path: Path) -> None:
    """What a tokenizer actor does, in a fresh process: unpickle its stage's arguments (the
    driver's tokenizer, the resolved model), build the stage and tokenize. torch stays out
    (actors/loader.py imports it only to load a model): it cost each actor ~1.4 s of
    imports, 2 of the 3 s of CPU a tokenizer actor took per job."""
    config = _config(tiny_model_dir, tmp_path, PromptConfig(prompt_column="prompt", chat=True))
    _, args = job_processor(config, prepare(config))._tokenizer(())
    sent = tmp_path / "args.pkl"
    sent.write_bytes(pickle.dumps((args["fn_constructor_args"], args["fn_constructor_kwargs"])))
    script = (
        "import pickle, sys\n"
        "import pyarrow as pa\n"
        "from pipeline.stages.tokenize import TokenizeStage\n"
        f"a, kw = pickle.loads(open({str(sent)!r}, 'rb').read())\n"
        "rows = TokenizeStage(*a, **kw)(pa.table({'id': ['0'], 'prompt': ['hi']})).to_pylist()\n"
        "assert rows[0]['prompt_token_ids'], rows\n"
        "print('torch' in sys.modules)\n"
    )
    done = run_python(script)
    assert done.stdout.strip() == "False", done.stdout
