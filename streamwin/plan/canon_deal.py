"""Dealing an epoch over canonical streams (plan/canon.py): each source's order over the C streams, the slots'
quotas of every micro-batch, and K, the steps of the epoch (the same on every rank, in every world)."""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from streamwin.plan.canon import CanonPlan, chunk_edges, chunk_steps, slot_sizes
from streamwin.plan.mix import SlotQuotas, slot_quotas
from streamwin.plan.options import PlanConfig
from streamwin.plan.order import StripedOrder
from streamwin.plan.rows import RowPlan
from streamwin.plan.space import WindowSpace
from streamwin.plan.streams import SourcePlan, stream_ranges


def phase_steps(cum: np.ndarray, size: np.ndarray, drop: bool) -> int:
    """Micro-batches a stream of ``size`` items per source gives: the most that fit (``drop``), or the fewest that
    cover; ``cum`` [T + 1, sources] its slot's summed quotas (from 0). T when T do not suffice."""
    if drop:
        return min(int(np.searchsorted(cum[:, i], size[i], side="right")) - 1 for i in range(len(size)))
    return max(int(np.searchsorted(cum[:, i], size[i], side="left")) for i in range(len(size)))


REDEALS = 4  # deals again, at most, of a mix's ranges in proportion to what each stream takes


def deal_canonical(config: PlanConfig, epoch: int, w: np.ndarray, orders: Sequence, spaces: Sequence[WindowSpace],
                   keyed: list, generation: int = 0) -> CanonPlan:
    """Deal each source's order over the canonical streams and fix K.

    The ranges follow the slots' micro-batches (every stream runs out at the same step). With
    several sources a stream's share of each source wavers around its slot's average by an
    item or two, a lot for a small source over 64 streams: the ranges are then dealt again in
    proportion to what each stream takes of each source under the first deal.
    """
    slots, phases = config.canonical
    m = slot_sizes(config.world_size * config.batch_size, slots)
    plan = _deal(config, epoch, w, orders, spaces, keyed, generation, [np.repeat(m, phases)] * len(orders))
    for _ in range(REDEALS if len(orders) > 1 else 0):
        if not plan.steps:
            break
        takes = [np.asarray(p.rows_per_stream if p.rows is not None else p.lengths) for p in plan.sources]
        again = _deal(config, epoch, w, orders, spaces, keyed, generation,
                      [t if t.sum() else np.repeat(m, phases) for t in takes])
        if again.steps <= plan.steps:
            break
        plan = again
    return plan


def _deal(config: PlanConfig, epoch: int, w: np.ndarray, orders: Sequence, spaces: Sequence[WindowSpace],
          keyed: list, generation: int, shares: list[np.ndarray]) -> CanonPlan:
    """``deal_canonical`` with source i's ranges in proportion to ``shares[i]`` [C]."""
    slots, phases = config.canonical
    m = slot_sizes(config.world_size * config.batch_size, slots)
    ranges = [stream_ranges(o.total, slots * phases, share) for o, share in zip(orders, shares)]
    plans = [SourcePlan(config, epoch, space, order, r, int(np.diff(r).max(initial=0)), generation, source=key,
                        lengths=np.diff(r)) for space, order, r, key in zip(spaces, orders, ranges, keyed)]
    q_w = w  # the sources' shares of every micro-batch
    if config.pack_length is not None:  # each stream reads every window it owns; items are rows
        row_units = config.pack_length // config.spec.window_multiple
        rows = [RowPlan(p, row_units) for p in plans]
        sizes = np.stack([r.per_stream for r in rows])
        filled = sizes.sum(axis=1).astype(np.float64)
        q_w = filled / filled.sum() if filled.sum() else w
    else:
        rows, sizes = None, np.stack([np.diff(r) for r in ranges])
    drop = config.equalize == "drop"
    live = [a for a in range(slots) if m[a]]
    if len(q_w) == 1:  # one source: slot a takes m_a items every step, so its streams give size // m_a (pad: ceil)
        size = sizes[0].reshape(slots, phases).T[:, live]  # [phases, live slots]
        per = size // m[live] if drop else -(-size // m[live])
        quotas = None
    else:
        need = max([int(sizes[:, a * phases:(a + 1) * phases].sum(axis=0).max(initial=0)) // int(m[a])
                    for a in live], default=0) + 2
        while True:  # enough micro-batches for every stream to run out (pad: cover) within them
            quotas = slot_quotas(m, q_w, need)  # [need, slots, sources], while dealing only
            cums = np.concatenate([np.zeros((1, slots, len(q_w)), dtype=np.int64), np.cumsum(quotas, axis=0)])
            per = np.array([[phase_steps(cums[:, a], sizes[:, a * phases + p], drop) for a in live]
                            for p in range(phases)])
            if drop or (per <= need).all():
                break
            need *= 2
    if drop:
        j = per.min(axis=1) if live else np.zeros(phases, dtype=np.int64)
        steps = int(min(phases * int(j[p]) + p for p in range(phases)))
    else:
        j = per.max(axis=1)
        steps = max([phases * (int(j[p]) - 1) + p + 1 for p in range(phases) if j[p] > 0], default=0)
    micro = -(-steps // phases)
    quotas = SlotQuotas(m, q_w, micro, chunk_steps(config))  # the plan keeps running sums a chunk, no table a step
    taken = [max(0, -(-(steps - c % phases) // phases)) for c in range(slots * phases)]
    items = np.array([[int(quotas.before(taken[c])[c // phases, i]) for c in range(slots * phases)]
                      for i in range(len(plans))], dtype=np.int64)
    if config.aligned:  # blocks aligned to the step, laid chunk after chunk (StripedOrder)
        bounds = [_aligned(config, quotas, i, steps) for i in range(len(plans))]
        plans = [replace(p, lengths=items[i], windows_per_stream=int(items[i].max(initial=0)), bounds=b,
                         order=StripedOrder(p.order, p.stream_lo, b)) for i, (p, b) in enumerate(zip(plans, bounds))]
    elif rows is None:
        plans = [replace(p, lengths=items[i], windows_per_stream=int(items[i].max(initial=0)))
                 for i, p in enumerate(plans)]
    else:
        plans = [replace(p, rows=r, rows_per_stream=items[i]) for i, (p, r) in enumerate(zip(plans, rows))]
    return CanonPlan(config, epoch, w, tuple(plans), np.zeros((0, len(plans)), dtype=np.int64), generation,
                     slots=quotas, steps=steps)


def _aligned(config: PlanConfig, quotas: SlotQuotas, source: int, steps: int) -> tuple[np.ndarray, ...]:
    """Per stream (one phase: stream a is slot a), items of ``source`` before each block of Q steps: the blocks of
    all slots cover the same steps."""
    at = quotas.at(chunk_edges(config, steps))[:, :, source]  # [chunks + 1, slots]
    return tuple(at[:, a].copy() for a in range(quotas.slots))
