"""One source's blocks of a process's canonical slots, aligned to the step, read as one block a chunk (plan/canon.py).

With one phase over windows, stream a's block j holds its micro-batches of steps [jQ, (j + 1)Q),
laid out chunk by chunk (order.StripedOrder): a process reads its slots' stripes of a chunk as
one block, whose yield order is step after step, slot after slot.
"""
from __future__ import annotations

import numpy as np

from streamwin.plan.mix import SlotQuotas
from streamwin.plan.streams import SourcePlan


class GroupPlan:
    """One source's blocks of a process's slots, block j of each read as one block.

    With one phase, stream a's block j holds its micro-batches of steps [jQ, (j + 1)Q) (``SourcePlan.bounds``),
    so the blocks of a process's slots cover the same steps: read as one block whose yield order is, step after
    step, each slot's micro-batch (slot after slot), a batch is one part and one gather, as with one stream.
    ``quotas``: the plan's, of which the process's slots (streams ``lanes``, consecutive) take ``source``'s items;
    kept: the items before each chunk edge (``at``: the source plan's ``bounds``, made when it was dealt), a chunk's
    quotas made when it is read.
    """

    def __init__(self, plan: SourcePlan, lanes: range, quotas: SlotQuotas, source: int, edges: np.ndarray,
                 chunks: list[int]):
        self.plan, self.lanes, self.quotas, self.source, self.edges = plan, lanes, quotas, source, edges
        self.at = np.stack([plan.bounds[a] for a in lanes]) if len(lanes) else np.zeros((0, len(edges)), np.int64)
        items = (self.at[:, 1:] - self.at[:, :-1]).sum(axis=0)[chunks].astype(np.int64)
        # a block reads several of the process's chunks when its slots' part of one is small (a rank of many):
        # about shuffle_buffer windows a read, as one stream's block, whatever the world (the order is the chunks')
        chunks_a_block = max(1, round(plan.config.block_windows / max(1, int(items.max(initial=1)))))
        firsts = range(0, len(chunks), chunks_a_block)
        self.blocks = [chunks[i : i + chunks_a_block] for i in firsts]
        per_block = [int(items[i : i + chunks_a_block].sum()) for i in firsts]
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
