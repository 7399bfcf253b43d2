"""Continuous feed: the next shard's prompts join the running batch before the previous
shard's last request finishes (seen in the engine's steps), outputs stay token-identical to
`LLMEngine.generate` alone, and the job with many small shards equals the engine (that job
is test_restart_limit.py's rerun)."""

from __future__ import annotations

import threading
from collections import defaultdict
from pathlib import Path

import pytest

from actors import LLMEngine
from actors.config import EngineConfig, SamplingParams
from packing import PrefixGroup
from pipeline.config import JobConfig, PromptConfig
from pipeline.stages.engine_actor import shards_in_flight
from pipeline.stages.feed import EngineFeed
from pipeline.stages.prompts import PromptBuilder, merge_sampling
from tests.pipeline.data import MALFORMED, TEMPLATE, rows
from tests.pipeline.test_job import make_config

OPENING = "Read the note, then answer. The note is about tea, its growers and its trade."


def _shard(engine: LLMEngine, note: str, questions: list[str]) -> tuple[list, list]:
    """Token prompts sharing a long opening (a two-level group: the opening, then the note)."""
    tok = engine.tokenizer
    opening = tok.encode(OPENING, add_special_tokens=False)
    with_note = opening + tok.encode(note, add_special_tokens=False)
    prompts = [
        with_note + tok.encode(f" Question: {q}", add_special_tokens=False) for q in questions
    ]
    members = tuple(range(len(prompts)))
    groups = [PrefixGroup(len(opening), members), PrefixGroup(len(with_note), members[1:], 0)]
    return prompts, groups


class StepLog:
    """Records, after each engine step, the ids of the running requests; step `gate_at` waits
    for `gate` (so a test can put a shard in before it, whatever the threads' speeds)."""

    def __init__(self, engine: LLMEngine, gate_at: int) -> None:
        self.running: list[set[str]] = []
        self.first_step = threading.Event()
        self.gate = threading.Event()
        step = engine.step

        def logged_step():  # noqa: ANN202
            if len(self.running) == gate_at:
                assert self.gate.wait(120), "the test never opened the gate"
            outputs = step()
            self.running.append({r.request_id for r in engine.scheduler.running})
            self.first_step.set()
            return outputs

        engine.step = logged_step  # type: ignore[method-assign]


def test_next_shard_is_admitted_while_the_previous_one_decodes(tiny_model_dir: Path) -> None:
    config = EngineConfig(dtype="float32", model=str(tiny_model_dir), max_num_seqs=64)
    engine = LLMEngine(config)
    log = StepLog(engine, gate_at=1)
    feed = EngineFeed(engine, lambda: LLMEngine(config), lambda e: None)
    a_prompts, a_groups = _shard(engine, "Green tea grows in hills.", ["why", "who", "where"])
    b_prompts, b_groups = _shard(engine, "Black tea is fermented.", ["how", "when", "what", "a"])
    long = SamplingParams(max_tokens=12, ignore_eos=True)
    short = SamplingParams(max_tokens=5, ignore_eos=True)
    a_params, b_params = [long] * len(a_prompts), [short] * len(b_prompts)

    a = feed.submit("a", a_prompts, a_params, a_groups)
    assert log.first_step.wait(120)  # shard a is in the engine, one step done
    b = feed.submit("b", b_prompts, b_params, b_groups)
    log.gate.set()
    a_out, b_out = a.result(timeout=120), b.result(timeout=120)

    a_ids = {o.request_id for o in a_out}
    b_ids = {o.request_id for o in b_out}
    together = [i for i, running in enumerate(log.running) if running & a_ids and running & b_ids]
    assert together, "shard b never ran in the same step as shard a"
    a_last = max(i for i, running in enumerate(log.running) if running & a_ids)
    assert together[0] < a_last  # b was admitted while a still had requests to decode
    assert all(len(o.token_ids) == 12 for o in a_out)
    # b's members share its prefix groups across the boundary: computed once, then cached
    assert all(o.num_cached_tokens > 0 for o in b_out)

    # Token-identical to each shard alone on a fresh engine.
    for prompts, params, groups, got in (
        (a_prompts, a_params, a_groups, a_out),
        (b_prompts, b_params, b_groups, b_out),
    ):
        alone = LLMEngine(config).generate(prompts, params, groups)
        assert [o.token_ids for o in got] == [o.token_ids for o in alone]


