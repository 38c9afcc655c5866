"""Train/val/test splits: by a stable hash of the sequence key, or by a temporal holdout.

A key split puts a sequence in exactly one split, decided by a hash of (split_seed, key)
alone, so adding sequences never moves existing ones. A temporal holdout ``H`` cuts every
sequence of length T in three (the forecasting convention), by where a window's last target
step (start + window + horizon - 1) lies::

    steps  0 ...................... T-2H ........... T-H ........... T
           |  train: whole windows    |  val: last     |  test: last   |
           |  (horizon included)      |  target here   |  target here  |

Val and test windows may look back before their range for context (their inputs can lie in
train's steps), but no window's targets are ever inside another split's windows, and val and
test share no window. A sequence too short to hold a full val (or test) window under this
rule gives none, even with padding.
Pure numpy, vectorized over the manifest's key blob (10 million keys in about a second).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from streamwin.arguments import MAX_STEPS, check_int, is_real

SPLITS = ("train", "val", "test")
_P = np.uint64(0x100000001B3)  # FNV prime: odd, hence invertible modulo 2**64


@dataclass(frozen=True)
class SplitSpec:
    """Which part of the data a dataset reads: a key split by ``fractions``, or a temporal ``holdout``."""

    split: str
    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)
    seed: int = 0
    holdout: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.split, str) or self.split not in SPLITS:
            raise ValueError(f"split must be 'train' or 'val' or 'test' (or None), got {self.split!r}")
        fractions = self.fractions
        if (isinstance(fractions, str) or not isinstance(fractions, Sequence) or len(fractions) != 3
                or not all(is_real(f) and 0 <= f <= 1 for f in fractions) or abs(sum(fractions) - 1) > 1e-9):
            raise ValueError(f"split_fractions must be three numbers >= 0 summing to 1 (train, val, test), "
                             f"got {fractions!r}")
        check_int("split_seed", self.seed, 0)
        check_int("holdout", self.holdout, 0, MAX_STEPS)
        object.__setattr__(self, "fractions", tuple(float(f) for f in fractions))  # plain values (a state's JSON)
        object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "holdout", int(self.holdout))


def split_spec(split: str | None, fractions: Sequence[float], seed: int, holdout: int) -> SplitSpec | None:
    """The SplitSpec of WindowDataset's split arguments (None: all data), each checked as the user typed it."""
    if split is None:
        SplitSpec("train", fractions, seed, holdout)  # check the other arguments all the same
        if holdout:
            raise ValueError(f"holdout={holdout!r} needs split='train', 'val' or 'test'")
        return None
    return SplitSpec(split, fractions, seed, holdout)



def key_hashes(key_blob: bytes, key_ends: np.ndarray, seed: int, seqs: np.ndarray | None = None) -> np.ndarray:
    """A stable 64-bit hash per key (of every key, or of sequences ``seqs``): sum of byte_c * P^(c+1)
    modulo 2**64, then mixed with the seed.

    Computed column by column (byte c of every key at once), so the Python work is one loop
    over at most 90 columns per million keys.
    """
    data = np.frombuffer(key_blob, dtype=np.uint8)
    all_ends = np.asarray(key_ends, dtype=np.int64)
    if seqs is None:
        ends = all_ends
        starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    else:
        seqs = np.asarray(seqs, dtype=np.int64)
        ends = all_ends[seqs]
        starts = np.where(seqs > 0, all_ends[np.maximum(seqs - 1, 0)], 0)
    out = np.empty(len(ends), dtype=np.uint64)
    salt = _mix(np.uint64(seed & (2**64 - 1)) + np.uint64(0x9E3779B97F4A7C15))
    chunk = 1 << 20
    with np.errstate(over="ignore"):
        for lo in range(0, len(ends), chunk):
            hi = min(lo + chunk, len(ends))
            first = starts[lo:hi]
            lens = ends[lo:hi] - first
            h = np.zeros(hi - lo, dtype=np.uint64)
            power = _P
            for c in range(int(lens.max(initial=0))):
                byte = data[np.minimum(first + c, len(data) - 1)].astype(np.uint64)
                byte[lens <= c] = 0
                h += byte * power
                power = power * _P
            out[lo:hi] = _mix(h ^ salt)
    return out


def _mix(x):
    """splitmix64's finalizer: spreads every input bit over the output."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def split_views(spec: SplitSpec, lengths: np.ndarray, key_blob: bytes, key_ends: np.ndarray,
                window: int, span: int | None = None, seqs: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(first step, steps) per sequence (every one, or those of ``seqs``) of the part of the data ``spec`` selects.

    ``span`` is the steps one window reads, window + horizon (default: ``window``, no horizon).
    """
    lengths = np.asarray(lengths if seqs is None else lengths[seqs], dtype=np.int64)
    if spec.holdout:
        return _holdout_view(spec.split, lengths, spec.holdout, window if span is None else span)
    u = key_hashes(key_blob, key_ends, spec.seed, seqs).astype(np.float64) / 2.0**64
    edges = np.cumsum((0.0,) + tuple(spec.fractions))
    k = SPLITS.index(spec.split)
    mine = (u >= edges[k]) & (u < edges[k + 1]) if k < 2 else u >= edges[2]
    return np.zeros_like(lengths), np.where(mine, lengths, 0)


def _holdout_view(split: str, lengths: np.ndarray, holdout: int, span: int) -> tuple[np.ndarray, np.ndarray]:
    """(first step, steps) of a temporal split: see the module docstring for the rule."""
    if split == "train":
        return np.zeros_like(lengths), np.maximum(lengths - 2 * holdout, 0)
    # the range [lo, hi) of the split's last target steps: val [T-2H, T-H), test [T-H, T)
    hi = lengths - (holdout if split == "val" else 0)
    lo = hi - holdout
    first = np.maximum(lo - span + 1, 0)  # the first start whose last target step reaches lo
    steps = np.maximum(hi - first, 0)
    return first, np.where(steps >= span, steps, 0)  # no full window: none (a padded one would end outside)
