"""Nested prefix groups (packing.prefix_forest) in the engine: greedy tokens equal Hugging Face
`generate` on each prompt alone, every distinct shared prefix is computed exactly once, and
bad nestings are refused with the group named."""

from __future__ import annotations

import pytest

from actors import SamplingParams
from actors.prefix_sharing import planned_order as _planned_order
from packing.prefix import MIN_SHARED_TOKENS, PrefixGroup, prefix_forest
from tests.actors.groups import SYSTEM
from tests.actors.reference import (
    assert_greedy_match,
    hf_greedy,
    sample_prompts,
    torch_threads,
)

MAX_TOKENS = 8
PARIS = SYSTEM + "Human: What is the capital of France?\n\nAssistant: Paris.\n\n"
MORGEN = SYSTEM + "Human: Translate 'good morning' into German.\n\nAssistant: Guten Morgen.\n\n"


def conversation_prompts() -> list[str]:
    """Prompts sharing at several depths: SYSTEM, then a conversation, then a follow-up;
    one prompt is a prefix of others (the last-token cap) and one shares nothing."""
    return [
        PARIS + "Human: And of Spain?",
        "Hi there",
        MORGEN + "Human: And into Dutch?",
        PARIS + "Human: What about Italy?",
        SYSTEM + sample_prompts(3)[2],
        PARIS + "Human: What about Italy? Answer in one word.",
        MORGEN + "Human: And into Swedish?",
        PARIS,
    ]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p, add_special_tokens=False) for p in conversation_prompts()]


@pytest.fixture(scope="module")
def forest(prompt_ids) -> list[PrefixGroup]:
    groups = prefix_forest(prompt_ids)
    assert max(_depth(groups, g) for g in range(len(groups))) >= 2  # three levels at least
    assert any(g.prefix_len % 16 and g.prefix_len % 4 for g in groups)  # copy path runs
    return groups


@pytest.fixture(scope="module")
def expected(reference_models, prompt_ids) -> list[list[int]]:
    with torch_threads(1):
        return [hf_greedy(reference_models["llama"], ids, MAX_TOKENS) for ids in prompt_ids]


def _depth(groups: list[PrefixGroup], g: int) -> int:
    parent = groups[g].parent
    return 0 if parent is None else 1 + _depth(groups, parent)


def deepest_prefix_len(groups: list[PrefixGroup], row: int) -> int:
    return max((g.prefix_len for g in groups if row in g.members), default=0)


def check_all(reference_models, prompt_ids, outputs, expected) -> None:
    for ids, out, exp in zip(prompt_ids, outputs, expected, strict=True):
        assert out.finished and out.error is None
        assert_greedy_match(reference_models["llama"], ids, out.token_ids, exp)


@pytest.mark.parametrize("chunk_size", [7, None])
def test_nested_greedy_matches_hf_generate(
    make_engine, reference_models, prompt_ids, forest, expected, chunk_size, attention_backend
) -> None:
    engine = make_engine(
        num_kv_blocks=256,
        chunk_size=chunk_size,
        enable_prefix_caching=False,
        attention_backend=attention_backend,
    )
    outputs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS), forest)
    check_all(reference_models, prompt_ids, outputs, expected)
    for row, out in enumerate(outputs):
        assert out.num_cached_tokens == deepest_prefix_len(forest, row)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks  # every prefix was released


