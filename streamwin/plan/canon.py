"""Canonical streams: one order of global batches, whatever the number of ranks and workers.

``canonical=(A, P)`` ("auto", the default, is (8, 1) for 1, 2, 4 or 8 ranks of unpacked windows, one source or a mix):
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
   workers share (feed/pool.py); or they take *chunks* w, w + n, ... of Q steps, each whole.
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

from streamwin.plan.mix import SlotQuotas
from streamwin.plan.options import PlanConfig
from streamwin.plan.streams import Plan, SourcePlan, worker_batches


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
        """Steps a chunk: Q = shuffle_buffer / G with blocks aligned to the step (workers take whole chunks), else 1."""
        return chunk_steps(self.config) if self.config.aligned else 1

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
        return CanonSchedule(self, *divmod(stream, self.config.workers_per_rank))


class GroupPlan:
    """One source's blocks of a process's slots, block j of each read as one block.

    With one phase, stream a's block j holds its micro-batches of steps [jQ, (j + 1)Q) (``SourcePlan.bounds``),
    so the blocks of a process's slots cover the same steps: read as one block whose yield order is, step after
    step, each slot's micro-batch (slot after slot), a batch is one part and one gather, as with one stream.
    ``quotas``: the plan's, of which the process's slots (streams ``lanes``, consecutive) take ``source``'s items;
    kept: the items before each chunk edge (``at``), a chunk's quotas made when it is read.
    """

    def __init__(self, plan: SourcePlan, lanes: range, quotas: SlotQuotas, source: int, edges: np.ndarray,
                 chunks: list[int]):
        self.plan, self.lanes, self.quotas, self.source, self.edges = plan, lanes, quotas, source, edges
        self.at = quotas.at(edges)[:, lanes.start : lanes.stop, source].T.copy()  # [slots, chunks + 1]
        items = (self.at[:, 1:] - self.at[:, :-1]).sum(axis=0)[chunks].astype(np.int64)
        # a block reads several of the process's chunks when its slots' part of one is small (a rank of many):
        # about shuffle_buffer windows a read, as one stream's block, whatever the world (the order is the chunks')
        per = max(1, round(plan.config.block_windows / max(1, int(items.max(initial=1)))))
        self.blocks = [chunks[i : i + per] for i in range(0, len(chunks), per)]
        per_block = [int(items[i : i + per].sum()) for i in range(0, len(chunks), per)]
        self._bounds = np.concatenate([[0], np.cumsum(per_block, dtype=np.int64)]).astype(np.int64)
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
        lo, n = self.at[:, block], self.at[:, block + 1] - self.at[:, block]  # per slot: items before the chunk, in it
        total = int(n.sum())
        lanes = np.arange(self.lanes.start, self.lanes.stop)
        starts = np.cumsum(n) - n  # where each slot's items begin in the block (stream order)
        u = np.arange(total, dtype=np.int64) + np.repeat(lo - starts, n)  # each item's position in its stream
        ranges = np.diff(sp.stream_lo)[lanes]
        if (lo + n <= ranges).all():  # every item real: each slot's items are one run of its block's segment
            g = sp.order.at_runs(sp.stream_lo[lanes] + lo, n)
            real = np.ones(total, dtype=bool)
        else:
            g = sp.order.at((np.repeat(sp.stream_lo[lanes], n) + u) % max(sp.total_windows, 1))
            real = u < np.repeat(ranges, n)
        shuffled = (sp.stripe_shuffle(block, self.lanes.start, self.lanes.stop) if sp.config.shuffle
                    else np.arange(total, dtype=np.int64))  # slot after slot, each slot's items in its order
        took = self.quotas.chunk(block)[:, self.lanes.start : self.lanes.stop, self.source]  # [steps, slots]
        steps = np.repeat(np.tile(np.arange(t1 - t0, dtype=np.int32), len(n)),
                          took.T.reshape(-1))  # the step of each, slot after slot
        yields = shuffled[np.argsort(steps, kind="stable")]  # step after step, slot after slot
        for a in (g, real, yields):
            a.flags.writeable = False
        return g, real, yields


class GroupSchedule:
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


class CanonSchedule:
    """One process's batches: lane l = (source, canonical stream) of its slots and phases; batch j = global step k.
    The slots' quotas are made a chunk of micro-batches at a time (``SlotQuotas.chunk``), as ``GroupSchedule``'s."""

    def __init__(self, plan: CanonPlan, rank: int, worker: int):
        cfg = plan.config
        slots, phases = cfg.canonical
        per, self.n, self.w = slots // cfg.world_size, cfg.num_workers, worker
        self.phases, self.quotas = phases, plan.slots
        mine = range(worker, phases, cfg.num_workers) if cfg.num_workers else range(phases)
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


def chunk_edges(config: PlanConfig, steps: int) -> np.ndarray:
    """[chunks + 1]: the first step of each chunk of Q steps of an epoch of ``steps``, then ``steps``."""
    q = chunk_steps(config)
    return np.unique(np.minimum(np.arange(0, steps + q, q), steps))
