"""Weighted mixing: each source's share of an epoch and of every batch. Pure (numpy only).

1. **Shares.** An epoch has ``E`` windows (by default every window of every source). Source
   ``i`` gives ``E_i`` of them: ``w_i * E`` rounded by largest remainder (the shares sum to
   ``E``, each within 1 of ``w_i * E``). Without weights each source gives all its windows.
2. **Quotas.** Every batch holds ``floor(w_i * B)`` or ``ceil(w_i * B)`` windows of source
   ``i`` (``batch_quotas``): the ``R = B - sum floor`` extras go to sources by systematic
   sampling with a low-discrepancy offset per batch, so each source's running count stays
   within a few windows of ``w_i * B * j``. The quotas are the same on every stream.
3. **Batches.** A stream yields ``J`` batches, ``J`` the most for which every source's summed
   quotas fit (equalize="drop") or the fewest that cover (equalize="pad") each stream's range
   of it (``epoch_quotas``). Batch ``j`` takes the next ``quotas[j, i]`` windows of source
   ``i``'s stream, so the position of batch ``j`` in source ``i`` is ``quotas[:j, i].sum()``
   (``quota_positions``): resume is a cursor.

A dataset of one source is the same with one weight: every batch is B windows of it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from streamwin.plan.options import PlanConfig

PHI = (5 ** 0.5 - 1) / 2  # the golden ratio's fraction: the offsets j * PHI mod 1 fill [0, 1) evenly


@dataclass(frozen=True)
class Mixing:
    """A dataset's sources as its url argument named them: names, weights, epoch size. A URL given alone is a mix of
    one (``alone``) that a checkpoint names by its manifest's digest only, as states saved before mixing did; a list
    or dict of URLs (even of one) by the sources' digests, names, weights and epoch size."""

    names: list[str]
    weights: list[float] | None = None
    epoch_windows: int | None = None
    alone: bool = False

    def inputs(self) -> dict[str, Any]:
        """The plan inputs of a list or dict of URLs: names, weights and epoch size (none for a URL alone)."""
        if self.alone:
            return {}
        return {"sources": list(self.names), "weights": self.weights, "epoch_windows": self.epoch_windows}


