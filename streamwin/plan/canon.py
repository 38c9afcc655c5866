"""Canonical streams: one order of global batches, whatever the number of ranks and workers.

A worked example. ``canonical=(4, 2)``: 4 *rank slots* x 2 *step phases* = 8 canonical streams;
``batch_size=3`` on each of 2 ranks, so a global batch holds 6 items (windows, or packed rows).
One source of 48 windows, shown unshuffled.

1. **Slots.** Slot a's micro-batch holds 6(a+1)//4 - 6a//4 items: [1, 2, 1, 2] (``slot_sizes``:
   they sum to the global batch; all equal when the slots divide it).
2. **Streams.** Stream c = slot x 2 + phase takes range c of the epoch's order, the ranges in
   proportion to their slots' sizes, so that every stream runs out at the same step:

       stream:          0     1     2      3       4      5      6      7
       (slot, phase):  0,0   0,1   1,0    1,1     2,0    2,1    3,0    3,1
       its windows:    0-3   4-7   8-15   16-23   24-27  28-31  32-39  40-47

   Shuffled, a stream permutes its range in blocks of ``shuffle_buffer`` keyed (seed, epoch,
   stream, block), as any stream does (streams.SourcePlan).
3. **Global batches.** Step k takes, slot after slot, micro-batch k // 2 of the stream of phase
   k mod 2 of each slot:

       step  micro  phase | slot 0  slot 1  | slot 2  slot 3
        0      0      0   |   0     8 9     |  24     32 33
        1      0      1   |   4     16 17   |  28     40 41
        2      1      0   |   1     10 11   |  25     34 35
        3      1      1   |   5     18 19   |  29     42 43
                          |     rank 0      |     rank 1

4. **Who serves what.** Rank r of 2 serves slots [2r, 2r + 2): its batch k is its slots' micro-
   batches, 3 items. The loader takes a rank's batches from its workers round robin, so worker w
   of 2 makes the steps of phase w: rank 0's worker 0 reads streams 0 and 2, its worker 1 streams
   1 and 3. One rank of batch 6 (all 4 slots), 0, 1 or 2 workers, or these 2 ranks with 0, 1 or 2
   workers: the same global batches. The world must divide the slots (whole slots a rank) and the
   workers the phases (whole phases a worker; 0: every phase in-process).
5. **Steps.** Each stream here gives 4 micro-batches of its slot's size, so the epoch has
   min over phases p of (2 x 4 + p) = 8 steps, every window once. With "drop" a phase gives the
   micro-batches its shortest stream holds; with "pad" the most, the others repeating (weight 0).
   Before step k stream (slot, phase p) has given ceil((k - p) / 2) micro-batches: a job's
   position is its step, in any world (``CanonPlan.micro``).

**A mix.** Each source has its own ranges; a global batch of G items holds floor(w_i G) or
ceil(w_i G) of source i (of weight w_i), spread over the slots so evenly that every rank's batch
holds its share within an item or two (mix.slot_quotas); a rank's batch is grouped by source, slot
after slot. The ranges are dealt again in proportion to what each stream takes (canon_deal.py).

**One phase** ("auto" is (8, 1) for 1, 2, 4 or 8 ranks). A stream's blocks hold its micro-batches of
Q = shuffle_buffer / G steps (G: the global batch; ``chunk_steps``), laid chunk after chunk
(order.StripedOrder), each chunk permuted once, keyed (seed, epoch, chunk); a process reads its
slots' blocks of a chunk as one block (``GroupSchedule`` over group.GroupPlan). Any worker count
serves: the rank's n workers *share batches* (``shares_batches``: one source, n at most the rank's
slots, G at least the slots, no transform of whole batches), worker w writing the rows of its share
of the rank's slots (``worker_slots``, ``CanonPlan.rows``) into one slot the rank's workers share
(feed/pool.py); or they take *chunks* w, w + n, ... of Q steps, each whole. Packed rows keep a
stream's blocks (a block's rows are known only once packed): worker w takes chunks of about 2
blocks' rows a slot (``worker_chunk``) and reads only the blocks its chunks' rows lie in
(``RowChunkSchedule``).
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


def slot_sizes(global_batch: int, slots: int) -> np.ndarray:
    """[slots]: the items of each slot's micro-batch, global_batch (a + 1) // slots - global_batch a // slots for
    slot a (they sum to ``global_batch``)."""
    return np.diff(np.arange(slots + 1, dtype=np.int64) * global_batch // slots)


@dataclass(frozen=True, eq=False)
class CanonPlan(Plan):
    """An epoch's plan over canonical streams: every source dealt over the streams, the slots' quotas, the steps."""

    slots: SlotQuotas | None = None  # items of each source in each slot's micro-batch t, made a chunk at a time
    steps: int = 0  # global batches of the epoch (every rank's batches)

    @property
    def batches_per_rank(self) -> int:
        return self.steps

    @property
    def batches_per_stream(self) -> int:
        """Micro-batches the streams of phase 0 give (the most any stream gives)."""
        return self.micro(0, self.steps)

    def micro(self, stream: int, step: int) -> int:
        """Micro-batches canonical stream ``stream`` has given before global step ``step``."""
        phases = self.config.canonical[1]
        return max(0, -(-(step - stream % phases) // phases))

    def taken(self, stream: int, batches_per_rank: int) -> int:
        return self.micro(stream, min(batches_per_rank, self.steps))

    def used(self, batches_per_rank: int) -> np.ndarray:
        """[sources, streams]: items of each source each canonical stream has given after ``batches_per_rank`` steps."""
        slot_of = np.arange(self.config.num_streams) // self.config.canonical[1]
        out = np.zeros((len(self.sources), self.config.num_streams), dtype=np.int64)
        for stream in range(self.config.num_streams):
            out[:, stream] = self.slots.before(self.taken(stream, batches_per_rank))[slot_of[stream]]
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
        chunk = self.chunk
        if chunk == 1:
            return worker_batches(batches_per_rank, workers, worker)
        starts = np.arange(worker * chunk, min(batches_per_rank, self.steps), workers * chunk)
        return int(np.minimum(batches_per_rank - starts, chunk).sum()) if len(starts) else 0

    def rows(self, stream: int) -> tuple[int, int] | None:
        """Shared batches: the rows of the rank's batch worker ``stream`` writes (its slots' micro-batches, one source:
        slot after slot), else None."""
        if not self.shared:
            return None
        cfg = self.config
        rank, worker = divmod(stream, cfg.workers_per_rank)
        mine = worker_slots(cfg, rank, worker)
        sizes = slot_sizes(cfg.world_size * cfg.batch_size, cfg.canonical[0])
        first = int(sizes[slot_range(cfg, rank)[0] : mine.start].sum())
        return first, first + int(sizes[mine.start : mine.stop].sum())

    def schedule(self, stream: int) -> Schedule:
        """What process ``stream`` (rank * max(1, workers) + worker) takes from which canonical stream, per batch."""
        rank, worker = divmod(stream, self.config.workers_per_rank)
        if self.config.aligned:  # one group a source
            return GroupSchedule(self, rank, worker)
        if self.config.chunked and self.config.num_workers > 1:  # packed rows, one phase: chunks of steps
            return RowChunkSchedule(self, rank, worker)
        return CanonSchedule(self, rank, worker)


class GroupSchedule(Schedule):
    """A process's batches over blocks aligned to the step: one lane per source (its ``GroupPlan``). Worker w of n
    takes chunks w, w + n, ... of Q steps (all of them in-process): its batch j is the j-th step of its chunks;
    with shared batches it takes every step of its share of the rank's slots (``worker_slots``). It keeps the items
    before each of its chunks; a chunk's items a step are made when the chunk begins."""

    def __init__(self, plan: CanonPlan, rank: int, worker: int):
        cfg = plan.config
        self.my_slots = worker_slots(cfg, rank, worker) if plan.shared else range(*slot_range(cfg, rank))
        self.edges, self.quotas = chunk_edges(cfg, plan.steps), plan.slots
        self.chunks = (list(range(len(self.edges) - 1)) if plan.shared
                       else list(range(worker, len(self.edges) - 1, max(1, cfg.num_workers))))
        self.batches = int(np.diff(self.edges)[self.chunks].sum()) if self.chunks else 0
        self.lanes = [(i, 0) for i in range(len(plan.sources))]
        self.plans = [GroupPlan(sp, self.my_slots, plan.slots, i, self.edges, self.chunks)
                      for i, sp in enumerate(plan.sources)]
        per_chunk = np.stack([(g.at[:, 1:] - g.at[:, :-1]).sum(axis=0)[self.chunks] for g in self.plans], axis=1)
        self._before = np.zeros((len(self.chunks) + 1, len(self.plans)), dtype=np.int64)  # items before my chunk i
        np.cumsum(per_chunk, axis=0, out=self._before[1:])
        self._made: tuple[int, np.ndarray | None] = (-1, None)

    def _counts(self, i: int) -> np.ndarray:
        """[steps, sources]: items of each source in each step of this process's chunk ``i`` (the last one kept)."""
        if self._made[0] != i:
            slots = self.my_slots
            self._made = (i, self.quotas.chunk(self.chunks[i])[:, slots.start : slots.stop].sum(axis=1))
        return self._made[1]

    def parts(self, j: int) -> tuple[Parts, np.ndarray]:
        chunk, step = divmod(j, self.quotas.every)  # every chunk has Q steps but the epoch's last
        counts = self._counts(chunk)[step]
        return [(s, int(n)) for s, n in enumerate(counts.tolist()) if n], counts

    def positions(self, j: int) -> list[int]:
        if j >= self.batches:
            return self._before[-1].tolist()
        chunk, step = divmod(j, self.quotas.every)
        return (self._before[chunk] + self._counts(chunk)[:step].sum(axis=0)).tolist()


