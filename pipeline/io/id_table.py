"""A compact map from row ids to a content hash and a claiming partition, for the job's
`StatsCollector` (pipeline/io/report.py, pipeline/stages/dedupe.py): 40 bytes per id in numpy arrays
instead of Python dicts of strings (~200 bytes per id in two dicts).

Keys are 16-byte blake2b digests of the id (a collision, about 1e-25 likely for 10M ids,
would make two ids one); the content hash (`prompts.content_id`: 20 hex characters) is kept
as text, cut at `CONTENT_CHARS`. New keys go to a small dict and are merged into the sorted
arrays when it grows past `MERGE_AT` (amortised n log n).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

MERGE_AT = 1 << 18
NO_OWNER = -1
CONTENT_CHARS = 20


def digest(text: str) -> bytes:
    """The 16-byte key of an id (or a dedupe key)."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def content_key(content_hash: str) -> str:
    """What is kept of a content hash (ASCII, at most CONTENT_CHARS)."""
    return content_hash.encode("ascii", "replace")[:CONTENT_CHARS].decode("ascii")


class IdTable:
    """key digest -> [first content, owner partition index]; `owners` numbers partitions."""

    def __init__(self) -> None:
        self._keys = np.empty(0, dtype="S16")
        self._contents = np.empty(0, dtype=f"S{CONTENT_CHARS}")
        self._owner = np.empty(0, dtype=np.int32)
        self._pending: dict[bytes, list] = {}  # key -> [content ("": none yet), owner]
        self._partitions: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._keys) + len(self._pending)

    def _find(self, keys: Sequence[bytes]) -> np.ndarray:
        """Each key's index in the sorted arrays, or -1."""
        if not len(self._keys) or not keys:
            return np.full(len(keys), -1, dtype=np.int64)
        wanted = np.array(keys, dtype="S16")
        at = np.searchsorted(self._keys, wanted)
        inside = at < len(self._keys)
        hit = np.zeros(len(keys), dtype=bool)
        hit[inside] = self._keys[at[inside]] == wanted[inside]
        return np.where(hit, at, -1)

    def first_contents(self, ids: Sequence[str], contents: Sequence[str]) -> list[str]:
        """Record each id's content unless it has one; each id's first content
        (`content_key`)."""
        keys = [digest(i) for i in ids]
        found = self._find(keys)
        firsts = []
        for key, at, content in zip(keys, found, contents, strict=True):
            if at >= 0:
                first = self._contents[at].decode("ascii")
                if not first:  # claimed before any content was recorded
                    first = content_key(content)
                    self._contents[at] = first.encode("ascii")
                firsts.append(first)
                continue
            entry = self._pending.setdefault(key, ["", NO_OWNER])
            if not entry[0]:
                entry[0] = content_key(content)
            firsts.append(entry[0])
        self._maybe_merge()
        return firsts

    def claim(self, partition: str, keys: Sequence[str]) -> list[bool]:
        """For each key, whether `partition` owns it (the first partition to claim it does)."""
        p = self._partitions.setdefault(partition, len(self._partitions))
        digests = [digest(k) for k in keys]
        found = self._find(digests)
        out = []
        for key, at in zip(digests, found, strict=True):
            if at >= 0:
                if self._owner[at] == NO_OWNER:
                    self._owner[at] = p
                out.append(int(self._owner[at]) == p)
                continue
            entry = self._pending.setdefault(key, ["", NO_OWNER])
            if entry[1] == NO_OWNER:
                entry[1] = p
            out.append(entry[1] == p)
        self._maybe_merge()
        return out

    def _maybe_merge(self) -> None:
        if len(self._pending) < MERGE_AT:
            return
        pending, self._pending = self._pending, {}
        keys = np.concatenate([self._keys, np.array(list(pending), dtype="S16")])
        contents = np.concatenate(
            [
                self._contents,
                np.array(
                    [v[0].encode("ascii") for v in pending.values()], dtype=self._contents.dtype
                ),
            ]
        )
        owner = np.concatenate(
            [self._owner, np.array([v[1] for v in pending.values()], dtype=np.int32)]
        )
        order = np.argsort(keys, kind="stable")
        self._keys, self._contents, self._owner = keys[order], contents[order], owner[order]