def test_a_failing_engine_fails_the_shards_in_it_and_goes_on(tiny_model_dir: Path) -> None:
    config = EngineConfig(dtype="float32", model=str(tiny_model_dir), max_num_seqs=64)
    engine = LLMEngine(config)
    step = engine.step
    calls = {"n": 0}

    def failing_once():  # noqa: ANN202
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return step()

    engine.step = failing_once  # type: ignore[method-assign]
    feed = EngineFeed(engine, lambda: LLMEngine(config), lambda e: None)
    prompts, groups = _shard(engine, "Oolong is rolled.", ["why", "who"])
    params = [SamplingParams(max_tokens=4, ignore_eos=True)] * len(prompts)
    with pytest.raises(RuntimeError, match="boom"):
        feed.generate("bad", prompts, params, groups)
    outs = feed.generate("good", prompts, params, groups)
    alone = LLMEngine(config).generate(prompts, params, groups)
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]


def test_given_no_engine_the_feed_builds_it_in_the_thread_that_steps_it(
    tiny_model_dir: Path,
) -> None:
    """One thread runs all of the engine's torch work (pipeline/stages/feed.py says why): the
    engine is built in the feed thread, every step runs there, and a build error is raised
    by the constructor."""
    config = EngineConfig(dtype="float32", model=str(tiny_model_dir), max_num_seqs=64)
    threads: dict[str, set[str]] = defaultdict(set)

    def build() -> LLMEngine:
        threads["build"].add(threading.current_thread().name)
        engine = LLMEngine(config)
        step = engine.step

        def traced():  # noqa: ANN202
            threads["step"].add(threading.current_thread().name)
            return step()

        engine.step = traced  # type: ignore[method-assign]
        return engine

    feed = EngineFeed(None, build, lambda e: None)
    assert threads["build"] == {"engine-feed"}  # built before the constructor returned
    prompts, groups = _shard(feed.engine, "Oolong is rolled.", ["why", "who"])
    params = [SamplingParams(max_tokens=4, ignore_eos=True)] * len(prompts)
    outs = feed.generate("a", prompts, params, groups)
    assert threads["step"] == {"engine-feed"}
    alone = LLMEngine(config).generate(prompts, params, groups)
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]

    def broken() -> LLMEngine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        EngineFeed(None, broken, lambda e: None)


def test_shards_in_flight_cover_the_batch(tmp_path: Path) -> None:
    def in_flight(rows_per_shard: int) -> int:
        config = make_config(tmp_path, tmp_path, tmp_path, max_rows_per_shard=rows_per_shard)
        return shards_in_flight(config.engine, config.plan)

    # make_config's max_num_seqs is 64: shards for twice that in rows, plus one (a shard
    # keeps its place until its last row ends, when most of its rows are long done)
    assert (in_flight(16), in_flight(20), in_flight(128), in_flight(256)) == (9, 8, 2, 2)
    assert in_flight(1) == 16  # a cap: each shard in flight is a thread in the actor


def assert_many_small_shards_equal_the_engine(
    config: JobConfig, out: dict[str, dict], model_dir: Path
) -> None:
    """The job with many small shards (`config`: two rows per shard, so prefix groups are
    split over shard boundaries) wrote `out`: every id once, token-identical to one
    `generate` call on all prompts, each document's prefix computed once. Its job is
    test_restart_limit.py's rerun (one job for both: a job costs ~10 s of process starts)."""
    assert config.plan.max_rows_per_shard == 2
    table = rows()
    assert set(out) == {r["id"] for r in table}
    assert {i for i, r in out.items() if r["error"] is not None} == MALFORMED

    valid = [r for r in table if r["id"] not in MALFORMED]
    engine = LLMEngine(EngineConfig(dtype="float32", model=str(model_dir), max_num_seqs=64))
    builder = PromptBuilder(PromptConfig(template=TEMPLATE))
    params = [
        merge_sampling(config.sampling, {"max_tokens": r["max_tokens"]} if r["max_tokens"] else {})
        for r in valid
    ]
    direct = engine.generate([builder.build(r) for r in valid], params)
    shards, cached = defaultdict(set), defaultdict(list)
    for row, ref in zip(valid, direct, strict=True):
        got = out[row["id"]]
        assert got["generated_token_ids"] == list(ref.token_ids), row["id"]
        assert got["generated_text"] == ref.text
        shards[row["doc_id"]].add(got["shard"])
        cached[row["doc_id"]].append(got["num_cached_tokens"])
    assert max(len(s) for s in shards.values()) >= 2  # groups were split over shards
    for doc, tokens in cached.items():  # each document's prefix was computed once for 2 rows
        assert doc.startswith("short-") or max(tokens) > 64, (doc, tokens)
