"""packing.ordering: BatchLLM's decode-to-prefill ratio order of prefix groups."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packing.ordering import order_groups
from packing.prefix import PrefixGroup


@st.composite
def planned(draw: st.DrawFn) -> tuple[list[PrefixGroup], list[int], list[int]]:
    """Random groups over random rows with prompt and decode lengths that fit them."""
    n = draw(st.integers(0, 12))
    rows = draw(st.permutations(range(n)))
    prompts = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    decodes = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    groups = []
    start = 0
    while start < n:
        size = draw(st.integers(1, n - start))
        members = tuple(sorted(rows[start : start + size]))
        shortest = min(prompts[m] for m in members)
        prefix = draw(st.integers(0, shortest)) if size > 1 else 0
        groups.append(PrefixGroup(prefix, members))
        start += size
    return groups, prompts, decodes


def exact_ratio(group: PrefixGroup, prompts: list[int], decodes: list[int]) -> Fraction:
    prefill = group.prefix_len + sum(prompts[m] - group.prefix_len for m in group.members)
    return Fraction(sum(decodes[m] for m in group.members), max(prefill, 1))


@settings(max_examples=300, deadline=None)
@given(planned())
def test_order_is_by_ratio_descending_then_index(
    case: tuple[list[PrefixGroup], list[int], list[int]],
) -> None:
    groups, prompts, decodes = case
    got = order_groups(groups, prompts, decodes)
    assert sorted(got) == list(range(len(groups)))
    keys = [(-exact_ratio(groups[g], prompts, decodes), g) for g in got]
    assert keys == sorted(keys)
    assert order_groups(groups, prompts, decodes) == got


@settings(max_examples=200, deadline=None)
@given(planned())
def test_unknown_decode_lengths_mean_one_per_row(
    case: tuple[list[PrefixGroup], list[int], list[int]],
) -> None:
    groups, prompts, _ = case
    assert order_groups(groups, prompts) == order_groups(groups, prompts, [7] * len(prompts))


def test_decode_heavy_and_shared_groups_first() -> None:
    groups = [
        PrefixGroup(0, (0,)),  # 100 prompt, 10 decode -> 0.1
        PrefixGroup(90, (1, 2)),  # 90 + 10 + 10 = 110 prefill, 20 decode -> 0.18
        PrefixGroup(0, (3,)),  # 10 prompt, 100 decode -> 10
    ]
    prompts, decodes = [100, 100, 100, 10], [10, 10, 10, 100]
    assert order_groups(groups, prompts, decodes) == [2, 1, 0]
    # Unknown decodes: 1/100, 2/110, 1/10.
    assert order_groups(groups, prompts) == [2, 1, 0]
    assert order_groups([], []) == []


@pytest.mark.parametrize(
    ("groups", "prompts", "decodes", "message"),
    [
        ([PrefixGroup(0, (2,))], [5, 5], None, "groups\\[0\\] has row 2, but prompt_lens covers"),
        ([PrefixGroup(6, (0, 1))], [5, 9], None, "row 0 has a 5-token prompt, shorter than"),
        ([PrefixGroup(0, (0,))], [5], [1, 2], "decode_lens has 2 entries but prompt_lens has 1"),
        ([PrefixGroup(0, (0,))], [-5], None, r"prompt_lens\[0\] must be an integer >= 0"),
        ([PrefixGroup(0, (0,))], [5], [-1], r"decode_lens\[0\] must be an integer >= 0, got -1"),
        ([(0, (0,))], [5], None, "groups\\[0\\] must be a PrefixGroup, got tuple"),
    ],
)
def test_bad_input_is_a_value_error(
    groups: list[PrefixGroup], prompts: list[int], decodes: list[int] | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        order_groups(groups, prompts, decodes)
