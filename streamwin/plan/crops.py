"""Crops: where each window of the plan starts and how long it is, drawn afresh each epoch. Pure (numpy only).

A window of the plan is a crop *slot*: a global index ``g`` of its source's window space
(the stride grid's windows, or k per sequence with ``windows_per_sequence``). Its start and
length are a pure function of (seed, epoch, source, g), never of the world, the workers or
the batch size: every rank, every worker, an elastic resume and the reader see the same
crop, and a checkpoint stores nothing of it. Slot j of a sequence whose view (the part a
split reads) is steps [lo, end), with span = window + horizon:

- the grid: start = lo + j * stride, length = window;
- ``jitter``: start = lo + j * stride + u, u uniform in [0, stride) but at most
  end - span - (lo + j * stride), so the crop and its horizon stay in the sequence;
- ``windows_per_sequence=k``: the view has P = end - lo - span + 1 distinct starts and
  n = min(k, P) slots; slot j starts uniformly in [lo + j P // n, lo + (j + 1) P // n)
  (stratified: the k crops spread over the sequence, and never coincide);
- ``min_window=m, window_multiple=p``: the length is uniform over the multiples of p in
  [m, window]; a padded window of a short sequence keeps only the steps it has.

A crop always lies inside [start, start + span), the steps the reader reads for a window, and
starts grow with j within a sequence. Draws hash (seed, epoch, source, purpose, g) with
splitmix64, vectorized: no RNG state, no per-crop Python.
"""
from __future__ import annotations

import numpy as np

from streamwin.plan.options import WindowSpec

START, LENGTH = 1, 2  # what a draw is for (part of its hash key)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: every input bit spread over the output (uint64, wrapping)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def draw(seed: int, epoch: int, source: int | None, purpose: int, g: np.ndarray) -> np.ndarray:
    """64 random bits per slot ``g`` (uint64), a pure function of (seed, epoch, source, purpose, g)."""
    key = np.uint64(0)
    for part in (seed, epoch, 0 if source is None else int(source) + 1, purpose):  # source None: unmixed
        key = _mix(np.asarray(key ^ np.uint64(int(part) & (2**64 - 1)), dtype=np.uint64) + _GOLDEN)
    with np.errstate(over="ignore"):
        return _mix(np.asarray(g, dtype=np.int64).astype(np.uint64) * _GOLDEN + key)


def below(bits: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Integers uniform in [0, n) (int64; n >= 1) from 64 random bits each."""
    return (bits % np.asarray(n, dtype=np.uint64)).astype(np.int64)


def place(spec: WindowSpec, key: tuple[int, int, int | None], g: np.ndarray, j: np.ndarray, lo: np.ndarray,
          end: np.ndarray) -> np.ndarray:
    """Start step of each crop: slot ``g`` (slot ``j`` of a sequence whose view is [lo, end)) under ``spec``.

    ``key`` is (seed, epoch, source). A slot with no room (a padded window of a short
    sequence) starts at ``lo``.
    """
    seed, epoch, source = key
    if spec.windows_per_sequence is not None:
        starts = end - lo - spec.span + 1  # P: distinct starts of the view
        n = np.clip(np.minimum(starts, spec.windows_per_sequence), 1, None)
        a, b = (j * starts) // n, ((j + 1) * starts) // n
        room = np.maximum(b - a, 1)
        return lo + np.where(starts > 0, a + below(draw(seed, epoch, source, START, g), room), 0)
    grid = lo + j * spec.stride
    if not spec.jitter:
        return grid
    room = np.clip(end - spec.span - grid + 1, 1, spec.stride)  # offsets that keep the span inside
    return grid + below(draw(seed, epoch, source, START, g), room)


def lengths(spec: WindowSpec, key: tuple[int, int, int | None], g: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Steps of each crop (int64): drawn in [min_window, window] as multiples of window_multiple, or the
    window; never more than ``valid``, the steps of its span inside the sequence (a padded short one)."""
    if not spec.variable:
        return np.minimum(np.asarray(valid, dtype=np.int64), spec.window)
    p, low = spec.window_multiple, spec.shortest
    choices = (spec.window - low) // p + 1
    drawn = low + p * below(draw(*key, LENGTH, g), np.full(len(g), choices))
    return np.minimum(drawn, np.asarray(valid, dtype=np.int64))


def units(spec: WindowSpec, length: np.ndarray) -> np.ndarray:
    """Patches of ``window_multiple`` steps a crop of ``length`` steps occupies in a packed row (int64)."""
    p = spec.window_multiple
    return (np.asarray(length, dtype=np.int64) + p - 1) // p
