"""Dealing an epoch over canonical streams (plan/canon.py): each source's order over the C streams, the slots'
quotas of every micro-batch, and the steps of the epoch (the same on every rank, in every world).

The config is walked once: the slots' sizes, the live slots and the running sums of their quotas are made
here once, each deal of the ranges (a mix is dealt again, ``REDEALS``) only counts the steps it gives, and
the plan (its ``SlotQuotas``, each stream's items, blocks aligned to the step) is built once, from the deal
kept.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
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


class RunningSums:
    """[T + 1, slots, sources]: items of each source the slots' micro-batches [0, t) hold (``mix.slot_quotas``),
    made for the micro-batches asked for so far and extended on demand: a row is a function of t alone, so the
    deals of one weighting share them."""

    def __init__(self, slot_items: np.ndarray, weights: np.ndarray):
        self.slot_items, self.weights = slot_items, weights
        self.sums = np.zeros((1, len(slot_items), len(weights)), dtype=np.int64)

    def upto(self, micro: int) -> np.ndarray:
        """[micro + 1, slots, sources]: the sums before each of micro-batches 0..micro."""
        made = len(self.sums) - 1
        if micro > made:
            more = np.cumsum(slot_quotas(self.slot_items, self.weights, micro - made, made), axis=0)
            self.sums = np.concatenate([self.sums, self.sums[-1] + more])
        return self.sums[: micro + 1]


@dataclass
class Deal:
    """One deal of the sources' ranges over the streams: what it gives, before a plan is built of it."""

    sources: list[SourcePlan]  # per source: its ranges (lengths: the ranges' sizes)
    rows: list[RowPlan] | None  # packed: each source's rows per block
    item_weights: np.ndarray  # each source's share of a micro-batch's items (packed: of the rows filled)
    steps: int  # global batches of the epoch
    items: np.ndarray  # [sources, streams]: items each stream gives of each source in those steps


