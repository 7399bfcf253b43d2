"""Order prefix groups for scheduling (BatchLLM, arXiv 2412.03594, request reordering).

BatchLLM schedules the requests with the largest share of decoding first: their long decode
phases then overlap the prefill chunks of the groups that come later, so steps stay full of
work. The ratio of a request is its decode length over its prompt length (the paper's Eq. 3);
a prefix group's ratio (Eq. 4) is its members' decode tokens over the prefill tokens the
group really computes, its shared prefix once plus each member's rest.
"""

from __future__ import annotations

from collections.abc import Sequence

from packing._checks import int_list
from packing.prefix import PrefixGroup


def group_ratio(
    group: PrefixGroup, prompt_lens: Sequence[int], decode_lens: Sequence[int]
) -> float:
    """A group's decode-to-prefill ratio: sum of decode lengths / prefill tokens computed.

    Prefill computed = prefix_len + sum over members of (prompt_len - prefix_len), at least 1
    (an engine always computes one token to get logits, and 0 would divide by zero).
    """
    prefill = group.prefix_len + sum(prompt_lens[m] - group.prefix_len for m in group.members)
    decode = sum(decode_lens[m] for m in group.members)
    return decode / max(prefill, 1)


def order_groups(
    groups: Sequence[PrefixGroup],
    prompt_lens: Sequence[int],
    decode_lens: Sequence[int] | None = None,
) -> list[int]:
    """Indices of `groups` in schedule order: decode-to-prefill ratio descending, ties by index.

    `prompt_lens` and `decode_lens` are per row (indexed by the members' row indices). When
    decode lengths are unknown (None) every row is assumed to decode the same number of
    tokens; the order is then by share_degree / prefill tokens computed, and the constant
    itself does not matter because scaling every ratio keeps the order. Raises ValueError for
    a member outside `prompt_lens`, a prefix_len longer than a member's prompt, negative
    lengths, or decode_lens of a different length than prompt_lens.
    """
    prompts = int_list("prompt_lens", prompt_lens, minimum=0)
    if decode_lens is None:
        decodes = [1] * len(prompts)
    else:
        decodes = int_list("decode_lens", decode_lens, minimum=0)
        if len(decodes) != len(prompts):
            raise ValueError(
                f"decode_lens has {len(decodes)} entries but prompt_lens has {len(prompts)}"
            )
    for g, group in enumerate(groups):
        if not isinstance(group, PrefixGroup):
            raise ValueError(f"groups[{g}] must be a PrefixGroup, got {type(group).__name__}")
        for m in group.members:
            if m >= len(prompts):
                raise ValueError(
                    f"groups[{g}] has row {m}, but prompt_lens covers only {len(prompts)} rows"
                )
            if prompts[m] < group.prefix_len:
                raise ValueError(
                    f"groups[{g}]: row {m} has a {prompts[m]}-token prompt, shorter than the "
                    f"group's prefix_len {group.prefix_len}"
                )
    ratios = [group_ratio(group, prompts, decodes) for group in groups]
    # sorted() is stable, so equal ratios keep index order.
    return sorted(range(len(groups)), key=lambda g: -ratios[g])
