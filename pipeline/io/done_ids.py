"""The ids already written, in a form that scales: sorted 16-byte digests in one numpy array
(16 bytes per id), in Ray's object store when the job filters with it (pipeline/io/resume.py)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from pipeline.io import storage
from pipeline.stages import stage


class DoneIds:
    """A set of ids as sorted 16-byte digests (blake2b): 16 bytes per id, in one numpy array.

    Built from strings (`DoneIds.of`, small sets) or handed over as a Ray object
    (`done_filter`): then each task that tests ids maps the array from the object store
    (zero-copy, shared by the tasks of a node) on first use, and pickling sends only the ref.
    A 128-bit digest makes a false "done" (a row skipped by a collision) about 1e-25 likely
    for 10M ids."""

    def __init__(self, count: int, array=None, ref=None):  # noqa: ANN001 (numpy / ObjectRef)
        self.count = count
        self._array = array
        self._ref = ref

    @classmethod
    def of(cls, ids: Iterable[str]) -> DoneIds:
        array = _digests(ids)
        return cls(len(array), array=array)

    def __len__(self) -> int:
        return self.count

    def __contains__(self, row_id: object) -> bool:
        import numpy as np

        if not self.count or not isinstance(row_id, str):
            return False
        array = self.array
        digest = _digest(row_id)
        i = int(np.searchsorted(array, digest))
        # numpy drops an S16 item's trailing zero bytes when it hands it out: pad it back
        return i < len(array) and bytes(array[i]).ljust(16, b"\0") == digest

    @property
    def array(self):  # noqa: ANN201 (numpy array of S16)
        if self._array is None:
            import ray

            self._array = ray.get(self._ref)
        return self._array

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if state["_ref"] is not None:
            state["_array"] = None  # the ref travels, not the array
        return state


def _digest(row_id: str) -> bytes:
    return hashlib.blake2b(row_id.encode("utf-8"), digest_size=16).digest()


def _digests(ids: Iterable[str]):  # noqa: ANN202 (numpy array)
    import numpy as np

    return np.unique(np.array([_digest(i) for i in ids], dtype="S16"))


def _digest_files(files: Sequence[str]):  # noqa: ANN202 (numpy array)
    """The sorted digests of every id in `files` (a Ray task: one file's ids in memory at a
    time, then 16 bytes per id)."""
    import numpy as np
    import pyarrow.parquet as pq

    parts = [np.array([], dtype="S16")]
    for path in files:
        fs, inner = storage.resolve(path)
        ids = pq.read_table(inner, columns=[stage.ID], filesystem=fs).column(stage.ID)
        parts.append(_digests(ids.to_pylist()))
    return np.unique(np.concatenate(parts))


def done_filter(files: Sequence[str], count: int) -> DoneIds:
    """The ids in `files` (`count` rows) as a `DoneIds` in the object store, built by a Ray
    task: the driver holds a ref and a count, no id."""
    import ray

    if not files:
        return DoneIds(0)
    ref = ray.remote(num_cpus=0)(_digest_files).remote(list(files))
    return DoneIds(count, ref=ref)
