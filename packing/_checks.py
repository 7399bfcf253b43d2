"""Input validation shared by the packing modules.

Every check raises ValueError with a message that names the argument, what was expected and
what arrived, because these functions sit right behind user data (prompt tables, configs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeGuard

import numpy as np
import numpy.typing as npt

# Token ids are stored and hashed as int32 (the paged KV cache's block hashes use the same
# bytes), so they must fit: non-negative and below 2**31.
MAX_TOKEN_ID = 2**31 - 1


def describe(value: object) -> str:
    """A short `repr (type)` of a value for error messages, cut to a readable length."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def is_int(value: object) -> TypeGuard[int | np.integer[Any]]:
    """True for Python and numpy integers, False for bool (a bool length is a bug upstream)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def positive_int(name: str, value: object) -> int:
    """`value` as an int, or ValueError unless it is an integer >= 1."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {describe(value)}")
    return int(value)


def non_negative_int(name: str, value: object) -> int:
    """`value` as an int, or ValueError unless it is an integer >= 0."""
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {describe(value)}")
    return int(value)


def int_list(name: str, values: object, minimum: int) -> list[int]:
    """`values` (a sequence or 1-D integer array) as a list of ints, each >= `minimum`.

    Numpy arrays are checked vectorised (the common case in the pipeline); plain sequences are
    checked item by item so the error can name the first bad index.
    """
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or (values.size and values.dtype.kind not in "iu"):
            raise ValueError(
                f"{name} must be a 1-D integer array, got shape {values.shape} dtype {values.dtype}"
            )
        if values.size and values.min() < minimum:
            bad = int(np.flatnonzero(values < minimum)[0])
            raise ValueError(f"{name}[{bad}] must be >= {minimum}, got {int(values[bad])}")
        return [int(v) for v in values.tolist()]
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise ValueError(f"{name} must be a sequence of integers, got {describe(values)}")
    out: list[int] = []
    for i, v in enumerate(values):
        if not is_int(v) or v < minimum:
            raise ValueError(f"{name}[{i}] must be an integer >= {minimum}, got {describe(v)}")
        out.append(int(v))
    return out


def token_array(name: str, tokens: object) -> npt.NDArray[np.int64]:
    """One token sequence (list of ints or 1-D integer array) as an int64 array of valid ids."""
    if isinstance(tokens, np.ndarray):
        arr = tokens
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(
                f"{name} must be a 1-D sequence of integer token ids, got shape {arr.shape} "
                f"dtype {arr.dtype}"
            )
    elif isinstance(tokens, Sequence) and not isinstance(tokens, str | bytes):
        try:  # C-speed for a list of ints; any other element shows in the dtype
            arr = np.asarray(tokens)
        except (ValueError, TypeError):
            arr = np.asarray(tokens, dtype=object)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            bad = next((i for i, t in enumerate(tokens) if not is_int(t)), None)
            if bad is None:  # integers too large for int64
                raise ValueError(f"{name} holds a token id outside 0..{MAX_TOKEN_ID}")
            raise ValueError(
                f"{name}[{bad}] must be an integer token id, got {describe(tokens[bad])}"
            )
    else:
        raise ValueError(f"{name} must be a sequence of integer token ids, got {describe(tokens)}")
    check_token_range(name, arr)
    return arr.astype(np.int64, copy=False)


def check_token_range(name: str, arr: npt.NDArray[Any]) -> None:
    """ValueError naming the first token id outside 0..MAX_TOKEN_ID (vectorised check)."""
    if arr.size == 0:
        return
    if arr.min() < 0 or arr.max() > MAX_TOKEN_ID:
        bad = int(np.flatnonzero((arr < 0) | (arr > MAX_TOKEN_ID))[0])
        raise ValueError(
            f"{name}: token ids must be in 0..{MAX_TOKEN_ID}, got {int(arr[bad])} at position {bad}"
        )