def normalized(weights: Sequence[float]) -> np.ndarray:
    """Weights as float64 fractions summing to 1 (each finite and >= 0, at least one > 0)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or not len(w) or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be finite numbers >= 0, not all 0, got {list(weights)!r}")
    return w / w.sum()


def shares(total: int, weights: Sequence[float] | None, windows: Sequence[int]) -> np.ndarray:
    """Windows each source gives to an epoch of ``total`` (int64, summing to ``total``).

    Largest remainder: each share within 1 of ``w_i * total``. Without weights, an epoch of
    every window (``total == sum(windows)``) takes each source's count; another total is
    split in proportion to the sources' windows.
    """
    n = np.asarray(windows, dtype=np.int64)
    if weights is None:
        if total == int(n.sum()):
            return n.copy()
        weights = n
    w = normalized(weights)
    target = w * total
    out = np.floor(target + 1e-9).astype(np.int64)
    out = np.minimum(out, np.ceil(target).astype(np.int64))
    extra = int(total - out.sum())
    if extra > 0:  # the largest fractional parts take one more (ties: the earlier source)
        rest = target - out
        out[np.argsort(-rest, kind="stable")[:extra]] += 1
    return out


def batch_quotas(batch_size: int, weights: Sequence[float], batches: int, first: int = 0) -> np.ndarray:
    """Windows of each source in each of ``batches`` batches (from batch ``first`` on): int64 [batches, sources],
    rows summing to B.

    Entry (j, i) is floor(w_i B) or ceil(w_i B); the R leftover windows of a batch go to sources
    by systematic sampling over their fractional parts, offset by frac(j * PHI).
    """
    w = normalized(weights)
    target = w * batch_size
    base = np.floor(target + 1e-9).astype(np.int64)
    frac = np.clip(target - base, 0.0, 1.0)
    extra = int(batch_size - base.sum())
    out = np.broadcast_to(base, (batches, len(w))).copy()
    if extra <= 0 or batches <= 0:
        return out
    edges = np.concatenate([[0.0], np.cumsum(frac)])
    edges *= extra / edges[-1]  # R sample points u, u + 1, ..., u + R - 1 over [0, R)
    u = np.modf(np.arange(first, first + batches, dtype=np.float64) * PHI)[0][:, None]
    # source i takes one extra when a point u + k lies in [edges[i], edges[i + 1]) (at most one: width < 1)
    out += (np.ceil(edges[1:] - u) - np.ceil(edges[:-1] - u)).astype(np.int64)
    return out


def quota_positions(quotas: np.ndarray) -> np.ndarray:
    """[J + 1, sources]: windows of each source a stream has yielded before batch j, given batch quotas [J, sources]."""
    out = np.zeros((len(quotas) + 1, quotas.shape[1]), dtype=np.int64)
    np.cumsum(quotas, axis=0, out=out[1:])
    return out


def epoch_quotas(config: PlanConfig, w: np.ndarray, sizes: list[np.ndarray]) -> np.ndarray:
    """The quotas of the J batches every stream yields: the most that fit ("drop") or the fewest that cover ("pad").

    ``sizes[i]`` holds the windows of source i each stream owns (its range of the source's order).
    """
    b = config.batch_size
    low = np.array([s.min() if len(s) else 0 for s in sizes], dtype=np.int64)
    high = np.array([s.max() if len(s) else 0 for s in sizes], dtype=np.int64)
    if config.equalize == "drop":
        cap = int(low.sum()) // b + 1  # in cap batches some source overruns: J * B never exceeds what streams own
        cum = np.cumsum(batch_quotas(b, w, cap), axis=0)
        fits = (cum <= low).all(axis=1)
        return batch_quotas(b, w, int(np.argmin(fits)) if not fits.all() else cap)
    if not high.any():
        return batch_quotas(b, w, 0)
    live = w > 0
    cap = int(np.max(np.ceil(high[live] / (w[live] * b)))) + 2
    while True:  # the fewest batches whose quotas cover every stream's range of every source
        cum = np.cumsum(batch_quotas(b, w, cap), axis=0)
        covers = (cum >= high).all(axis=1)
        if covers.any():
            return batch_quotas(b, w, int(np.argmax(covers)) + 1)
        cap = 2 * cap


SPAN_STEPS = 1 << 15  # micro-batches whose quotas SlotQuotas makes at once while summing them
TURN = 2 ** 0.5 - 1  # the rotation of a global batch's positions per micro-row (an irrational apart from PHI)


def slot_quotas(m: np.ndarray, w: np.ndarray, micro: int, first: int = 0) -> np.ndarray:
    """int64 [micro, slots, sources]: items of each source in slot a's micro-batch t, for t from ``first`` on.

    Global micro-row t (every slot's micro-batch t, the G items of a global batch) holds
    ``batch_quotas(G)``'s row t of each source: floor(w_i G) or ceil(w_i G). Its G positions are
    dealt to sources by smooth weighted round robin (``interleave``), a circular pattern turned by
    frac(t * TURN) * G, and slot a takes positions [G a // A, G (a + 1) // A) of it: any run of
    slots (a rank's) holds its share within one or two items of each source (two sources: floor
    or ceil of it), and every slot takes each source's share on average, as its streams' ranges do.
    Each row is a function of t alone, so any run of rows can be made when it is needed (``SlotQuotas``).
    """
    slots = len(m)
    if len(w) == 1:  # every micro-batch the slot's size: one value, seen as a table (read-only, no memory a step)
        return np.broadcast_to(np.asarray(m, dtype=np.int64)[None, :, None], (micro, slots, 1))
    rows = batch_quotas(int(m.sum()), w, micro, first)
    g, edges = int(m.sum()), np.concatenate([[0], np.cumsum(m)])
    # row t's rotation: by another irrational than the rows' own (mix.PHI), with which it would correlate (a source's
    # extra item would fall on the same slots)
    turn = (np.modf(np.arange(first, first + micro, dtype=np.float64) * TURN)[0] * g).astype(np.int64)
    out = np.zeros((micro, slots, len(w)), dtype=np.int64)
    kinds, which = np.unique(rows, axis=0, return_inverse=True)  # a few distinct rows (floor or ceil per source)
    for k, counts in enumerate(kinds):
        cum = _pattern(counts)
        mine = np.flatnonzero(which.reshape(-1) == k)
        at = cum[turn[mine, None] + edges[None, :]]  # [rows, slots + 1, sources]: items before each slot edge
        out[mine] = np.diff(at, axis=1)
    return out


@functools.lru_cache(maxsize=64)
def _pattern_of(counts: tuple[int, ...]) -> np.ndarray:
    """``_pattern``, made once per distinct row (a mix has a few: each source's floor or ceil)."""
    twice = np.eye(len(counts), dtype=np.int64)[interleave(np.array(counts)) * 2]  # the circular pattern, twice
    out = np.concatenate([np.zeros((1, len(counts)), dtype=np.int64), np.cumsum(twice, axis=0)])
    out.flags.writeable = False
    return out


def _pattern(counts: np.ndarray) -> np.ndarray:
    """[2G + 1, sources]: items of each source before each position of the circular pattern of ``counts``, twice."""
    return _pattern_of(tuple(int(n) for n in counts))


class SlotQuotas:
    """The slots' quotas of an epoch's T micro-batches (``slot_quotas``), made a run of steps at a time: a plan keeps
    only every ``every`` steps' running sums (a whole table of a mix held 8 slots x sources x 8 bytes a step, in
    every process; one source keeps a value a slot)."""

    def __init__(self, slot_items: np.ndarray, weights: np.ndarray, micro: int, every: int):
        self.slot_items, self.weights = np.asarray(slot_items, dtype=np.int64), np.asarray(weights)
        self.micro, self.every = int(micro), max(1, every)
        self.slots, self.sources = len(self.slot_items), len(self.weights)
        self._key = (tuple(self.slot_items.tolist()), tuple(self.weights.tolist()), self.micro, self.every)  # chunk()'s
        span = self.every * max(1, SPAN_STEPS // self.every)  # rows made at once: a few MB, whatever the epoch
        sums = [np.add.reduceat(self.rows(t, min(t + span, self.micro)), np.arange(0, min(span, self.micro - t),
                                                                                 self.every), axis=0)
                for t in range(0, self.micro, span)]
        self.prefix = np.zeros((-(-self.micro // self.every) + 1, self.slots, self.sources), dtype=np.int64)
        if sums:  # prefix[k]: items before step k * every (the last: before the epoch's end)
            np.cumsum(np.concatenate(sums), axis=0, out=self.prefix[1:])
        self.prefix.flags.writeable = False

    def __len__(self) -> int:
        return self.micro

    def rows(self, t0: int, t1: int) -> np.ndarray:
        """[t1 - t0, slots, sources]: the quotas of micro-batches [t0, t1)."""
        t1 = min(max(t0, t1), self.micro)
        return slot_quotas(self.slot_items, self.weights, max(0, t1 - t0), t0)

    def chunk(self, k: int) -> np.ndarray:
        """[every (the last chunk: fewer), slots, sources]: the quotas of micro-batches [k every, (k + 1) every),
        read-only; the chunks read lately are kept, for a process's schedule and its sources' block readers alike
        (``_chunk_rows``)."""
        return _chunk_rows(*self._key, k)

    def at(self, steps: np.ndarray) -> np.ndarray:
        """[len(steps), slots, sources]: ``before`` each of ``steps``."""
        steps = np.minimum(np.maximum(np.asarray(steps, dtype=np.int64), 0), self.micro)
        whole = (steps % self.every == 0) | (steps == self.micro)  # at a running sum kept
        out = self.prefix[np.where(whole, -(-steps // self.every), 0)]
        for i in np.flatnonzero(~whole):
            out[i] = self.before(int(steps[i]))
        return out

    def before(self, t: int) -> np.ndarray:
        """[slots, sources]: items each slot's micro-batches [0, t) hold."""
        t = min(max(0, int(t)), self.micro)
        k = t // self.every
        if k * self.every == t or t == self.micro:
            return self.prefix[-(-t // self.every)]
        return self.prefix[k] + self.rows(k * self.every, t).sum(axis=0)


@functools.lru_cache(maxsize=8)
def _chunk_rows(m: tuple[int, ...], w: tuple[float, ...], micro: int, every: int, k: int) -> np.ndarray:
    """``SlotQuotas.chunk``, kept by value (no cache on the plan: it stays picklable and free of cycles). A few:
    those a process reads at once (its schedule's, each source's block being read and read ahead), each no larger
    than the window arrays of the block that reads it (slots x sources integers a step, against G a step)."""
    out = slot_quotas(np.array(m, dtype=np.int64), np.array(w), max(0, min((k + 1) * every, micro) - k * every),
                      k * every)
    out.flags.writeable = False
    return out


def interleave(counts: np.ndarray) -> list[int]:
    """The source of each of sum(counts) positions, ``counts[i]`` of source i, spread evenly (smooth weighted
    round robin: each position goes to the source furthest behind its share; ties to the earlier source)."""
    total, c = int(counts.sum()), [int(n) for n in counts]
    credit, out = [0] * len(c), []
    for _ in range(total):
        credit = [a + b for a, b in zip(credit, c)]
        i = max(range(len(c)), key=credit.__getitem__)
        credit[i] -= total
        out.append(i)
    return out
