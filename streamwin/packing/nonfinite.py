"""NaN and inf values: counted as pack writes them (``manifest.nonfinite``), or refused.

Counting must cost next to nothing on clean data, which is nearly all data: one vectorized
sum per array says "all finite" (NaN and inf make any sum non-finite), and only a sum that is
not finite (or overflowed) is followed by a count value by value. ``index_shards`` counts the
shards it indexes with the same function, so both report the same numbers.
"""
from __future__ import annotations

import numpy as np

from streamwin.errors import PackError

_FINITE_CHUNK = 1 << 24  # values checked per vectorized call: bounds the temporary mask to 16 MB


def count_nonfinite(arr: np.ndarray) -> tuple[int, int]:
    """(NaN values, +-inf values) of an array; integers have none.

    One vectorized pass, a sum, with no temporary array: NaN and inf make any sum non-finite,
    and a sum of finite values is non-finite only when it overflows. Only then are the values
    counted one by one.
    """
    if arr.dtype.kind not in "fc":
        return 0, 0
    flat = arr.reshape(-1)
    with np.errstate(all="ignore"):  # inf - inf and overflow are expected here, not worth a warning
        total = flat.sum(dtype=np.float32 if flat.dtype == np.float16 else None)
    if np.isfinite(total):
        return 0, 0
    bad = sum(len(c) - int(np.count_nonzero(np.isfinite(c)))
              for c in (flat[i : i + _FINITE_CHUNK] for i in range(0, len(flat), _FINITE_CHUNK)))
    if not bad:
        return 0, 0
    nans = int(np.count_nonzero(np.isnan(flat)))
    return nans, bad - nans


def first_nonfinite_step(arr: np.ndarray) -> int | None:
    """The first step (index along the first axis) holding a NaN or inf, or None."""
    finite = np.isfinite(arr).reshape(len(arr), -1).all(axis=1)
    return None if finite.all() else int(np.argmin(finite))


def nonfinite_per_sequence(values: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(NaN values, inf values) of each sequence, the sequences starting at ``starts`` and tiling
    ``values``: one vectorized pass when all are finite."""
    zeros = np.zeros(len(starts), dtype=np.int64)
    if not sum(count_nonfinite(values)):
        return zeros, zeros.copy()
    rows = values.reshape(len(values), -1)
    nans = np.add.reduceat(np.isnan(rows).sum(axis=1), starts)
    bad = np.add.reduceat((~np.isfinite(rows)).sum(axis=1), starts)
    return nans.astype(np.int64), (bad - nans).astype(np.int64)


def check_cast(key: str, arr: np.ndarray, cast: str) -> None:
    """NaN and inf have no integer value: casting them would pack arbitrary numbers."""
    if np.dtype(cast).kind not in "fc" and sum(count_nonfinite(arr)):
        raise PackError(f"sequence {key!r} has NaN or inf values (the first at step {first_nonfinite_step(arr)}), "
                        f"which cast={cast!r} cannot represent")


def refused(key: str, nans: int, infs: int, step: int | None) -> PackError:
    """The error of ``nan="raise"`` for a sequence with NaN or inf values, the first at ``step``."""
    return PackError(f"sequence {key!r} has {nans} NaN and {infs} inf values, the first at step {step}; "
                     "clean them, or pack with nan='count' to count them")
