"""Prompts that really share long prefixes, and prefix groups over them."""

from __future__ import annotations

from dataclasses import dataclass

from tests.actors.reference import sample_prompts

try:  # the planner's type; a stand-in of the same shape until packing.prefix exists
    from packing.prefix import PrefixGroup
except ImportError:  # pragma: no cover - depends on another module's progress

    @dataclass(frozen=True)
    class PrefixGroup:  # type: ignore[no-redef]
        """Stand-in for packing.prefix.PrefixGroup."""

        prefix_len: int
        members: tuple[int, ...]


SYSTEM = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request. Answer "
    "briefly and precisely, in plain English, without repeating the question.\n\n"
)
TRANSLATE = "Translate the following sentence into French, keeping its tone and register:\n"


def shared_prefix_prompts() -> list[str]:
    """Nine prompts: five share SYSTEM, two share TRANSLATE, plus a 1-token and a long one."""
    texts = sample_prompts(40)
    prompts = [SYSTEM + text for text in texts[:5]]
    prompts += [TRANSLATE + "The weather is lovely today.", TRANSLATE + "Where is the station?"]
    prompts.append("Hi")
    prompts.append(max(texts, key=len))
    return prompts


def common_prefix_len(token_lists: list[list[int]]) -> int:
    """Length of the longest common prefix of several token lists."""
    n = 0
    for column in zip(*token_lists, strict=False):
        if any(t != column[0] for t in column):
            break
        n += 1
    return n


def prefix_groups_for(token_ids: list[list[int]]) -> list[PrefixGroup]:
    """Groups over shared_prefix_prompts(): SYSTEM members and TRANSLATE members."""
    groups = []
    for members in ((0, 1, 2, 3, 4), (5, 6)):
        prefix_len = common_prefix_len([token_ids[m] for m in members])
        groups.append(PrefixGroup(prefix_len=prefix_len, members=members))
    return groups
