"""The planner, the engine stage and the report as plain callables (no Ray)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.config import EngineConfig, SamplingParams
from actors.outputs import RequestOutput
from packing import PrefixGroup
from pipeline.config import PlanConfig, PromptConfig
from pipeline.io.report import StatsCollector, summarize, write_report
from pipeline.stages import stage
from pipeline.stages.engine_actor import ShardSpread
from pipeline.stages.infer import InferStage
from pipeline.stages.plan import PlanStage, plan_partition
from pipeline.stages.shard_cut import cut_shards
from pipeline.stages.tokenize import TokenizeStage

DOC_A = list(range(100, 180))  # 80 tokens: more than one 64-token key block
DOC_B = list(range(300, 370))


def tokenized(rows: list[tuple[str, list[int] | None, str | None]], sampling=None) -> pa.Table:
    """A table as the tokenizer stage leaves it: (id, tokens, error) per row."""
    from packing import prefix_key

    tokens = [t or [] for _, t, _ in rows]
    return pa.table(
        {
            stage.ID: [r[0] for r in rows],
            "doc": [f"doc-{i}" for i in range(len(rows))],
            stage.PROMPT_TOKEN_IDS: pa.array(tokens, stage.TOKEN_LIST),
            stage.NUM_PROMPT_TOKENS: pa.array([len(t) for t in tokens], pa.int32()),
            stage.SAMPLING: pa.array(sampling or [None] * len(rows), pa.string()),
            stage.ERROR: pa.array([r[2] for r in rows], pa.string()),
            stage.PREFIX_KEY: pa.array(
                [
                    None if r[2] or not t else _signed(prefix_key(t))
                    for r, t in zip(rows, tokens, strict=True)
                ],
                pa.int64(),
            ),
        }
    )


def _signed(key):
    return None if key is None else (key - 2**64 if key >= 2**63 else key)


def test_cut_shards_keeps_groups_whole_and_splits_only_oversized_ones():
    lens = [10] * 12
    groups = [
        PrefixGroup(5, (0, 1, 2)),
        PrefixGroup(0, (3,)),
        PrefixGroup(4, tuple(range(4, 12))),
    ]
    shards, split = cut_shards(groups, lens, max_rows=4, max_tokens=1000)
    assert split == 1  # the 8-row group is over 4 rows
    assert [sum(len(g.members) for g in s) for s in shards] == [4, 4, 4]
    assert shards[0] == [groups[0], groups[1]]
    assert all(g.prefix_len == 4 for s in shards[1:] for g in s)  # prefix repeated per part
    # A token limit splits too: each part pays the prefix again.
    shards, split = cut_shards([PrefixGroup(8, (0, 1, 2, 3))], lens, max_rows=10, max_tokens=14)
    assert split == 1 and [len(s[0].members) for s in shards] == [3, 1]
    assert shards[1][0].prefix_len == 0  # one row alone shares nothing


def test_cut_shards_deals_groups_below_the_row_limit_without_splitting_one():
    """`pack_rows` (a small partition spread over engine actors): the groups in order are
    dealt over ceil(rows / pack_rows) shards, each to the one with the fewest rows, so each
    shard holds a slice of the whole order. A group between `pack_rows` and `max_rows` stays
    whole: its prefix is still computed once."""
    lens = [10] * 12
    groups = [
        PrefixGroup(5, (0, 1, 2)),
        PrefixGroup(4, tuple(range(3, 9))),
        PrefixGroup(0, (9,)),
        PrefixGroup(0, (10,)),
        PrefixGroup(0, (11,)),
    ]
    shards, split = cut_shards(groups, lens, max_rows=8, max_tokens=1000, pack_rows=3)
    assert split == 0
    assert shards == [[groups[0]], [groups[1]], [groups[2], groups[4]], [groups[3]]]
    # One-row groups in the plan's order: every other one to each shard, not halves.
    singles = [PrefixGroup(0, (r,)) for r in range(8)]
    shards, _ = cut_shards(singles, lens, max_rows=8, max_tokens=1000, pack_rows=4)
    assert [[g.members[0] for g in s] for s in shards] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # The token limit still holds: a shard with no room left gets nothing more.
    shards, _ = cut_shards(singles, lens, max_rows=8, max_tokens=20, pack_rows=4)
    assert all(sum(lens[r] for g in s for r in g.members) <= 20 for s in shards)
    assert sorted(g.members[0] for s in shards for g in s) == list(range(8))
    # pack_rows at or over max_rows: cut in order, as without it.
    assert cut_shards(groups, lens, max_rows=8, max_tokens=1000, pack_rows=100) == cut_shards(
        groups, lens, max_rows=8, max_tokens=1000
    )


def test_a_small_partition_spreads_over_the_engine_actors():
    """525 rows, two engine actors: 256-row shards made 256 + 256 + 13 and the actor up first
    could take both large ones. Spread, each actor's `in_flight` shards hold about its share,
    and every row is planned once."""
    rows = [(f"r{i}", [7, i % 50, i], None) for i in range(525)]
    spread = ShardSpread(partitions=1, actors=2, in_flight=2)
    assert spread.rows_per_shard(525, 256) == 132
    shards, stats = plan_partition(tokenized(rows), PlanConfig(), SamplingParams(), [], spread)
    sizes = [len(ids) for ids in shards.column(stage.ID).to_pylist()]
    assert max(sizes) <= 132 and sum(sizes) == 525 == stats.rows
    assert len(sizes) == 4
    assert sorted(i for ids in shards.column(stage.ID).to_pylist() for i in ids) == sorted(
        r[0] for r in rows
    )
    # Two hash partitions of ~262 rows each over the same two actors: the same share.
    assert ShardSpread(partitions=2, actors=2, in_flight=3).rows_per_shard(262, 256) == 88
    # A large partition keeps the full shard; a tiny one still makes shards of a row or more.
    assert ShardSpread(partitions=2, actors=2, in_flight=3).rows_per_shard(50_000, 256) == 256
    assert ShardSpread(partitions=1, actors=4, in_flight=3).rows_per_shard(2, 256) == 1


def test_plan_groups_rows_sharing_a_prefix_and_passes_errors_through():
    rows = [
        ("a0", DOC_A + [1, 2], None),
        ("b0", DOC_B + [5], None),
        ("a1", DOC_A + [3], None),
        ("short", [7, 8, 9], None),
        ("bad", None, "prompt is empty"),
        ("a2", DOC_A + [4, 5, 6], None),
        ("b1", DOC_B + [6, 7], None),
        ("a0", DOC_A + [1, 2], None),  # the same id again: generated once
    ]
    shards, stats = plan_partition(tokenized(rows), PlanConfig(), SamplingParams(), ["doc"])
    assert stats.rows == 7 and stats.duplicate_rows == 1 and stats.error_rows == 1
    got = shards.to_pylist()
    assert got[0][stage.ID] == ["bad"] and got[0][stage.ERROR] == ["prompt is empty"]
    main = got[1]
    groups, start = {}, 0
    for size, plen in zip(main[stage.GROUP_SIZES], main[stage.GROUP_PREFIX_LENS], strict=True):
        groups[tuple(sorted(main[stage.ID][start : start + size]))] = plen
        start += size
    assert groups == {("a0", "a1", "a2"): 80, ("b0", "b1"): 70, ("short",): 0}
    assert main["doc"] == [
        f"doc-{rows.index(next(r for r in rows if r[0] == i))}" for i in main[stage.ID]
    ]
    assert stats.planned_saved_tokens == 80 * 2 + 70
    assert stats.share_degrees == {3: 1, 2: 1, 1: 1}
    assert stats.optimal_saved_tokens >= stats.planned_saved_tokens
    assert sorted(main[stage.PREFIX_GROUP_PREFIX_LENS]) == [70, 80]
    assert main[stage.PREFIX_GROUP_PARENTS] == [-1, -1]


def test_shards_run_the_lowest_ratio_groups_first():
    """The ratio order (a large shared group of short prompts first) cut into shards, the
    shards then taken last-first: fewer engine steps (pipeline/stages/plan.py)."""
    rows = [(f"a{i}", DOC_A + [i], None) for i in range(4)]
    rows += [("long1", list(range(500, 700)), None), ("long2", list(range(800, 990)), None)]
    shards, _ = plan_partition(
        tokenized(rows), PlanConfig(max_rows_per_shard=4), SamplingParams(), []
    )
    got = [sorted(ids) for ids in shards.column(stage.ID).to_pylist()]
    assert got == [["long1", "long2"], ["a0", "a1", "a2", "a3"]]


@pytest.mark.parametrize(("nested", "saved"), [(True, 8 * 3 + 80 + 70), (False, 88 + 78)])
def test_nested_groups_share_a_common_opening_once(nested, saved):
    """Two documents behind one 8-token opening: nested groups compute the opening once, then
    each document once; first-level groups compute opening + document per document."""
    opening = list(range(900, 908))
    rows = [
        ("a0", opening + DOC_A + [1], None),
        ("a1", opening + DOC_A + [2], None),
        ("b0", opening + DOC_B + [3], None),
        ("b1", opening + DOC_B + [4], None),
    ]
    config = PlanConfig(nested=nested)
    shards, stats = plan_partition(tokenized(rows), config, SamplingParams(), [])
    assert stats.planned_saved_tokens == saved
    shard = shards.to_pylist()[0]
    groups = sorted(
        zip(shard[stage.PREFIX_GROUP_PREFIX_LENS], shard[stage.PREFIX_GROUP_PARENTS], strict=True)
    )
    if nested:
        assert groups == [(8, -1), (78, 0), (88, 0)]
    else:
        assert groups == [(78, -1), (88, -1)]


def test_plan_without_grouping_leaves_every_row_alone():
    rows = [(f"a{i}", DOC_A + [i], None) for i in range(5)]
    shards, stats = plan_partition(
        tokenized(rows),
        PlanConfig(prefix_grouping=False, max_rows_per_shard=2),
        SamplingParams(),
        [],
    )
    assert [len(r) for r in shards.column(stage.ID).to_pylist()] == [2, 2, 1]
    assert stats.planned_saved_tokens == 0 and stats.share_degrees == {1: 5}


def test_plan_stage_names_missing_columns():
    with pytest.raises(ValueError, match=r"plan needs column\(s\) 'prefix_key'"):
        PlanStage(PlanConfig(), SamplingParams())(
            pa.table({stage.ID: ["x"]})
            .drop_columns([])
            .append_column(stage.PROMPT_TOKEN_IDS, pa.array([[1]], stage.TOKEN_LIST))
            .append_column(stage.NUM_PROMPT_TOKENS, pa.array([1], pa.int32()))
            .append_column(stage.SAMPLING, pa.array([None], pa.string()))
            .append_column(stage.ERROR, pa.array([None], pa.string()))
        )


def test_tokenize_stage_builds_tokens_keys_and_error_rows():
    from actors.loader import load_tokenizer

    tok = load_tokenizer("smollm2")
    doc = "The heap queue keeps the smallest item at index zero. " * 8
    stage_ = TokenizeStage(
        PromptConfig(template="{doc}\nQ: {q}"),
        model="smollm2",
        max_model_len=200,
        sampling=SamplingParams(max_tokens=4),
        keep_columns=["q"],
        override_columns=["max_tokens"],
        tokenizer=tok,
    )
    batch = pa.table(
        {
            stage.ID: ["a", "b", "c", "d"],
            "doc": [doc, doc, None, doc * 3],
            "q": ["why", "how", "x", "y"],
            "max_tokens": [None, 7, None, None],
        }
    )
    out = stage_(batch).to_pylist()
    assert out[0][stage.ERROR] is None and out[0][stage.SAMPLING] is None
    assert json.loads(out[1][stage.SAMPLING]) == {"max_tokens": 7}
    assert out[0][stage.PREFIX_KEY] == out[1][stage.PREFIX_KEY] is not None  # same first block
    assert (
        out[0][stage.PROMPT_TOKEN_IDS]
        == tok(doc + "\nQ: why", add_special_tokens=False)["input_ids"]
    )
    assert "'doc' is null" in out[2][stage.ERROR] and out[2][stage.PROMPT_TOKEN_IDS] == []
    assert "context of 200" in out[3][stage.ERROR] and out[3][stage.NUM_PROMPT_TOKENS] > 200
    assert out[2][stage.SHUFFLE_KEY] is not None and out[3]["q"] == "y"


@dataclass
class FakeEngine:
    """Echoes the prompt length as the one generated token; records the calls."""

    calls: list = None
    fail: bool = False

    def generate(self, prompts, params, prefix_groups):
        self.calls = (self.calls or []) + [(prompts, params, prefix_groups)]
        if self.fail:
            raise RuntimeError("CUDA error: out of memory")
        return [
            RequestOutput(
                request_id=str(i), num_prompt_tokens=len(p), token_ids=(len(p), params[i].max_tokens),
                text=f"t{len(p)}", finished=True, finish_reason="length",
                num_cached_tokens=next((g.prefix_len for g in prefix_groups if i in g.members), 0),
                arrival_time=1.0, first_token_time=1.5,
            )
            for i, p in enumerate(prompts)
        ]  # fmt: skip


def _shards() -> pa.Table:
    rows = [
        ("bad", None, "prompt is empty"),
        ("a0", DOC_A + [1], None),
        ("a1", DOC_A + [2, 3], None),
        ("solo", [5, 6], None),
    ]
    shards, _ = plan_partition(
        tokenized(rows, sampling=[None, None, '{"max_tokens": 9}', None]),
        PlanConfig(),
        SamplingParams(max_tokens=3),
        ["doc"],
    )
    return shards


def test_infer_stage_passes_groups_and_overrides_to_the_engine():
    engine = FakeEngine()
    infer = InferStage(
        EngineConfig(dtype="float32"),
        SamplingParams(max_tokens=3),
        keep_columns=["doc"],
        engine=engine,
    )
    out = {r[stage.ID]: r for r in infer(_shards()).to_pylist()}
    assert len(engine.calls) == 1  # the error shard never reaches the engine
    prompts, params, groups = engine.calls[0]
    assert [(g.prefix_len, len(g.members)) for g in groups] == [(80, 2)]
    assert sorted(p.max_tokens for p in params) == [3, 3, 9]
    assert (
        out["bad"][stage.ERROR] == "prompt is empty" and out["bad"][stage.FINISH_REASON] == "error"
    )
    assert out["a1"][stage.GENERATED_TOKEN_IDS] == [82, 9] and out["a1"]["generated_text"] == "t82"
    assert out["a0"][stage.NUM_CACHED_TOKENS] == 80 and out["a0"][stage.SHARED_PREFIX_LEN] == 80
    assert (
        out["a0"][stage.PREFIX_GROUP]
        == out["a1"][stage.PREFIX_GROUP]
        != out["solo"][stage.PREFIX_GROUP]
    )
    assert out["solo"][stage.TTFT] == 0.5 and out["solo"]["doc"] == "doc-3"


def test_engine_failure_becomes_error_rows():
    infer = InferStage(
        EngineConfig(dtype="float32"),
        SamplingParams(),
        keep_columns=["doc"],
        engine=FakeEngine(fail=True),
    )
    out = infer(_shards()).to_pylist()
    assert len(out) == 4
    assert all(
        "engine failed: RuntimeError: CUDA error" in r[stage.ERROR]
        for r in out
        if r[stage.ID] != "bad"
    )


def test_report_from_output_files(tmp_path):
    infer = InferStage(
        EngineConfig(dtype="float32"),
        SamplingParams(max_tokens=3),
        keep_columns=["doc"],
        engine=FakeEngine(),
    )
    pq.write_table(infer(_shards()), tmp_path / "part-0.parquet")
    collector = StatsCollector()
    _, stats = plan_partition(
        tokenized([("a0", DOC_A + [1], None), ("a1", DOC_A + [2, 3], None)]),
        PlanConfig(),
        SamplingParams(),
        [],
    )
    collector.record_plan("p", stats)
    collector.record_plan("p", stats)  # a retried partition replaces its record
    summary, dists = summarize(
        str(tmp_path), [tmp_path / "part-0.parquet"], collector.plan_total(), 2.0, 5
    )
    assert (summary.rows, summary.error_rows, summary.rows_skipped) == (4, 1, 5)
    assert summary.prompt_tokens == 81 + 82 + 2
    assert summary.prefix_saving_ratio == round(80 / 163, 5)  # the plan's count, not 160 cached
    assert summary.cached_prompt_tokens == 160
    assert summary.padding_avoided_tokens == 82 * 3 - 165
    assert summary.num_shared_groups == 1 and summary.max_share_degree == 2
    write_report(tmp_path, summary, dists)
    assert json.loads((tmp_path / "_summary.json").read_text())["rows"] == 4
    assert (tmp_path / "_report.png").read_bytes()[:4] == b"\x89PNG"


def test_collector_gives_each_id_to_the_partition_that_claims_it_first():
    collector = StatsCollector()
    assert collector.claim_ids("p1", ["x", "a"]) == [True, True]
    assert collector.claim_ids("p2", ["x", "b"]) == [False, True]
    assert collector.claim_ids("p1", ["x", "a"]) == [True, True]  # a retry of p1 keeps them


@pytest.mark.timeout(120)
def test_an_id_in_two_partitions_is_planned_once_and_a_retry_keeps_its_rows(ray_cluster):
    import ray

    collector = ray.remote(num_cpus=0)(StatsCollector).remote()
    plan = PlanStage(PlanConfig(), SamplingParams(), ["doc"], collector)
    first = tokenized([("x", DOC_A + [1], None), ("a1", DOC_A + [2], None)])
    second = tokenized([("x", DOC_B + [9], None), ("b1", DOC_B + [3], None)])

    def ids(shards: pa.Table) -> list[str]:
        return sorted(i for row in shards.column(stage.ID).to_pylist() for i in row)

    assert ids(plan(first)) == ["a1", "x"]
    assert ids(plan(second)) == ["b1"]  # its "x" has another prompt: dropped, not written twice
    assert ids(plan(first)) == ["a1", "x"]  # Ray retries the first partition: still its rows
    total = ray.get(collector.plan_total.remote())
    assert (total.rows, total.duplicate_rows) == (3, 1)
    ray.kill(collector)


def test_token_arrays_are_the_rows_tokens_for_chunked_sliced_and_null_rows():
    from pipeline.stages.plan import token_arrays

    lists = [[1, 2, 3], None, [], [4, 5], [6]]
    column = pa.chunked_array(
        [pa.array(lists[:2], stage.TOKEN_LIST), pa.array(lists[2:], stage.TOKEN_LIST).slice(1)]
    )
    got = [a.tolist() for a in token_arrays(column)]
    assert got == [[1, 2, 3], [], [4, 5], [6]]
    assert [a.tolist() for a in token_arrays(column.combine_chunks().slice(2))] == [[4, 5], [6]]
