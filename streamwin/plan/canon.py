"""Canonical streams: one order of global batches, whatever the number of ranks and workers.

``canonical=(A, P)`` ("auto", the default, is (8, 1) for 1, 2, 4 or 8 ranks: windows or packed rows, one source or a mix):
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
   With one phase a process reads its slots' stripes of a chunk as one block (``GroupPlan``), and
   its n workers either *share batches* (``shares_batches``: one source, n <= A/W, G >= A; no
   transform of whole batches): worker w takes every step of slots [A/W * w // n, A/W * (w+1) // n)
   of the rank's and writes their rows (one range: ``CanonPlan.rows``) into one slot the rank's
   workers share (feed/pool.py); or they take *chunks* w, w + n, ... of Q steps, each whole. Packed
   rows with one phase keep a stream's blocks (a block's rows are known only once packed, so blocks
   are not aligned to the step): worker w takes chunks of Q steps too (``worker_chunk``: about 2
   blocks' rows a slot), reading only the blocks its chunks' rows lie in (``RowChunkSchedule``).
5. **Steps.** Phase p's streams give J_p micro-batches: the most every slot's stream holds
   ("drop"), or the fewest that cover each ("pad": repeats of weight 0). The epoch has
   K = min_p (P J_p + p) steps ("drop"; "pad": the fewest that cover every phase), the same on
   every rank. Before step k stream (a, p) has given ceil((k - p) / P) micro-batches: the
   position of a job is its step, in any world.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from streamwin.plan.group import GroupPlan
from streamwin.plan.mix import SlotQuotas
from streamwin.plan.options import PlanConfig
from streamwin.plan.schedule import Parts, Schedule
from streamwin.plan.streams import Plan, worker_batches


def slot_sizes(total: int, slots: int) -> np.ndarray:
    """[A] items of each slot's micro-batch: G(a+1)//A - Ga//A (they sum to ``total``)."""
    return np.diff(np.arange(slots + 1, dtype=np.int64) * total // slots)


@dataclass(frozen=True, eq=False)
class CanonPlan(Plan):
    """An epoch's plan over canonical streams: every source dealt over the C streams, the slots' quotas, K steps."""

    slots: SlotQuotas | None = None  # items of each source in slot a's micro-batch t, made a chunk at a time
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
            out[:, c] = self.slots.before(self.taken(c, batches_per_rank))[a_of[c]]
        return out

    @cached_property
    def chunk(self) -> int:
        """Steps of the chunks workers take in turn with one phase (``worker_chunk``), else 1."""
        return worker_chunk(self.config) if self.config.chunked else 1

    def worker_of(self, step: int, workers: int) -> int:
        return 0 if self.shared else (step // self.chunk) % workers

    def worker_taken(self, batches_per_rank: int, workers: int, worker: int) -> int:
        if self.shared:  # every worker writes its rows of every batch
            return min(batches_per_rank, self.steps)
        q = self.chunk
        if q == 1:
            return worker_batches(batches_per_rank, workers, worker)
        starts = np.arange(worker * q, min(batches_per_rank, self.steps), workers * q)
        return int(np.minimum(batches_per_rank - starts, q).sum()) if len(starts) else 0

    def rows(self, stream: int) -> tuple[int, int] | None:
        """Shared batches: the rows of the rank's batch worker ``stream`` writes (its slots' micro-batches, one source:
        slot after slot), else None."""
        if not self.shared:
            return None
        cfg = self.config
        rank, worker = divmod(stream, cfg.workers_per_rank)
        mine = worker_slots(cfg, rank, worker)
        m = slot_sizes(cfg.world_size * cfg.batch_size, cfg.canonical[0])
        lo = int(m[slot_range(cfg, rank)[0] : mine.start].sum())
        return lo, lo + int(m[mine.start : mine.stop].sum())

    def schedule(self, stream: int) -> "CanonSchedule | GroupSchedule":
        """What process ``stream`` (rank * max(1, workers) + worker) takes from which canonical stream, per batch."""
        if self.config.aligned:  # one group a source
            return GroupSchedule(self, *divmod(stream, self.config.workers_per_rank))
        if self.config.chunked and self.config.num_workers > 1:  # packed rows, one phase: chunks of steps
            return RowChunkSchedule(self, *divmod(stream, self.config.workers_per_rank))
        return CanonSchedule(self, *divmod(stream, self.config.workers_per_rank))


class GroupSchedule(Schedule):
    """A process's batches over blocks aligned to the step: one lane per source (its ``GroupPlan``). Worker w of n
    takes chunks w, w + n, ... of Q steps (all of them in-process): its batch j is the j-th step of its chunks;
    with shared batches it takes every step of its share of the rank's slots (``worker_slots``). It keeps the items
    before each of its chunks; a chunk's items a step are made when the chunk begins."""

    def __init__(self, plan: CanonPlan, rank: int, worker: int):
        cfg = plan.config
        self.mine = worker_slots(cfg, rank, worker) if plan.shared else range(*slot_range(cfg, rank))
        self.edges, self.quotas = chunk_edges(cfg, plan.steps), plan.slots
        self.chunks = (list(range(len(self.edges) - 1)) if plan.shared
                       else list(range(worker, len(self.edges) - 1, max(1, cfg.num_workers))))
        self.batches = int(np.diff(self.edges)[self.chunks].sum()) if self.chunks else 0
        self.lanes = [(i, 0) for i in range(len(plan.sources))]
        self.plans = [GroupPlan(sp, self.mine, plan.slots, i, self.edges, self.chunks)
                      for i, sp in enumerate(plan.sources)]
        per_chunk = np.stack([(g.at[:, 1:] - g.at[:, :-1]).sum(axis=0)[self.chunks] for g in self.plans], axis=1)
        self._before = np.zeros((len(self.chunks) + 1, len(self.plans)), dtype=np.int64)  # items before my chunk i
        np.cumsum(per_chunk, axis=0, out=self._before[1:])
        self._made: tuple[int, np.ndarray | None] = (-1, None)

    def _counts(self, i: int) -> np.ndarray:
        """[steps, sources]: items of each source in each step of this process's chunk ``i`` (the last one kept)."""
        if self._made[0] != i:
            self._made = (i, self.quotas.chunk(self.chunks[i])[:, self.mine.start : self.mine.stop].sum(axis=1))
        return self._made[1]

    def parts(self, j: int) -> tuple[list[tuple[int, int]], np.ndarray]:
        i, r = divmod(j, self.quotas.every)  # every chunk has Q steps but the epoch's last
        counts = self._counts(i)[r]
        return [(s, int(n)) for s, n in enumerate(counts.tolist()) if n], counts

    def positions(self, j: int) -> list[int]:
        if j >= self.batches:
            return self._before[-1].tolist()
        i, r = divmod(j, self.quotas.every)
        return (self._before[i] + self._counts(i)[:r].sum(axis=0)).tolist()


class CanonSchedule(Schedule):
    """One process's batches: lane l = (source, canonical stream) of its slots and phases; batch j = global step k.
    The slots' quotas are made a chunk of micro-batches at a time (``SlotQuotas.chunk``), as ``GroupSchedule``'s."""

    def __init__(self, plan: CanonPlan, rank: int, worker: int):
        cfg = plan.config
        slots, phases = cfg.canonical
        per, self.n, self.w = slots // cfg.world_size, cfg.num_workers, worker
        self.phases, self.quotas = phases, plan.slots
        mine = range(worker, phases, cfg.num_workers) if cfg.num_workers and not cfg.chunked else range(phases)
        self.lanes = [(i, a * phases + p) for i in range(len(plan.sources))
                      for a in range(rank * per, (rank + 1) * per) for p in mine]
        self.batches = worker_batches(plan.steps, self.n, worker) if self.n else plan.steps
        # per phase: (lane, source, slot) of its lanes, in batch order
        self._by_phase = {p: [(l, i, c // phases) for l, (i, c) in enumerate(self.lanes) if c % phases == p]
                          for p in mine}
        self.plans = plan.sources  # each source's block plan (its streams' blocks)
        self._sources = len(plan.sources)

    def step(self, j: int) -> int:
        """The global step of this process's batch ``j``."""
        return j * self.n + self.w if self.n else j

    def parts(self, j: int) -> tuple[list[tuple[int, int]], np.ndarray]:
        """((lane, items) of batch ``j`` in batch order, items of each source)."""
        k = self.step(j)
        t = k // self.phases
        row = self.quotas.chunk(t // self.quotas.every)[t % self.quotas.every]  # [slots, sources]
        counts = np.zeros(self._sources, dtype=np.int64)
        out = []
        for lane, i, a in self._by_phase[k % self.phases]:
            need = int(row[a, i])
            if need:
                out.append((lane, need))
                counts[i] += need
        return out, counts

    def positions(self, j: int) -> list[int]:
        """Items each lane has given before this process's batch ``j``."""
        k = self.step(j)
        before = {}  # micro-batch -> [slots, sources] items before it
        out = []
        for i, c in self.lanes:
            t = max(0, -(-(k - c % self.phases) // self.phases))
            if t not in before:
                before[t] = self.quotas.before(t)
            out.append(int(before[t][c // self.phases, i]))
        return out


class RowChunkSchedule(CanonSchedule):
    """Packed rows over canonical streams of one phase, worker w of n taking chunks w, w + n, ... of Q steps: the
    rows of a slot's stream are the in-process order's, cut at the chunks' edges. A lane reads only the blocks its
    chunks' rows lie in (``blocks``; a block two chunks share is read by both workers), its items counted over
    those; at a chunk's first batch it passes over the rows of its first block that an earlier chunk takes
    (``skips``). ``positions(j)`` is where a lane stands before batch j's skip."""

    def __init__(self, plan: CanonPlan, rank: int, worker: int):
        super().__init__(plan, rank, worker)
        q, steps = plan.chunk, plan.steps
        self.q, self.chunks = q, list(range(worker, -(-steps // q), plan.config.num_workers))
        self.batches = plan.worker_taken(steps, plan.config.num_workers, worker)
        edges = np.array([c * q for c in self.chunks] + [min((c + 1) * q, steps) for c in self.chunks])
        at = self.quotas.at(edges)  # [2 x my chunks, slots, sources]: rows before each of my chunks' edges
        self.blocks: list[list[int]] = []  # per lane: the blocks of its stream it reads, in order
        self._start = []  # per lane [my chunks]: rows of the stream before each of my chunks
        self._lo, self._hi = [], []  # per lane [my chunks]: its local item where each of my chunks begins, ends
        for i, c in self.lanes:
            r0, r1 = at[: len(self.chunks), c, i], at[len(self.chunks) :, c, i]
            blocks, lo, hi = _row_blocks(plan.sources[i].item_bounds(c), r0, r1)
            self.blocks.append(blocks)
            self._start.append(r0)
            self._lo.append(lo)
            self._hi.append(hi)

    def step(self, j: int) -> int:
        return self.chunks[j // self.q] * self.q + j % self.q

    def positions(self, j: int) -> list[int]:
        if j >= self.batches:
            return [int(h[-1]) if len(h) else 0 for h in self._hi]
        i, r = divmod(j, self.q)
        if r == 0:  # before the chunk's skip
            return [int(h[i - 1]) if i else 0 for h in self._hi]
        before = self.quotas.before(self.step(j))  # [slots, sources]
        return [int(lo[i] + before[c, s] - start[i]) for (s, c), lo, start in zip(self.lanes, self._lo, self._start)]

    def skips(self, j: int) -> Parts:
        """At a chunk's first batch, the rows between where each lane stands and where the chunk's rows begin (the
        part of a block shared with another worker's chunk)."""
        i, r = divmod(j, self.q)
        if r or j >= self.batches:
            return []
        out = []
        for lane, (lo, hi) in enumerate(zip(self._lo, self._hi)):
            n = int(lo[i] - (hi[i - 1] if i else 0))
            if n:
                out.append((lane, n))
        return out


def _row_blocks(bounds: np.ndarray, r0: np.ndarray, r1: np.ndarray) -> tuple[list[int], np.ndarray, np.ndarray]:
    """For runs of rows [r0[i], r1[i]) of a stream (increasing, disjoint) whose blocks hold the rows ``bounds``
    says: (the blocks they lie in, in order; each run's first and end item counted over those blocks only)."""
    blocks: list[int] = []
    local = 0  # items of the blocks listed so far
    lo, hi = np.zeros(len(r0), dtype=np.int64), np.zeros(len(r0), dtype=np.int64)
    for i, (a, z) in enumerate(zip(r0.tolist(), r1.tolist())):
        if z <= a:  # no rows of this source in the chunk: the lane stands where it was
            lo[i] = hi[i] = hi[i - 1] if i else 0
            continue
        b0 = int(np.searchsorted(bounds, a, side="right")) - 1
        b1 = int(np.searchsorted(bounds, z - 1, side="right")) - 1
        if blocks and blocks[-1] == b0:  # shared with my previous run (one worker)
            first = local - int(bounds[b0 + 1] - bounds[b0])
        else:
            first = local
        for b in range(b0, b1 + 1):
            if not blocks or blocks[-1] < b:
                blocks.append(b)
                local += int(bounds[b + 1] - bounds[b])
        lo[i] = first + a - int(bounds[b0])
        hi[i] = lo[i] + z - a
    return blocks, lo, hi


def slot_range(config: PlanConfig, rank: int) -> tuple[int, int]:
    """The canonical slots [a0, a1) rank ``rank`` serves."""
    per = config.canonical[0] // config.world_size
    return rank * per, (rank + 1) * per


def worker_slots(config: PlanConfig, rank: int, worker: int) -> range:
    """Shared batches: the slots of rank ``rank`` whose rows worker ``worker`` writes (a share within a slot of the
    others', in order)."""
    a0, a1 = slot_range(config, rank)
    per, n = a1 - a0, config.num_workers
    return range(a0 + worker * per // n, a0 + (worker + 1) * per // n)


def shares_batches(config: PlanConfig, sources: int, transformed: bool = False) -> bool:
    """Whether a rank's workers share each of its batches, each writing the rows of its share of the rank's slots
    into one shared slot, instead of taking chunks of Q steps in turn (the loader then takes a chunk's Q batches
    from one worker, and a step that needs several workers waits, even with a chunk of slots a worker: measured
    in docs/performance.md): canonical streams of one phase over windows, one source, no more workers than the rank
    has slots, no slot of no item, and no transform of whole batches (``transformed``: it would see parts). A mix's
    batch is grouped by source, so a worker's rows of each source move with the step: a gather a source and worker,
    measured slower than chunks (docs/performance.md). The batches are the same."""
    if transformed or not config.aligned or config.num_workers < 2 or sources != 1:
        return False
    return config.world_size * config.batch_size >= config.canonical[0] >= config.world_size * config.num_workers


def sharing(plan: Plan, transformed: bool) -> Plan:
    """``plan``, its rank's workers sharing each batch where they can (``shares_batches``)."""
    if not isinstance(plan, CanonPlan) or not shares_batches(plan.config, len(plan.sources), transformed):
        return plan
    return replace(plan, shared=True)


def chunk_steps(config: PlanConfig) -> int:
    """Q, the steps of a block aligned to the step: shuffle_buffer / G (a process's slots hold about one buffer)."""
    return max(1, -(-config.block_windows // (config.world_size * config.batch_size)))


PACKED_BLOCKS = 2  # packed rows: a worker's chunk holds about this many blocks' rows of each slot


def worker_chunk(config: PlanConfig) -> int:
    """Q, the steps of the chunks a rank's workers take in turn with one phase: ``chunk_steps``; with packed rows, the
    steps that take about PACKED_BLOCKS blocks' rows from each slot (crops of the mean drawn length), so that a
    block two workers' chunks share, read by both, is at most about one read in PACKED_BLOCKS + 1."""
    q = chunk_steps(config)
    if config.pack_length is None:
        return q
    spec, p = config.spec, config.spec.window_multiple
    shortest = spec.min_window if spec.variable and spec.min_window is not None else spec.span
    patches = (-(-shortest // p) + -(-spec.span // p)) / 2  # a crop's mean patches, about
    block_rows = config.block_windows * patches / (config.pack_length // p)
    per_slot = config.world_size * config.batch_size / config.canonical[0]  # rows a slot takes a step
    return max(q, int(np.ceil(PACKED_BLOCKS * block_rows / per_slot)))


def chunk_edges(config: PlanConfig, steps: int) -> np.ndarray:
    """[chunks + 1]: the first step of each chunk of Q steps of an epoch of ``steps``, then ``steps``."""
    q = chunk_steps(config)
    return np.unique(np.minimum(np.arange(0, steps + q, q), steps))