class CanonDealer:
    """Deals an epoch over ``config``'s canonical streams: the slots' sizes and sums made once for every deal."""

    def __init__(self, config: PlanConfig, epoch: int, weights: np.ndarray, orders: Sequence,
                 spaces: Sequence[WindowSpace], keyed: list, generation: int):
        self.config, self.epoch, self.weights, self.generation = config, epoch, weights, generation
        self.orders, self.spaces, self.keyed = orders, spaces, keyed
        self.slots, self.phases = config.canonical
        self.slot_items = slot_sizes(config.world_size * config.batch_size, self.slots)
        self.live_slots = [a for a in range(self.slots) if self.slot_items[a]]
        self.drop = config.equalize == "drop"
        self._sums: RunningSums | None = None

    def sums(self, item_weights: np.ndarray) -> RunningSums:
        """The running sums of the slots' quotas at ``item_weights`` (kept while the weights stay)."""
        if self._sums is None or not np.array_equal(self._sums.weights, item_weights):
            self._sums = RunningSums(self.slot_items, item_weights)
        return self._sums

    def deal(self, shares: list[np.ndarray]) -> Deal:
        """Source i's ranges in proportion to ``shares[i]`` [streams], and the steps and items they give."""
        cfg, slots, phases, slot_items = self.config, self.slots, self.phases, self.slot_items
        ranges = [stream_ranges(o.total, slots * phases, share) for o, share in zip(self.orders, shares)]
        plans = [SourcePlan(cfg, self.epoch, space, order, r, int(np.diff(r).max(initial=0)), self.generation,
                            source=key, lengths=np.diff(r))
                 for space, order, r, key in zip(self.spaces, self.orders, ranges, self.keyed)]
        item_weights = self.weights  # the sources' shares of every micro-batch
        if cfg.pack_length is not None:  # each stream reads every window it owns; items are rows
            row_units = cfg.pack_length // cfg.spec.window_multiple
            rows = [RowPlan(p, row_units) for p in plans]
            sizes = np.stack([r.per_stream for r in rows])
            filled = sizes.sum(axis=1).astype(np.float64)
            item_weights = filled / filled.sum() if filled.sum() else self.weights
        else:
            rows, sizes = None, np.stack([np.diff(r) for r in ranges])
        live = self.live_slots
        sums = None
        if len(item_weights) == 1:  # one source: a slot takes its size every step, its streams give size // that
            size = sizes[0].reshape(slots, phases).T[:, live]  # [phases, live slots]
            per_phase = size // slot_items[live] if self.drop else -(-size // slot_items[live])
        else:
            micro = max([int(sizes[:, a * phases:(a + 1) * phases].sum(axis=0).max(initial=0)) // int(slot_items[a])
                         for a in live], default=0) + 2
            while True:  # enough micro-batches for every stream to run out (pad: cover) within them
                sums = self.sums(item_weights).upto(micro)
                per_phase = np.array([[phase_steps(sums[:, a], sizes[:, a * phases + p], self.drop) for a in live]
                                      for p in range(phases)])
                if self.drop or (per_phase <= micro).all():
                    break
                micro *= 2
        steps = self._steps(per_phase)
        taken = [max(0, -(-(steps - c % phases) // phases)) for c in range(slots * phases)]
        if sums is None:
            items = np.array([[int(slot_items[c // phases]) * taken[c] for c in range(slots * phases)]],
                             dtype=np.int64)
        else:
            items = np.array([[int(sums[taken[c], c // phases, i]) for c in range(slots * phases)]
                              for i in range(len(plans))], dtype=np.int64)
        return Deal(plans, rows, item_weights, steps, items)

    def _steps(self, per_phase: np.ndarray) -> int:
        """The epoch's steps from the [phases, live slots] micro-batches each stream gives: with "drop", the least
        over phases p of phases x (the fewest phase p's streams give) + p; with "pad", the fewest that cover every
        phase."""
        phases = self.phases
        if self.drop:
            fewest = per_phase.min(axis=1) if self.live_slots else np.zeros(phases, dtype=np.int64)
            return int(min(phases * int(fewest[p]) + p for p in range(phases)))
        most = per_phase.max(axis=1)
        return max([phases * (int(most[p]) - 1) + p + 1 for p in range(phases) if most[p] > 0], default=0)

    def plan(self, dealt: Deal) -> CanonPlan:
        """The epoch's plan of a deal: the slots' quotas kept a chunk of steps at a time, each stream's items."""
        cfg, items = self.config, dealt.items
        micro = -(-dealt.steps // self.phases)
        quotas = SlotQuotas(self.slot_items, dealt.item_weights, micro, chunk_steps(cfg))  # running sums a chunk
        plans = dealt.sources
        if cfg.aligned:  # blocks aligned to the step, laid chunk after chunk (StripedOrder)
            at = quotas.at(chunk_edges(cfg, dealt.steps))  # [chunks + 1, slots, sources]: items before each chunk
            bounds = [tuple(at[:, a, i].copy() for a in range(self.slots)) for i in range(len(plans))]
            plans = [replace(p, lengths=items[i], windows_per_stream=int(items[i].max(initial=0)), bounds=b,
                             order=StripedOrder(p.order, p.stream_lo, b))
                     for i, (p, b) in enumerate(zip(plans, bounds))]
        elif dealt.rows is None:
            plans = [replace(p, lengths=items[i], windows_per_stream=int(items[i].max(initial=0)))
                     for i, p in enumerate(plans)]
        else:
            plans = [replace(p, rows=r, rows_per_stream=items[i]) for i, (p, r) in enumerate(zip(plans, dealt.rows))]
        return CanonPlan(cfg, self.epoch, self.weights, tuple(plans), np.zeros((0, len(plans)), dtype=np.int64),
                         self.generation, slots=quotas, steps=dealt.steps)


def deal_canonical(config: PlanConfig, epoch: int, weights: np.ndarray, orders: Sequence,
                   spaces: Sequence[WindowSpace], keyed: list, generation: int = 0) -> CanonPlan:
    """Deal each source's order over the canonical streams and fix the epoch's steps.

    The ranges follow the slots' micro-batches (every stream runs out at the same step). With
    several sources a stream's share of each source wavers around its slot's average by an
    item or two, a lot for a small source over 64 streams: the ranges are then dealt again in
    proportion to what each stream takes of each source under the first deal.
    """
    dealer = CanonDealer(config, epoch, weights, orders, spaces, keyed, generation)
    even = np.repeat(dealer.slot_items, dealer.phases)
    dealt = dealer.deal([even] * len(orders))
    for _ in range(REDEALS if len(orders) > 1 else 0):
        if not dealt.steps:
            break
        again = dealer.deal([t if t.sum() else even for t in dealt.items])
        if again.steps <= dealt.steps:
            break
        dealt = again
    return dealer.plan(dealt)
