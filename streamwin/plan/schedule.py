"""The one contract every plan's schedule keeps: what a process takes from which block reader, batch by batch.

A process (a rank, or one of its workers) reads *lanes*: a lane is one source's stream (a
stream of the plan, or a canonical stream, or a process's slots read as one), and one
BlockReader reads its blocks. Its schedule says, for the process's batch j, how many items
(windows, or packed rows) each lane gives (``parts``), where every lane stands before batch j
(``positions``: a resume seeks there), and what a lane passes over first (``skips``: rows of a
block another worker's chunk takes). nodes.Batcher and pipeline.open_stream know a schedule only
through this; each plan makes its own (``Plan.schedule``: streams.QuotaSchedule; canonical
streams: canon.CanonSchedule, canon.RowChunkSchedule, canon.GroupSchedule).
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np

Parts = list[tuple[int, int]]  # (lane, items) in batch order


class Schedule(Protocol):
    """A process's batches over its lanes (every schedule class subclasses it)."""

    lanes: list[tuple[int, int]]  # per lane: (source, stream of that source's block plan), in reader order
    plans: Sequence[Any]  # per source: the block plan its lanes read (streams.SourcePlan, or group.GroupPlan)
    batches: int  # batches the process makes in the epoch
    blocks: list[list[int]] | None = None  # per lane: the blocks of its stream it reads, in order; None: every one

    def parts(self, j: int) -> tuple[Parts, np.ndarray]:
        """((lane, items) of batch ``j`` in batch order, items of each source)."""
        ...

    def positions(self, j: int) -> list[int]:
        """Items each lane has given before batch ``j`` (before its skips); ``j`` up to ``batches``."""
        ...

    def skips(self, j: int) -> Parts:
        """(lane, items) each lane passes over before batch ``j``'s parts: none, unless a schedule says so."""
        return []
