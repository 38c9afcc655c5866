"""Run totals of a loader, kept across its passes: batches, data-wait, reads, device uploads."""
from __future__ import annotations

import operator
import time
from dataclasses import fields
from typing import Any

import numpy as np

from streamwin.read import ReadStats

STAT_FIELDS = tuple(f.name for f in fields(ReadStats))  # read counters, in the order workers publish them
_COUNTERS = operator.attrgetter(*STAT_FIELDS)


def read_counters(stats: list[ReadStats]) -> np.ndarray:
    """Readers' counters, summed, as an int64 array in STAT_FIELDS order (a worker publishes them every batch:
    one C call a reader, cheaper than a Python sum a field)."""
    if len(stats) == 1:
        return np.array(_COUNTERS(stats[0]), dtype=np.int64)
    return np.array([_COUNTERS(s) for s in stats], dtype=np.int64).reshape(len(stats), len(STAT_FIELDS)).sum(axis=0)


class RunStats:
    """What a loader has done since it was made, summed over its passes (``loader.stats()``)."""

    def __init__(self) -> None:
        self.reads = np.zeros(len(STAT_FIELDS), dtype=np.int64)  # of finished passes and closed worker pools
        self.batches = 0  # of finished passes (a live one counts its own: Feed.batches)
        self.wait_s = 0.0  # time the trainer waited in next(): the data-wait
        self.started: float | None = None
        self.device: dict[str, int] = {}  # device mode: blocks and bytes uploaded, peak device bytes
        self.warned_keep = False  # the warning about kept batches is given once per loader

    def start(self) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def add_device(self, blocks: int, uploaded: int, peak: int) -> dict[str, int]:
        """The device totals with one pass's uploads added (not stored)."""
        d = self.device
        return {"device_blocks": d.get("device_blocks", 0) + blocks,
                "device_uploaded_bytes": d.get("device_uploaded_bytes", 0) + uploaded,
                "device_peak_bytes": max(d.get("device_peak_bytes", 0), peak)}

    def report(self, batch_size: int, reads: np.ndarray, device: dict[str, int], live_batches: int = 0
               ) -> dict[str, Any]:
        """The totals as ``loader.stats()`` prints them, with the live pass's reads, device totals and batches."""
        elapsed = time.perf_counter() - self.started if self.started else 0.0
        batches = self.batches + live_batches
        windows = batches * batch_size
        out = {"batches": batches, "windows": windows, "windows_per_s": windows / elapsed if elapsed else 0.0,
               "wait_s": self.wait_s}
        out.update(zip(STAT_FIELDS, reads.tolist()))
        out.update(device)
        return out