def test_each_distinct_prefix_is_computed_once(
    make_engine, reference_models, prompt_ids, forest, expected, attention_backend
) -> None:
    engine = make_engine(
        num_kv_blocks=256, enable_prefix_caching=False, attention_backend=attention_backend
    )
    computed = []
    scheduler = engine.scheduler.schedulers[0]  # the one request set
    original = scheduler.update_after_step

    def record(out):  # count every token the model computes
        computed.append(out.total_num_scheduled_tokens)
        original(out)

    scheduler.update_after_step = record  # type: ignore[method-assign]
    outputs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS), forest)
    check_all(reference_models, prompt_ids, outputs, expected)
    # Each prompt computes its tokens past its deepest group (and all but its last generated
    # token); each group computes its prefix past its parent's, once.
    own = sum(
        len(ids) - deepest_prefix_len(forest, row) + len(out.token_ids) - 1
        for row, (ids, out) in enumerate(zip(prompt_ids, outputs, strict=True))
    )
    prefixes = sum(
        g.prefix_len - (forest[g.parent].prefix_len if g.parent is not None else 0) for g in forest
    )
    assert sum(computed) == own + prefixes
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_nested_groups_survive_preemption(
    make_engine, reference_models, prompt_ids, forest, expected, attention_backend
) -> None:
    # 40 blocks of 4 tokens: the longest prompt fits, all of them together do not.
    assert max(len(p) for p in prompt_ids) + MAX_TOKENS < 40 * 4 < sum(map(len, prompt_ids))
    engine = make_engine(
        num_kv_blocks=40,
        block_size=4,
        max_num_batched_tokens=96,
        attention_backend=attention_backend,
    )
    outputs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS), forest)
    assert engine.scheduler.num_preemptions > 0
    check_all(reference_models, prompt_ids, outputs, expected)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_call_given_no_groups_plans_them_itself(
    make_engine, reference_models, prompt_ids, expected
) -> None:
    """`generate` without groups computes each shared prefix once, as if given
    `prefix_forest`'s (partial last blocks too, which the block-hash cache cannot share); a
    prompt that cannot run is left out and gets its error; an empty list, or
    `plan_prefix_groups=False`, asks for none; the tokens are the same every way."""
    forest = prefix_forest(prompt_ids, min_shared=MIN_SHARED_TOKENS)
    assert any(g.prefix_len % 16 for g in forest)  # a partial block is shared
    params = SamplingParams(max_tokens=MAX_TOKENS)
    runs = {}
    for name, config, groups, prompts in (
        ("planned", {}, None, [*prompt_ids, []]),  # the empty prompt cannot run
        ("given none", {}, [], prompt_ids),
        ("off", {"plan_prefix_groups": False}, None, prompt_ids),
    ):
        engine = make_engine(num_kv_blocks=256, enable_prefix_caching=False, **config)
        outputs = engine.generate(prompts, params, groups)
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        runs[name] = (outputs[: len(prompt_ids)], engine.stats.num_scheduled_tokens)
        if name == "planned":
            assert outputs[-1].finished and "empty" in (outputs[-1].error or "")
    planned, computed = runs["planned"]
    check_all(reference_models, prompt_ids, planned, expected)
    for row, out in enumerate(planned):
        assert out.num_cached_tokens == deepest_prefix_len(forest, row)
    # Each prompt skips its deepest group's prefix; each group computes its own part once.
    skipped = sum(deepest_prefix_len(forest, row) for row in range(len(prompt_ids)))
    prefixes = sum(
        g.prefix_len - (forest[g.parent].prefix_len if g.parent is not None else 0) for g in forest
    )
    assert skipped > prefixes
    for name in ("given none", "off"):
        outputs, computed_alone = runs[name]
        assert [o.token_ids for o in outputs] == [o.token_ids for o in planned]
        assert all(o.num_cached_tokens == 0 for o in outputs)
        assert computed == computed_alone - skipped + prefixes


def test_planned_order_is_depth_first() -> None:
    groups = [
        PrefixGroup(2, (1, 3, 4, 6)),
        PrefixGroup(5, (3, 6), parent=0),
        PrefixGroup(4, (1, 4), parent=0),
    ]
    # Group 0 at prompt 1's place; inside it group 2 at 1's place, group 1 at 3's.
    assert _planned_order(8, groups) == [0, 1, 4, 3, 6, 2, 5, 7]
    assert _planned_order(4, [PrefixGroup(1, (1, 3))]) == [0, 1, 3, 2]  # one level: as before


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        (
            [PrefixGroup(1, (0, 1), parent=1), PrefixGroup(2, (0, 1))],
            r"prefix group 0: parent 1 must be an earlier group",
        ),
        (
            [PrefixGroup(2, (0, 1, 2)), PrefixGroup(2, (0, 1), parent=0)],
            r"prefix group 1: prefix_len 2 must exceed its parent group 0's 2",
        ),
        (
            [PrefixGroup(2, (0, 1)), PrefixGroup(3, (1, 2), parent=0)],
            r"prefix group 1: members \[2\] are not members of its parent group 0",
        ),
        (
            [
                PrefixGroup(1, (0, 1, 2)),
                PrefixGroup(2, (0, 1), parent=0),
                PrefixGroup(3, (1, 2), parent=0),
            ],
            r"prompt 1 is in more than one prefix group \(groups 1 and 2, not nested\)",
        ),
    ],
)
def test_bad_nesting_is_refused(make_engine, groups, message) -> None:
    engine = make_engine()
    prompts = [[5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 7, 10]]
    with pytest.raises(ValueError, match=message):
        engine.generate(prompts, SamplingParams(max_tokens=1), groups)


def test_pipelined_sets_keep_a_nested_tree_together() -> None:
    """pp > 1 splits requests into sets with their own KV pools: a nested group's prefix and
    members must land in its root group's set, and leave no routing entry behind."""
    from actors.config import EngineConfig
    from actors.request import Request, SharedPrefixState
    from actors.virtual_schedulers import VirtualSchedulers

    def prefix(tokens: list[int], parent: SharedPrefixState | None) -> SharedPrefixState:
        req = Request(f"prefix-{len(tokens)}", tokens, SamplingParams(), is_prefix=True)
        req.group = SharedPrefixState(req, num_unfinished_members=1, parent=parent)
        return req.group

    sets = VirtualSchedulers(EngineConfig(dtype="float32"), blocks_per_set=64, count=2)
    outer = prefix([1, 2], None)
    inner = prefix([1, 2, 3], outer)
    sets.add(Request("other", [9, 9], SamplingParams()))  # the sets are uneven now
    sets.add(outer.prefix)
    sets.add(inner.prefix)
    member = Request("member", [1, 2, 3, 4], SamplingParams(), group=inner)
    sets.add(member)
    assert sets.owner(outer.prefix) == sets.owner(inner.prefix) == sets.owner(member)
    sets.finish([member], "stop")
    assert set(sets._owner) == {"other"}
