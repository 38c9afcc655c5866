"""WindowLoader: a torchdata StatefulDataLoader over a WindowDataset.

Batches are made inside the workers, so the loader passes them through (batch_size=None).
It keeps the dataset's worker count and epoch in sync with the plan, resolves the rank
when iteration starts, and checks a checkpoint's plan inputs when it is loaded.
"""
from __future__ import annotations

import logging
import time
import warnings
from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

from .dataset import WindowDataset, check_state

log = logging.getLogger("streamwin")
_META = "streamwin"


def _stream_states(obj: Any):
    """Every stream state inside a StatefulDataLoader state (in-process or per worker)."""
    if isinstance(obj, dict):
        if "stream" in obj and "inputs" in obj and "batch" in obj:
            yield obj
            return
        for v in obj.values():
            yield from _stream_states(v)


class _Counted:
    """Wraps the DataLoader iterator to count batches for stats() (one attribute bump per batch)."""

    def __init__(self, it, loader: "WindowLoader"):
        self._it, self._loader = it, loader

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._it)
        self._loader._yielded += 1
        return batch

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str):
        return getattr(self._it, name)


def passthrough(batch: dict) -> dict:
    """The loader's collate_fn: batches arrive ready-made (default_convert would walk every key)."""
    return batch


class WindowLoader(StatefulDataLoader):
    """A StatefulDataLoader yielding the batches of ``dataset``; ``len()`` is equal on every rank.

    ``num_workers=0`` (the default) runs the pipeline in the trainer's process with a
    background prefetch thread: on few cores that is the fastest mode, since handing
    batches between processes costs more than making them.
    """

    def __init__(self, dataset: WindowDataset, *, num_workers: int = 0, pin_memory: bool = False,
                 prefetch_factor: int | None = None, persistent_workers: bool = False, **kwargs: Any):
        if not isinstance(dataset, WindowDataset):
            raise TypeError(f"WindowLoader needs a streamwin.WindowDataset, got {type(dataset).__name__}")
        if kwargs.get("batch_size") is not None:
            raise ValueError("set batch_size on the WindowDataset: batches are formed inside the workers")
        kwargs.pop("batch_size", None)
        kwargs.setdefault("collate_fn", passthrough)
        dataset.num_workers = num_workers
        with warnings.catch_warnings():  # torchdata 0.11 calls a torch API that torch 2.13 deprecates
            warnings.filterwarnings("ignore", message=".*set_vital.*", category=UserWarning)
            self._init_loader(dataset, num_workers, pin_memory, prefetch_factor, persistent_workers, kwargs)
        self._logged = False
        self._started: float | None = None
        self._yielded = 0

    def _init_loader(self, dataset, num_workers, pin_memory, prefetch_factor, persistent_workers, kwargs) -> None:
        super().__init__(dataset, batch_size=None, num_workers=num_workers, pin_memory=pin_memory,
                         prefetch_factor=prefetch_factor if num_workers > 0 else None,
                         persistent_workers=persistent_workers and num_workers > 0, **kwargs)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch (the same on every rank) before iterating; a new epoch, a new order."""
        self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self):
        world = self.dataset.world(refresh=True)  # resolved here, in the trainer, before workers start
        if not self._logged:
            self._logged = True
            summary = self.dataset.summary()
            if world[0] == 0:
                log.info("%s", summary)
            if summary["batches_per_rank"] == 0:
                warnings.warn(
                    f"streamwin: this loader yields 0 batches per rank: {summary['windows_per_epoch']} windows for "
                    f"{summary['streams']} streams of batch_size {self.dataset.batch_size} (window "
                    f"{self.dataset.spec.window} + horizon {self.dataset.spec.horizon} vs. your sequence lengths). "
                    "Use a smaller window or batch, fewer workers, or equalize='pad'.", RuntimeWarning, stacklevel=2)
        if self._started is None:
            self._started = time.perf_counter()
        return _Counted(super().__iter__(), self)

    def stats(self) -> dict[str, Any]:
        """What this rank's loader did: batches, windows/s, bytes read, retries, cache hits, skips."""
        totals: dict[str, int] = {}
        states = self.state_dict() if self._iterator is not None else {}  # never start workers just for stats
        for stream_state in _stream_states(states):
            for k, v in stream_state.get("stats", {}).items():
                totals[k] = totals.get(k, 0) + v
        elapsed = time.perf_counter() - self._started if self._started else 0.0
        windows = self._yielded * self.dataset.batch_size
        return {"batches": self._yielded, "windows": windows,
                "windows_per_s": windows / elapsed if elapsed else 0.0, **totals}

    def state_dict(self) -> dict[str, Any]:
        self.dataset.world()
        state = super().state_dict()
        state[_META] = {"version": 1, "epoch": self.dataset.epoch, "inputs": self.dataset.plan_inputs()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a position; a following ``set_epoch`` with the same epoch keeps it."""
        state = dict(state_dict)
        meta = state.pop(_META, None)
        if meta is not None:
            check_state({"version": 1, "inputs": meta["inputs"]}, self.dataset.plan_inputs())
            self.dataset.set_epoch(meta["epoch"])
        # A state taken after the last batch says "finished", and torchdata would then start the next
        # iteration from scratch, replaying that epoch. Our stream states already say where each
        # stream is (at its end): the same epoch yields nothing more, another epoch starts afresh.
        if state.get("_iterator_finished"):
            state["_iterator_finished"] = False
        super().load_state_dict(state)
