"""Prefix groups of a `generate` call: validated, turned into engine state, and ordered.

The planner (`packing.prefix`) names prompts that share their first `prefix_len` tokens
(the job's plan per shard, or `call_groups` over a call given none); groups may nest
(`PrefixGroup.parent`). Here each group that will really share (two or more
members that can run) gets an internal prefix request and its runtime state
(`actors.request.SharedPrefixState`), each prompt joins its deepest such group, and the
prompts are queued so a group's members run together (depth first), which keeps a shared
prefix's blocks alive for as short a time as possible.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from actors.config import SamplingParams
from actors.request import Request, SharedPrefixState
from packing.prefix import MIN_SHARED_TOKENS, PrefixGroup, prefix_forest


def call_groups(token_ids: Sequence[Sequence[int] | None]) -> list[PrefixGroup]:
    """Nested prefix groups over one call's prompts (`packing.prefix_forest`, as the job's plan
    makes them inside a shard), members indexed in the call; prompts that did not tokenize
    (None) or are empty are in none. `plan_groups` later leaves out members that cannot run."""
    valid = [i for i, ids in enumerate(token_ids) if ids]
    if len(valid) < 2:
        return []
    forest = prefix_forest([token_ids[i] or [] for i in valid], min_shared=MIN_SHARED_TOKENS)
    return [dataclasses.replace(g, members=tuple(valid[m] for m in g.members)) for g in forest]


def planned_order(num_prompts: int, groups: Sequence[PrefixGroup]) -> list[int]:
    """Input order, except that a group's members run together at its first member's place,
    and inside it each nested group's members run together the same way (depth first)."""
    chains: dict[int, list[int]] = {}  # prompt -> its groups, outermost first
    for g, group in enumerate(groups):  # parents come first (checked by plan_groups)
        if len(group.members) >= 2:
            for m in group.members:
                chains.setdefault(m, []).append(g)
    order: list[int] = []
    visited: set[int] = set()

    def visit(g: int, level: int) -> None:
        visited.add(g)
        for m in groups[g].members:
            chain = chains[m]
            if len(chain) == level + 1:
                order.append(m)
            elif chain[level + 1] not in visited:
                visit(chain[level + 1], level + 1)

    for index in range(num_prompts):
        chain = chains.get(index)
        if chain is None:
            order.append(index)
        elif chain[0] not in visited:
            visit(chain[0], 0)
    return order


def plan_groups(
    token_ids: list[list[int]],
    groups: Sequence[PrefixGroup],
    runnable: Callable[[list[int]], bool],
    new_id: Callable[[], str],
    cache_salt: Callable[[int], int | None] | None = None,
) -> dict[int, SharedPrefixState]:
    """Validate prefix groups and create each one's internal prefix request (its id from
    `new_id`); returns the deepest group of every grouped prompt. `runnable(prompt)` is
    False for a prompt that will end in an error row instead of running. `cache_salt(prompt
    length)` (a length-dependent rope, actors/rope.py): a group shares only when its members'
    salts agree, since their prefix K/V then differ."""
    deepest = check_groups(token_ids, groups)
    # A group shares only when >= 2 of its members can run (prompts that will end in an
    # error row do not wait for a prefix); the others' rows fall to the nearest one above.
    members_that_run = [[m for m in group.members if runnable(token_ids[m])] for group in groups]
    nearest: list[SharedPrefixState | None] = []  # per group: itself or the sharing one above
    for g, group in enumerate(groups):
        above = nearest[group.parent] if group.parent is not None else None
        running = members_that_run[g]
        salts = {cache_salt(len(token_ids[m])) for m in running} if cache_salt else {None}
        if len(running) < 2 or group.prefix_len < 1 or len(salts) > 1:
            nearest.append(above)
            continue
        prefix = token_ids[group.members[0]][: group.prefix_len]
        prefix_req = Request(new_id(), prefix, SamplingParams(), is_prefix=True)
        # Its tokens are its members' prompt tokens: their rope length and salt.
        prefix_req.rope_len, prefix_req.cache_salt = len(token_ids[running[0]]), salts.pop()
        state = SharedPrefixState(prefix=prefix_req, num_unfinished_members=0, parent=above)
        prefix_req.group = state
        if above is not None:
            above.num_unfinished_members += 1  # the nested prefix is a member of its parent
        nearest.append(state)
    of_prompt: dict[int, SharedPrefixState] = {}
    for m, g in deepest.items():
        shared = nearest[g]
        if shared is not None and runnable(token_ids[m]):
            of_prompt[m] = shared
            shared.num_unfinished_members += 1
    return of_prompt


def check_groups(token_ids: list[list[int]], groups: Sequence[PrefixGroup]) -> dict[int, int]:
    """ValueError naming the group unless every group's members are prompt indices that
    share its prefix and nested groups nest; returns each grouped prompt's deepest group."""
    deepest: dict[int, int] = {}
    for g, group in enumerate(groups):
        members = tuple(group.members)
        parent = group.parent
        if parent is not None:
            if not 0 <= parent < g:
                raise ValueError(
                    f"prefix group {g}: parent {parent} must be an earlier group (0..{g - 1})"
                )
            if group.prefix_len <= groups[parent].prefix_len:
                raise ValueError(
                    f"prefix group {g}: prefix_len {group.prefix_len} must exceed its parent "
                    f"group {parent}'s {groups[parent].prefix_len}"
                )
            outside = sorted(set(members) - set(groups[parent].members))
            if outside:
                raise ValueError(
                    f"prefix group {g}: members {outside} are not members of its parent "
                    f"group {parent}"
                )
        for m in members:
            if not 0 <= m < len(token_ids):
                raise ValueError(f"prefix group {g}: member {m} is not a prompt index")
            if deepest.get(m) != parent:
                raise ValueError(
                    f"prompt {m} is in more than one prefix group (groups {deepest[m]} and "
                    f"{g}, not nested)"
                )
            deepest[m] = g
        prefix = token_ids[members[0]][: group.prefix_len] if members else []
        if len(prefix) < group.prefix_len or any(
            token_ids[m][: group.prefix_len] != prefix for m in members
        ):
            raise ValueError(
                f"prefix group {g}: members {members} do not all start with the same "
                f"{group.prefix_len} tokens"
            )
    return deepest
