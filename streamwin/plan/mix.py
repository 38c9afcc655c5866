"""Weighted mixing of several datasets: each source's share of an epoch and of every batch.

Pure (numpy only), like plan.py, whose single-source plans it composes:

1. **Shares.** An epoch has ``E`` windows (by default every window of every source). Source
   ``i`` gives ``E_i`` of them: ``w_i * E`` rounded by largest remainder (the shares sum to
   ``E``, each within 1 of ``w_i * E``). Without weights each source gives all its windows.
2. **Orders.** Source ``i``'s window order (``ShareOrder``, ``E_i`` long) is its slices
   permuted per repetition ``r`` with an RNG keyed by (seed, epoch, source, r), laid end to
   end and cut at ``E_i``: a small source repeats (each window ``E_i // N_i`` times or once
   more), a large one gives a different subset each epoch, each window at most once.
3. **Quotas.** Every batch holds ``floor(w_i * B)`` or ``ceil(w_i * B)`` windows of source
   ``i`` (``batch_quotas``): the ``R = B - sum floor`` extras go to sources by systematic
   sampling with a low-discrepancy offset per batch, so each source's running count stays
   within a few windows of ``w_i * B * j``. The quotas are the same on every stream.
4. **Plan.** Each source's order is dealt over the ``S`` streams as for one dataset
   (plan._deal); a stream yields ``J`` batches, ``J`` the most for which every source's
   summed quotas fit (equalize="drop") or cover (equalize="pad") each stream's range of it.
   Batch ``j`` of a stream takes the next ``quotas[j, i]`` windows of source ``i``'s
   sub-stream, a ``plan.Plan`` of its own (blocks shuffled per block as for one dataset), so
   the position of batch ``j`` in source ``i`` is ``quotas[:j, i].sum()``: resume is a cursor.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from streamwin.plan.epoch import (Plan, PlanConfig, RestOrder, SliceOrder, WindowIndex, check_elastic, make_plan, stream_ranges,
                   worker_batches)

PHI = (5 ** 0.5 - 1) / 2  # the golden ratio's fraction: the offsets j * PHI mod 1 fill [0, 1) evenly


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


def batch_quotas(batch_size: int, weights: Sequence[float], batches: int) -> np.ndarray:
    """Windows of each source in each of ``batches`` batches: int64 [batches, sources], rows summing to B.

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
    u = np.modf(np.arange(batches, dtype=np.float64) * PHI)[0][:, None]
    # source i takes one extra when a point u + k lies in [edges[i], edges[i + 1]) (at most one: width < 1)
    out += (np.ceil(edges[1:] - u) - np.ceil(edges[:-1] - u)).astype(np.int64)
    return out