class CanonSchedule(Schedule):
    """One process's batches: lane l = (source, canonical stream) of its slots and phases; batch j = global step k.
    The slots' quotas are made a chunk of micro-batches at a time (``SlotQuotas.chunk``), as ``GroupSchedule``'s."""

    def __init__(self, plan: CanonPlan, rank: int, worker: int):
        cfg = plan.config
        slots, self.phases = cfg.canonical
        slots_per_rank, self.workers, self.worker = slots // cfg.world_size, cfg.num_workers, worker
        self.quotas = plan.slots
        phases = self.phases
        mine = range(worker, phases, cfg.num_workers) if cfg.num_workers and not cfg.chunked else range(phases)
        self.lanes = [(i, slot * phases + phase) for i in range(len(plan.sources))
                      for slot in range(rank * slots_per_rank, (rank + 1) * slots_per_rank) for phase in mine]
        self.batches = worker_batches(plan.steps, self.workers, worker) if self.workers else plan.steps
        # per phase: (lane, source, slot) of its lanes, in batch order
        self._by_phase = {phase: [(lane, i, c // phases) for lane, (i, c) in enumerate(self.lanes)
                                  if c % phases == phase] for phase in mine}
        self.plans = plan.sources  # each source's block plan (its streams' blocks)
        self._source_count = len(plan.sources)

    def step(self, j: int) -> int:
        """The global step of this process's batch ``j``."""
        return j * self.workers + self.worker if self.workers else j

    def parts(self, j: int) -> tuple[Parts, np.ndarray]:
        step = self.step(j)
        micro = step // self.phases
        row = self.quotas.chunk(micro // self.quotas.every)[micro % self.quotas.every]  # [slots, sources]
        counts = np.zeros(self._source_count, dtype=np.int64)
        out = []
        for lane, i, slot in self._by_phase[step % self.phases]:
            need = int(row[slot, i])
            if need:
                out.append((lane, need))
                counts[i] += need
        return out, counts

    def positions(self, j: int) -> list[int]:
        step, phases = self.step(j), self.phases
        before = {}  # micro-batch -> [slots, sources] items before it
        out = []
        for i, c in self.lanes:
            micro = max(0, -(-(step - c % phases) // phases))
            if micro not in before:
                before[micro] = self.quotas.before(micro)
            out.append(int(before[micro][c // phases, i]))
        return out


class RowChunkSchedule(CanonSchedule):
    """Packed rows over canonical streams of one phase, worker w of n taking chunks w, w + n, ... of Q steps: the
    rows of a slot's stream are the in-process order's, cut at the chunks' edges. A lane reads only the blocks its
    chunks' rows lie in (``blocks``; a block two chunks share is read by both workers), its items counted over
    those; at a chunk's first batch it passes over the rows of its first block that an earlier chunk takes
    (``skips``). ``positions(j)`` is where a lane stands before batch j's skip."""

    def __init__(self, plan: CanonPlan, rank: int, worker: int):
        super().__init__(plan, rank, worker)
        chunk, steps = plan.chunk, plan.steps
        self.chunk_steps, self.chunks = chunk, list(range(worker, -(-steps // chunk), plan.config.num_workers))
        self.batches = plan.worker_taken(steps, plan.config.num_workers, worker)
        edges = np.array([c * chunk for c in self.chunks] + [min((c + 1) * chunk, steps) for c in self.chunks])
        at = self.quotas.at(edges)  # [2 x my chunks, slots, sources]: rows before each of my chunks' edges
        self.blocks: list[list[int]] = []  # per lane: the blocks of its stream it reads, in order
        self._rows_before = []  # per lane [my chunks]: rows of the stream before each of my chunks
        self._first, self._end = [], []  # per lane [my chunks]: its local item where each of my chunks begins, ends
        for i, c in self.lanes:
            starts, ends = at[: len(self.chunks), c, i], at[len(self.chunks) :, c, i]
            blocks, first, end = _row_blocks(plan.sources[i].item_bounds(c), starts, ends)
            self.blocks.append(blocks)
            self._rows_before.append(starts)
            self._first.append(first)
            self._end.append(end)

    def step(self, j: int) -> int:
        chunk, step = divmod(j, self.chunk_steps)
        return self.chunks[chunk] * self.chunk_steps + step

    def positions(self, j: int) -> list[int]:
        if j >= self.batches:
            return [int(end[-1]) if len(end) else 0 for end in self._end]
        chunk, step = divmod(j, self.chunk_steps)
        if step == 0:  # before the chunk's skip
            return [int(end[chunk - 1]) if chunk else 0 for end in self._end]
        before = self.quotas.before(self.step(j))  # [slots, sources]
        return [int(first[chunk] + before[c, s] - rows_before[chunk])
                for (s, c), first, rows_before in zip(self.lanes, self._first, self._rows_before)]

    def skips(self, j: int) -> Parts:
        """At a chunk's first batch, the rows between where each lane stands and where the chunk's rows begin (the
        part of a block shared with another worker's chunk)."""
        chunk, step = divmod(j, self.chunk_steps)
        if step or j >= self.batches:
            return []
        out = []
        for lane, (first, end) in enumerate(zip(self._first, self._end)):
            n = int(first[chunk] - (end[chunk - 1] if chunk else 0))
            if n:
                out.append((lane, n))
        return out


def _row_blocks(bounds: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[list[int], np.ndarray, np.ndarray]:
    """For runs of rows [starts[i], ends[i]) of a stream (increasing, disjoint) whose blocks hold the rows ``bounds``
    says: (the blocks they lie in, in order; each run's first and end item counted over those blocks only)."""
    blocks: list[int] = []
    local = 0  # items of the blocks listed so far
    first, end = np.zeros(len(starts), dtype=np.int64), np.zeros(len(starts), dtype=np.int64)
    for i, (lo, hi) in enumerate(zip(starts.tolist(), ends.tolist())):
        if hi <= lo:  # no rows of this source in the chunk: the lane stands where it was
            first[i] = end[i] = end[i - 1] if i else 0
            continue
        b0 = int(np.searchsorted(bounds, lo, side="right")) - 1
        b1 = int(np.searchsorted(bounds, hi - 1, side="right")) - 1
        if blocks and blocks[-1] == b0:  # shared with my previous run (one worker)
            at = local - int(bounds[b0 + 1] - bounds[b0])
        else:
            at = local
        for b in range(b0, b1 + 1):
            if not blocks or blocks[-1] < b:
                blocks.append(b)
                local += int(bounds[b + 1] - bounds[b])
        first[i] = at + lo - int(bounds[b0])
        end[i] = first[i] + hi - lo
    return blocks, first, end


def slot_range(config: PlanConfig, rank: int) -> tuple[int, int]:
    """The canonical slots [first, end) rank ``rank`` serves."""
    slots_per_rank = config.canonical[0] // config.world_size
    return rank * slots_per_rank, (rank + 1) * slots_per_rank


def worker_slots(config: PlanConfig, rank: int, worker: int) -> range:
    """Shared batches: the slots of rank ``rank`` whose rows worker ``worker`` writes (a share within a slot of the
    others', in order)."""
    first, end = slot_range(config, rank)
    slots, workers = end - first, config.num_workers
    return range(first + worker * slots // workers, first + (worker + 1) * slots // workers)


def shares_batches(config: PlanConfig, sources: int, transformed: bool = False) -> bool:
    """Whether a rank's workers share each of its batches, each writing the rows of its share of the rank's slots
    into one shared slot, instead of taking chunks of Q steps in turn (the loader then takes a chunk's Q batches
    from one worker, and a step that needs several workers waits, even with a chunk of slots a worker):
    canonical streams of one phase over windows, one source, no more workers than the rank has slots, no slot of
    no item, and no transform of whole batches (``transformed``: it would see parts). A mix's batch is grouped by
    source, so a worker's rows of each source move with the step: a gather a source and worker, slower than
    chunks. The batches are the same."""
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
    steps = chunk_steps(config)
    if config.pack_length is None:
        return steps
    spec, multiple = config.spec, config.spec.window_multiple
    shortest = spec.min_window if spec.variable and spec.min_window is not None else spec.span
    patches = (-(-shortest // multiple) + -(-spec.span // multiple)) / 2  # a crop's mean patches, about
    block_rows = config.block_windows * patches / (config.pack_length // multiple)
    per_slot = config.world_size * config.batch_size / config.canonical[0]  # rows a slot takes a step
    return max(steps, int(np.ceil(PACKED_BLOCKS * block_rows / per_slot)))


def chunk_edges(config: PlanConfig, steps: int) -> np.ndarray:
    """[chunks + 1]: the first step of each chunk of Q steps of an epoch of ``steps``, then ``steps``."""
    every = chunk_steps(config)
    return np.unique(np.minimum(np.arange(0, steps + every, every), steps))
