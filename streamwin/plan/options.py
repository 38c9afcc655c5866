"""What the plan depends on besides the data: the window spec, the shuffle, and the whole config.

Frozen dataclasses that validate in ``__post_init__`` and name the argument as the user typed
it in ``WindowDataset(...)``; a valid object never needs checking again downstream.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streamwin.arguments import check_bool, check_int

EQUALIZE = ("drop", "pad")


@dataclass(frozen=True)
class WindowSpec:
    """How windows are cut from a sequence of length T.

    Windows start at 0, stride, 2*stride, ... while start + window + horizon <= T. With
    ``pad`` a sequence shorter than window + horizon (but not empty) gives one window at 0,
    padded with zeros and masked.
    """

    window: int
    stride: int
    horizon: int = 0
    pad: bool = False

    def __post_init__(self) -> None:
        for name, low in (("window", 1), ("stride", 1), ("horizon", 0)):
            check_int(name, getattr(self, name), low)
        check_bool("pad", self.pad)

    @property
    def span(self) -> int:
        """Steps one window reads: the window and its horizon."""
        return self.window + self.horizon

    def counts(self, lengths: np.ndarray) -> np.ndarray:
        """Windows per sequence (int64), vectorized."""
        # float64 division is exact here (lengths < 2**52) and several times faster than int64 //
        room = np.asarray(lengths, dtype=np.float64) - self.span
        n = np.floor_divide(room, self.stride, out=room)
        n += 1
        np.maximum(n, 1.0 if self.pad else 0.0, out=n)
        n = n.astype(np.int64)
        if self.pad:
            n[np.asarray(lengths) <= 0] = 0
        return n


@dataclass(frozen=True)
class ShuffleSpec:
    """How an epoch's windows are shuffled: slices permuted per epoch, windows within blocks of ``shuffle_buffer``.

    ``slice_windows`` None means the default the dataset derives from its manifests.
    """

    shuffle: bool = True
    shuffle_buffer: int = 10_000
    seed: int = 0
    slice_windows: int | None = None

    def __post_init__(self) -> None:
        check_bool("shuffle", self.shuffle)
        check_int("shuffle_buffer", self.shuffle_buffer, 1)
        check_int("seed", self.seed, 0)
        if self.slice_windows is not None:
            check_int("slice_windows", self.slice_windows, 1)


@dataclass(frozen=True)
class PlanConfig:
    """Everything besides the data that the plan depends on; part of the checkpoint fingerprint."""

    spec: WindowSpec
    batch_size: int
    world_size: int = 1
    num_workers: int = 0
    seed: int = 0
    shuffle: bool = True
    block_windows: int = 10_000
    slice_windows: int = 1_250
    equalize: str = "drop"

    def __post_init__(self) -> None:
        for name, low in (("batch_size", 1), ("world_size", 1), ("num_workers", 0), ("seed", 0),
                          ("block_windows", 1), ("slice_windows", 1)):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.equalize not in EQUALIZE:
            raise ValueError(f"equalize must be 'drop' or 'pad', got {self.equalize!r}")

    @property
    def workers_per_rank(self) -> int:
        """Streams each rank runs: one per worker, one in-process without workers."""
        return max(1, self.num_workers)

    @property
    def num_streams(self) -> int:
        return self.world_size * self.workers_per_rank