class ShareOrder:
    """Source ``source``'s window order in an epoch: its slices permuted per repetition, cut at ``total``."""

    dropped_before = 0  # windows of the epoch no earlier plan left out

    def __init__(self, slices: SliceOrder, total: int, *, seed: int, epoch: int, source: int, shuffle: bool):
        self.slice_lo, self.slice_len = slices.slice_lo, np.diff(slices.slice_pos)  # in manifest order
        self.windows = slices.total  # N: the source's windows
        if total > 0 and self.windows == 0:
            raise ValueError(f"source {source} has no windows but a share of {total}")
        self.total, self.key, self.shuffle = int(total), (int(seed), int(epoch), int(source)), shuffle
        self._reps: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def repeats(self) -> float:
        """How many times the epoch takes each window of the source on average (E_i / N_i)."""
        return self.total / self.windows if self.windows else 0.0

    def repetition(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """(first window, position in the repetition) of each slice of repetition ``r``, with the end."""
        if r not in self._reps:
            if len(self._reps) > 8:
                self._reps.clear()
            lo, n = self.slice_lo, self.slice_len
            if self.shuffle and len(lo) > 1:
                perm = np.random.default_rng([*self.key, r, 2]).permutation(len(lo))
                lo, n = lo[perm], n[perm]
            self._reps[r] = lo, np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
        return self._reps[r]

    def at(self, v: np.ndarray) -> np.ndarray:
        """Global window indices (of the source's window space) at positions ``v`` of the order."""
        v = np.asarray(v, dtype=np.int64)
        rep, pos = np.divmod(v, max(self.windows, 1))
        out = np.empty(len(v), dtype=np.int64)
        for r in np.unique(rep):
            lo, at = self.repetition(int(r))
            pick = rep == r
            j = np.searchsorted(at, pos[pick], side="right") - 1
            out[pick] = lo[j] + (pos[pick] - at[j])
        return out


def quota_positions(quotas: np.ndarray) -> np.ndarray:
    """[J + 1, sources]: windows of each source a stream has yielded before batch j, given batch quotas [J, sources]."""
    out = np.zeros((len(quotas) + 1, quotas.shape[1]), dtype=np.int64)
    np.cumsum(quotas, axis=0, out=out[1:])
    return out


@dataclass(frozen=True, eq=False)
class MixPlan:
    """One epoch's plan of a mixed dataset: a ``plan.Plan`` per source and the batch quotas."""

    config: PlanConfig
    epoch: int
    weights: np.ndarray  # normalized
    plans: tuple[Plan, ...]  # per source: its order dealt over the streams, windows_per_stream = L_i
    quotas: np.ndarray  # [J, sources] windows of each source in batch j of every stream
    generation: int = 0

    @property
    def cum(self) -> np.ndarray:
        """[J + 1, sources]: windows of each source a stream has yielded before batch j."""
        return quota_positions(self.quotas)

    @property
    def batches_per_stream(self) -> int:
        return len(self.quotas)

    @property
    def batches_per_rank(self) -> int:
        return self.batches_per_stream * self.config.workers_per_rank

    @property
    def total_windows(self) -> int:
        return sum(p.total_windows for p in self.plans)

    @property
    def dropped_windows(self) -> int:
        return sum(p.dropped_windows for p in self.plans)

    @property
    def repeated_windows(self) -> int:
        return sum(p.repeated_windows for p in self.plans)

    def taken(self, stream: int, batches_per_rank: int) -> int:
        """Batches ``stream`` has yielded once its rank took ``batches_per_rank`` (round robin over workers)."""
        n = self.config.workers_per_rank
        return min(worker_batches(batches_per_rank, n, stream % n), self.batches_per_stream)

    def used(self, batches_per_rank: int) -> np.ndarray:
        """[sources, streams]: windows of each source each stream has yielded after ``batches_per_rank``."""
        cum = self.cum
        steps = [self.taken(s, batches_per_rank) for s in range(self.config.num_streams)]
        return cum[steps].T.copy()


def source_slices(index: WindowIndex, shard_starts: np.ndarray, config: PlanConfig) -> SliceOrder:
    """A source's slices in manifest order (``make_plan``'s cut, before any permutation)."""
    return make_plan(None, shard_starts, replace(config, shuffle=False), 0, index=index).order


def mix_plan(config: PlanConfig, epoch: int, weights: Sequence[float], orders: Sequence, indexes: Sequence[WindowIndex],
             generation: int = 0) -> MixPlan:
    """Deal each source's order over ``config``'s streams and fix the quotas and batch count J."""
    w = normalized(weights)
    ranges = [stream_ranges(o.total, config.num_streams) for o in orders]
    quotas = _quotas(config, w, [np.diff(r) for r in ranges])
    per_stream = quotas.sum(axis=0)
    plans = tuple(Plan(config, epoch, index, order, r, int(per_stream[i]), generation, source=i)
                  for i, (index, order, r) in enumerate(zip(indexes, orders, ranges)))
    return MixPlan(config, epoch, w, plans, quotas, generation)


def plan_epoch(config: PlanConfig, epoch: int, indexes: Sequence[WindowIndex], shard_starts: Sequence[np.ndarray],
               weights: Sequence[float] | None, epoch_windows: int | None, names: Sequence[str]) -> MixPlan:
    """A mixed epoch's plan from each source's window space and shard boundaries (``names`` for errors)."""
    if not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
    windows = [ix.total for ix in indexes]
    share = shares(sum(windows) if epoch_windows is None else epoch_windows, weights, windows)
    orders = []
    for i, (name, index, starts) in enumerate(zip(names, indexes, shard_starts)):
        if share[i] and not windows[i]:
            raise ValueError(f"{name!r} has no windows of {config.spec} but a share of {share[i]} windows per epoch")
        orders.append(ShareOrder(source_slices(index, starts, config), int(share[i]), seed=config.seed,
                                 epoch=int(epoch), source=i, shuffle=config.shuffle))
    if weights is None:
        weights = windows if sum(windows) else [1.0] * len(windows)
    return mix_plan(config, int(epoch), weights, orders, indexes)


def rest_mix(base: MixPlan, batches_per_rank: int, config: PlanConfig) -> MixPlan:
    """The rest of ``base``'s epoch after each rank took ``batches_per_rank`` batches, dealt over ``config``.

    Per source, what each old stream had not yielded (plan.RestOrder over its consumed windows)
    is mixed anew at the same weights over the new streams.
    """
    check_elastic(base.config, config)
    used = base.used(batches_per_rank)
    orders = [RestOrder(p, used=u) for p, u in zip(base.plans, used)]
    return mix_plan(config, base.epoch, base.weights, orders, [p.index for p in base.plans], base.generation + 1)


def _quotas(config: PlanConfig, w: np.ndarray, sizes: list[np.ndarray]) -> np.ndarray:
    """The quotas of the J batches every stream yields: the most that fit ("drop") or the fewest that cover ("pad")."""
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
