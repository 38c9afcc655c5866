"""Canonical streams: one order of global batches, whatever the number of ranks and workers.

``canonical=(A, P)`` (asked for; "auto" is (8, 1) for 1, 2, 4 or 8 ranks of unpacked windows):
C = A x P canonical streams, A *rank slots* x P *step phases*. Nothing below depends on the
world size W or the worker count, only on the global batch G = world_size x batch_size (items:
windows, or packed rows), so global batch k (every rank's batch k, in rank order) is the same in
every world A allows, with any workers P allows.

1. **Slots.** Slot a's micro-batch holds m_a = G(a+1)//A - Ga//A items (they sum to G).
2. **Streams.** Stream c = a*P + p takes range c of each source's epoch order, the ranges in
   proportion to m_a (so every stream runs out at the same step; equal when A divides G), and
   permutes it in blocks of ``shuffle_buffer`` windows keyed (seed, epoch, c, block), as any
   stream does (streams.SourcePlan): reads, crops, packed rows and their fill are per block,
   as in the order that deals one stream per rank and worker. With one phase each stream's blocks
   hold its micro-batches of Q = shuffle_buffer / G steps, the order lies chunk by chunk, the slots'
   stripes of chunk j end to end (order.StripedOrder: a process's block of a chunk is one run), and
   chunk j is permuted once, keyed (seed, epoch, j), each stream taking its stripe in that order.
3. **Global batch k** is, slot after slot, micro-batch t = k // P of stream (a, k mod P). With
   a mix, global batch k holds floor(w_i G) or ceil(w_i G) items of source i, spread over the
   slots so evenly that every rank's batch holds its share within an item or two (``slot_quotas``).
4. **Who serves what.** Rank r of W (W divides A) serves slots [rA/W, (r+1)A/W): its batch k is
   its slots' micro-batches, batch_size items. Worker w of n (n divides P) makes the rank's
   batches k = w mod n (the loader takes workers' batches round robin), so it runs the streams
   of phases p = w mod n: (A/W) x (P/n) streams a process (all P phases in-process). A rank's
   batch is grouped by source (each source's micro-batches, slot after slot), as any batch of a mix.
5. **Steps.** Phase p's streams give J_p micro-batches: the most every slot's stream holds
   ("drop"), or the fewest that cover each ("pad": repeats of weight 0). The epoch has
   K = min_p (P J_p + p) steps ("drop"; "pad": the fewest that cover every phase), the same on
   every rank. Before step k stream (a, p) has given ceil((k - p) / P) micro-batches: the
   position of a job is its step, in any world.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Sequence

import numpy as np

from streamwin.plan.mix import slot_quotas
from streamwin.plan.options import PlanConfig
from streamwin.plan.order import StripedOrder
from streamwin.plan.rows import RowPlan
from streamwin.plan.streams import Plan, SourcePlan, stream_ranges, worker_batches
from streamwin.plan.space import WindowSpace


def slot_sizes(total: int, slots: int) -> np.ndarray:
    """[A] items of each slot's micro-batch: G(a+1)//A - Ga//A (they sum to ``total``)."""
    return np.diff(np.arange(slots + 1, dtype=np.int64) * total // slots)


def phase_steps(cum: np.ndarray, size: np.ndarray, drop: bool) -> int:
    """Micro-batches a stream of ``size`` items per source gives: the most that fit (``drop``), or the fewest that
    cover; ``cum`` [T + 1, sources] its slot's summed quotas (from 0). T when T do not suffice."""
    if drop:
        return min(int(np.searchsorted(cum[:, i], size[i], side="right")) - 1 for i in range(len(size)))
    return max(int(np.searchsorted(cum[:, i], size[i], side="left")) for i in range(len(size)))


@dataclass(frozen=True, eq=False)
class CanonPlan(Plan):
    """An epoch's plan over canonical streams: every source dealt over the C streams, the slots' quotas, K steps."""

    slots: tuple[np.ndarray, ...] = ()  # per slot a: [T, sources] items of each source in its micro-batch t
    steps: int = 0  # K: global batches of the epoch (every rank's batches)

    @property
    def batches_per_rank(self) -> int:
        return self.steps

    @property
    def batches_per_stream(self) -> int:
        """Micro-batches the streams of phase 0 give (the most any stream gives)."""
        return self.micro(0, self.steps)

    def micro(self, stream: int, step: int) -> int:
        """Micro-batches canonical stream ``stream`` has given before global step ``step``."""
        p = stream % self.config.canonical[1]
        return max(0, -(-(step - p) // self.config.canonical[1]))

    def taken(self, stream: int, batches_per_rank: int) -> int:
        return self.micro(stream, min(batches_per_rank, self.steps))

    def used(self, batches_per_rank: int) -> np.ndarray:
        """[sources, C]: items of each source each canonical stream has given after ``batches_per_rank`` steps."""
        a_of = np.arange(self.config.num_streams) // self.config.canonical[1]
        out = np.zeros((len(self.sources), self.config.num_streams), dtype=np.int64)
        for c in range(self.config.num_streams):
            t = self.taken(c, batches_per_rank)
            out[:, c] = self.slots[a_of[c]][:t].sum(axis=0)
        return out

    @cached_property
    def chunk(self) -> int:
        """Steps a chunk: Q = shuffle_buffer / G with blocks aligned to the step (workers take whole chunks), else 1."""
        return chunk_steps(self.config) if self.config.aligned else 1

    def worker_of(self, step: int, workers: int) -> int:
        return (step // self.chunk) % workers

    def worker_taken(self, batches_per_rank: int, workers: int, worker: int) -> int:
        q = self.chunk
        if q == 1:
            return worker_batches(batches_per_rank, workers, worker)
        starts = np.arange(worker * q, min(batches_per_rank, self.steps), workers * q)
        return int(np.minimum(batches_per_rank - starts, q).sum()) if len(starts) else 0

    def schedule(self, stream: int) -> "CanonSchedule | GroupSchedule":
        """What process ``stream`` (rank * max(1, workers) + worker) takes from which canonical stream, per batch."""
        if self.config.aligned:  # one group a source
            return GroupSchedule(self, *divmod(stream, self.config.workers_per_rank))
        return CanonSchedule(self, *divmod(stream, self.config.workers_per_rank))


class GroupPlan:
    """One source's blocks of a process's slots, block j of each read as one block.

    With one phase, stream a's block j holds its micro-batches of steps [jQ, (j + 1)Q) (``SourcePlan.bounds``),
    so the blocks of a process's slots cover the same steps: read as one block whose yield order is, step after
    step, each slot's micro-batch (slot after slot), a batch is one part and one gather, as with one stream.
    ``cum`` [slots, T + 1]: items each of the process's slots (streams ``lanes``, consecutive) took before step t.
    """

    def __init__(self, plan: SourcePlan, lanes: range, cum: np.ndarray, edges: np.ndarray, chunks: list[int]):
        self.plan, self.lanes, self.cum, self.edges = plan, lanes, cum, edges
        items = np.array([int((cum[:, edges[c + 1]] - cum[:, edges[c]]).sum()) for c in chunks], dtype=np.int64)
        # a block reads several of the process's chunks when its slots' part of one is small (a rank of many):
        # about shuffle_buffer windows a read, as one stream's block, whatever the world (the order is the chunks')
        per = max(1, plan.config.block_windows // max(1, int(items.max(initial=1))))
        self.blocks = [chunks[i : i + per] for i in range(0, len(chunks), per)]
        took = [int(items[i : i + per].sum()) for i in range(0, len(chunks), per)]
        self._bounds = np.concatenate([[0], np.cumsum(took, dtype=np.int64)]).astype(np.int64)
        self._recent: dict = {}

    def __getattr__(self, name: str):  # config, locate, ends, crop_key, crop_lengths...: the source plan's
        if name == "plan":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.plan, name)

    def num_blocks(self, stream: int) -> int:
        return len(self.blocks)

    def item_bounds(self, stream: int) -> np.ndarray:
        return self._bounds

    def block(self, stream: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        g, real, order = self.block_parts(stream, block)
        return g[order], real[order]

    def block_parts(self, stream: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(windows of the slots' blocks, stream order; real flags; the yield order: step after step, slot after slot)."""
        got = self._recent.get(block)
        if got is None:
            got = self._recent[block] = self._parts(block)
            if len(self._recent) > 4:
                self._recent.pop(next(iter(self._recent)))
        return got

    def _parts(self, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Block ``block``: its chunks' parts end to end (the yield order offset by the items before each)."""
        parts = [self._chunk(c) for c in self.blocks[block]]
        if len(parts) == 1:
            return parts[0]
        at = np.cumsum([0] + [len(g) for g, _, _ in parts[:-1]])
        out = (np.concatenate([g for g, _, _ in parts]), np.concatenate([r for _, r, _ in parts]),
               np.concatenate([y + a for (_, _, y), a in zip(parts, at)]))
        for a in out:
            a.flags.writeable = False
        return out

    def _chunk(self, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every slot's block of chunk ``block`` in one pass, no step per slot: their positions (one run of a
        StripedOrder) in one ``order.at``, their shuffles one restricted permutation (``stripe_shuffle``, as each
        stream's own), the yield order one stable sort by step."""
        sp = self.plan
        t0, t1 = int(self.edges[block]), int(self.edges[block + 1])
        lo, n = self.cum[:, t0], self.cum[:, t1] - self.cum[:, t0]  # per slot: items before the block, in it
        total = int(n.sum())
        lanes = np.arange(self.lanes.start, self.lanes.stop)
        starts = np.cumsum(n) - n  # where each slot's items begin in the block (stream order)
        u = np.arange(total, dtype=np.int64) + np.repeat(lo - starts, n)  # each item's position in its stream
        g = sp.order.at((np.repeat(sp.stream_lo[lanes], n) + u) % max(sp.total_windows, 1))
        real = u < np.repeat(np.diff(sp.stream_lo)[lanes], n)
        shuffled = (sp.stripe_shuffle(block, self.lanes.start, self.lanes.stop) if sp.config.shuffle
                    else np.arange(total, dtype=np.int64))  # slot after slot, each slot's items in its order
        steps = np.repeat(np.tile(np.arange(t1 - t0, dtype=np.int32), len(n)),
                          np.diff(self.cum[:, t0 : t1 + 1], axis=1).reshape(-1))  # the step of each, slot after slot
        yields = shuffled[np.argsort(steps, kind="stable")]  # step after step, slot after slot
        for a in (g, real, yields):
            a.flags.writeable = False
        return g, real, yields


class GroupSchedule:
    """A process's batches over blocks aligned to the step: one lane per source (its ``GroupPlan``). Worker w of n
    takes chunks w, w + n, ... of Q steps (all of them in-process): its batch j is the j-th step of its chunks."""

    def __init__(self, plan: CanonPlan, rank: int, worker: int):
        cfg = plan.config
        per = cfg.canonical[0] // cfg.world_size
        mine = range(rank * per, (rank + 1) * per)
        edges = chunk_edges(cfg, plan.steps)
        chunks = list(range(worker, len(edges) - 1, max(1, cfg.num_workers)))
        steps = np.concatenate([np.arange(edges[c], edges[c + 1]) for c in chunks]) if chunks else np.zeros(0, int)
        self.batches = len(steps)
        self.lanes = [(i, 0) for i in range(len(plan.sources))]
        self.plans, counts = [], []
        for i, sp in enumerate(plan.sources):
            took = np.stack([plan.slots[a][:, i] for a in mine]).reshape(len(mine), -1)  # [slots, T]
            cum = np.concatenate([np.zeros((len(mine), 1), dtype=np.int64), np.cumsum(took, axis=1)], axis=1)
            self.plans.append(GroupPlan(sp, mine, cum, edges, chunks))
            counts.append(took.sum(axis=0)[steps])
        self._counts = np.stack(counts, axis=1).astype(np.int64)
        self._cum = [np.concatenate([[0], np.cumsum(c)]) for c in counts]

    def parts(self, j: int) -> tuple[list[tuple[int, int]], np.ndarray]:
        counts = self._counts[j]
        return [(i, int(n)) for i, n in enumerate(counts.tolist()) if n], counts

    def positions(self, j: int) -> list[int]:
        return [int(c[min(j, len(c) - 1)]) for c in self._cum]


class CanonSchedule:
    """One process's batches: lane l = (source, canonical stream) of its slots and phases; batch j = global step k."""

    def __init__(self, plan: CanonPlan, rank: int, worker: int):
        cfg = plan.config
        slots, phases = cfg.canonical
        per, self.n, self.w = slots // cfg.world_size, cfg.num_workers, worker
        self.phases = phases
        mine = range(worker, phases, cfg.num_workers) if cfg.num_workers else range(phases)
        self.lanes = [(i, a * phases + p) for i in range(len(plan.sources))
                      for a in range(rank * per, (rank + 1) * per) for p in mine]
        self.batches = worker_batches(plan.steps, self.n, worker) if self.n else plan.steps
        self._col = [plan.slots[c // phases][:, i] for i, c in self.lanes]
        self._cum = [np.concatenate([[0], np.cumsum(q)]) for q in self._col]
        self._by_phase = {p: [(l, i) for l, (i, c) in enumerate(self.lanes) if c % phases == p] for p in mine}
        self.plans = plan.sources  # each source's block plan (its streams' blocks)
        self._sources = len(plan.sources)

    def step(self, j: int) -> int:
        """The global step of this process's batch ``j``."""
        return j * self.n + self.w if self.n else j

    def parts(self, j: int) -> tuple[list[tuple[int, int]], np.ndarray]:
        """((lane, items) of batch ``j`` in batch order, items of each source)."""
        k = self.step(j)
        t = k // self.phases
        counts = np.zeros(self._sources, dtype=np.int64)
        out = []
        for lane, i in self._by_phase[k % self.phases]:
            need = int(self._col[lane][t])
            if need:
                out.append((lane, need))
                counts[i] += need
        return out, counts

    def positions(self, j: int) -> list[int]:
        """Items each lane has given before this process's batch ``j``."""
        k = self.step(j)
        out = []
        for (_, c), cum in zip(self.lanes, self._cum):
            t = max(0, -(-(k - c % self.phases) // self.phases))
            out.append(int(cum[min(t, len(cum) - 1)]))
        return out


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
    need = max([int(sizes[:, a * phases:(a + 1) * phases].sum(axis=0).max(initial=0)) // int(m[a]) for a in live],
               default=0) + 2
    while True:  # enough micro-batches for every stream to run out (pad: cover) within them
        quotas = slot_quotas(m, q_w, need)
        cums = [np.concatenate([np.zeros((1, len(q_w)), dtype=np.int64), np.cumsum(q, axis=0)]) for q in quotas]
        per = np.array([[phase_steps(cums[a], sizes[:, a * phases + p], drop) for a in live] for p in range(phases)])
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
    quotas = tuple(q[:micro] for q in quotas)
    taken = [max(0, -(-(steps - c % phases) // phases)) for c in range(slots * phases)]
    items = np.array([[int(quotas[c // phases][:taken[c], i].sum()) for c in range(slots * phases)]
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


def chunk_steps(config: PlanConfig) -> int:
    """Q, the steps of a block aligned to the step: shuffle_buffer / G (a process's slots hold about one buffer)."""
    return max(1, -(-config.block_windows // (config.world_size * config.batch_size)))


def chunk_edges(config: PlanConfig, steps: int) -> np.ndarray:
    """[chunks + 1]: the first step of each chunk of Q steps of an epoch of ``steps``, then ``steps``."""
    q = chunk_steps(config)
    return np.unique(np.minimum(np.arange(0, steps + q, q), steps))


def _aligned(config: PlanConfig, quotas: tuple[np.ndarray, ...], source: int, steps: int) -> tuple[np.ndarray, ...]:
    """Per stream (one phase: stream a is slot a), items of ``source`` before each block of Q steps: the blocks of
    all slots cover the same steps."""
    edges = chunk_edges(config, steps)
    return tuple(np.concatenate([[0], np.cumsum(qa[:, source])])[edges] for qa in quotas)
