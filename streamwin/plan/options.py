"""What the plan depends on besides the data: the window spec, the shuffle, and the whole config.

Frozen dataclasses that validate in ``__post_init__`` and name the argument as the user typed
it in ``WindowDataset(...)``; a valid object never needs checking again downstream.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from streamwin.arguments import MAX_STEPS, MAX_WINDOWS, check_bool, check_int, check_keywords

EQUALIZE = ("drop", "pad")


@check_keywords()
@dataclass(frozen=True)
class WindowSpec:
    """How windows (crops) are cut from a sequence of length T.

    Windows start at 0, stride, 2*stride, ... while start + window + horizon <= T. With
    ``pad`` a sequence shorter than window + horizon (but not empty) gives one window at 0,
    padded with zeros and masked. The pretraining options change where a window starts and
    how long it is (see plan/crops.py), and only ``windows_per_sequence`` how many a sequence has:

    - ``jitter``: each start moves by a random offset in [0, stride), staying in the sequence;
    - ``min_window`` / ``window_multiple``: each crop's length is a multiple of
      ``window_multiple`` drawn in [min_window, window] (the window is read, the rest masked);
    - ``windows_per_sequence``: k crops per sequence at stratified random starts (fewer when
      it has fewer than k distinct starts) instead of the stride grid.
    """

    window: int
    stride: int
    horizon: int = 0
    pad: bool = False
    jitter: bool = False
    min_window: int | None = None
    window_multiple: int = 1
    windows_per_sequence: int | None = None

    def __post_init__(self) -> None:
        for name, low in (("window", 1), ("stride", 1), ("horizon", 0), ("window_multiple", 1)):
            check_int(name, getattr(self, name), low, MAX_STEPS)
        check_bool("pad", self.pad)
        check_bool("jitter", self.jitter)
        if self.window % self.window_multiple:
            raise ValueError(f"window must be a multiple of window_multiple ({self.window_multiple}), "
                             f"got window={self.window}")
        if self.min_window is not None:
            check_int("min_window", self.min_window, 1, MAX_STEPS)
            if self.min_window > self.window:
                raise ValueError(f"min_window must be <= window ({self.window}), got {self.min_window}")
        if self.windows_per_sequence is not None:
            check_int("windows_per_sequence", self.windows_per_sequence, 1, MAX_STEPS)
        _plain(self, ("window", "stride", "horizon", "window_multiple", "min_window", "windows_per_sequence"),
               ("pad", "jitter"))

    @property
    def span(self) -> int:
        """Steps one window reads: the window and its horizon."""
        return self.window + self.horizon

    @property
    def variable(self) -> bool:
        """Whether crop lengths vary (``min_window`` set): batches then carry ``length`` and ``mask``."""
        return self.min_window is not None

    @property
    def shortest(self) -> int:
        """The shortest length a crop draws: the least multiple of window_multiple >= min_window (or window)."""
        if self.min_window is None:
            return self.window
        p = self.window_multiple
        return -(-self.min_window // p) * p

    @property
    def cropped(self) -> bool:
        """Whether starts or lengths are drawn (any pretraining option), not the plain stride grid."""
        return self.jitter or self.variable or self.windows_per_sequence is not None

    def counts(self, lengths: np.ndarray) -> np.ndarray:
        """Windows per sequence (int64), vectorized."""
        # float64 division is exact here (lengths < 2**52) and several times faster than int64 //
        room = np.asarray(lengths, dtype=np.float64) - self.span
        if self.windows_per_sequence is not None:  # k crops, or one per distinct start when fewer
            n = np.minimum(room + 1, float(self.windows_per_sequence))
        else:
            n = np.floor_divide(room, self.stride, out=room)
            n += 1
        np.maximum(n, 1.0 if self.pad else 0.0, out=n)
        n = n.astype(np.int64)
        if self.pad:
            n[np.asarray(lengths) <= 0] = 0
        return n

    def plain(self) -> dict[str, Any]:
        """The spec as plan inputs: the window fields, and the pretraining ones only where set (so a checkpoint
        that does not name them still matches)."""
        out = {"window": self.window, "stride": self.stride, "horizon": self.horizon, "pad": self.pad}
        extra = {"jitter": self.jitter or None, "min_window": self.min_window,
                 "window_multiple": self.window_multiple if self.window_multiple != 1 else None,
                 "windows_per_sequence": self.windows_per_sequence}
        return out | {k: v for k, v in extra.items() if v is not None}


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
        check_int("shuffle_buffer", self.shuffle_buffer, 1, MAX_WINDOWS)
        check_int("seed", self.seed, 0)
        if self.slice_windows is not None:
            check_int("slice_windows", self.slice_windows, 1, MAX_WINDOWS)
        _plain(self, ("shuffle_buffer", "seed", "slice_windows"), ("shuffle",))


def _plain(spec: Any, ints: tuple[str, ...], flags: tuple[str, ...]) -> None:
    """Hold numpy integers and bools (accepted as arguments) as Python ones: a checkpoint's plan inputs are
    plain JSON, and a numpy value there made the state unloadable."""
    for name in ints:
        if getattr(spec, name) is not None:
            object.__setattr__(spec, name, int(getattr(spec, name)))
    for name in flags:
        object.__setattr__(spec, name, bool(getattr(spec, name)))


def check_packing(spec: WindowSpec, pack_length: Any, equalize: str) -> None:
    """Refuse a ``pack_length`` that cannot hold whole crops in rows, naming the argument as typed."""
    if pack_length is None:
        return
    check_int("pack_length", pack_length, 1, MAX_STEPS)
    if pack_length < spec.window:
        raise ValueError(f"pack_length must be >= window ({spec.window}): a row holds whole crops, "
                         f"got pack_length={pack_length}")
    if pack_length % spec.window_multiple:
        raise ValueError(f"pack_length must be a multiple of window_multiple ({spec.window_multiple}), so that "
                         f"crops start on patch boundaries, got pack_length={pack_length}")
    if spec.horizon:
        raise ValueError(f"pack_length packs whole crops into rows with no target after each: use horizon=0 with "
                         f"it (predict within the row), got horizon={spec.horizon}")
    if equalize != "drop":
        raise ValueError("pack_length packs crops for training; equalize='pad' (every window at least once, "
                         "for validation) is not supported with it, use unpacked batches for validation")


def pretraining(spec: WindowSpec, pack_length: Any, equalize: Any, missing: Any) -> tuple[int | None, str | None]:
    """(pack_length, missing) checked against the window spec, named as the user typed them."""
    if isinstance(equalize, str) and equalize in EQUALIZE:  # a bad equalize is named by its own check
        check_packing(spec, pack_length, equalize)
    if missing not in (None, "mask"):
        raise ValueError(f"missing must be None or 'mask', got {missing!r}")
    return None if pack_length is None else int(pack_length), missing


PACKING = 2  # packed rows: a small block's rows counted by packing it (plan/rows.py); 1: every block estimated


@check_keywords()
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
    pack_length: int | None = None  # rows of this many steps, each holding whole crops (plan/rows.py)
    canonical: tuple[int, int] | None = None  # (rank slots, step phases): one order for every world (plan/canon.py)
    packing: int = PACKING  # how packed rows are counted (PACKING; 1: every block's rows estimated, none packed)

    def __post_init__(self) -> None:
        for name, low in (("batch_size", 1), ("world_size", 1), ("num_workers", 0), ("seed", 0),
                          ("block_windows", 1), ("slice_windows", 1), ("packing", 1)):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.equalize not in EQUALIZE:
            raise ValueError(f"equalize must be 'drop' or 'pad', got {self.equalize!r}")
        check_packing(self.spec, self.pack_length, self.equalize)
        if self.canonical is not None:
            object.__setattr__(self, "canonical", check_canonical(self.canonical))
            # with one phase workers take chunks of steps (plan/canon.py): any worker count serves
            check_world(self.canonical, int(self.world_size), 0 if self.chunked else int(self.num_workers))

    def inputs(self) -> dict[str, Any]:
        """The fields a checkpoint records of this config (besides ``canonical``; ``packing`` only with packed rows)."""
        skip = ("spec", "canonical") + (("pack_length", "packing") if self.pack_length is None else ())
        return {k: v for k, v in asdict(self).items() if k not in skip}

    @property
    def aligned(self) -> bool:
        """Canonical streams of one phase over windows (not packed rows): blocks aligned to the step, read and
        handed to workers a chunk of steps at a time (plan/canon.py)."""
        return self.chunked and self.pack_length is None

    @property
    def chunked(self) -> bool:
        """Canonical streams of one phase (windows or packed rows): a rank's workers take chunks of steps in turn
        (or share batches), so any worker count serves them (plan/canon.py)."""
        return self.canonical is not None and self.canonical[1] == 1

    @property
    def workers_per_rank(self) -> int:
        """Streams each rank runs: one per worker, one in-process without workers."""
        return max(1, self.num_workers)

    @property
    def num_streams(self) -> int:
        """Streams the plan deals each source over: the canonical ones, or one per rank and worker."""
        if self.canonical is not None:
            return self.canonical[0] * self.canonical[1]
        return self.world_size * self.workers_per_rank


AUTO = "auto"  # (8, 1) where it costs about nothing, else one stream per rank and worker (canonical_for)
DEFAULT_CANONICAL = AUTO  # one order of global batches for 1, 2, 4, 8 ranks and any workers, where it is free
AUTO_CANONICAL = (8, 1)  # 8 rank slots, one phase: worlds of 1, 2, 4, 8 ranks, any worker count


def canonical_for(canonical: tuple[int, int] | str | None, world_size: int) -> tuple[int, int] | None:
    """The canonical streams of a job: as given, or what "auto" means for it, (8, 1) (one order of global batches
    for 1, 2, 4 and 8 ranks and any worker count, of windows or packed rows, one source or a mix) unless the world
    does not divide 8; then None, one stream per rank and worker."""
    if canonical != AUTO:
        return canonical  # type: ignore[return-value]
    return AUTO_CANONICAL if AUTO_CANONICAL[0] % world_size == 0 else None


def stream_block(shuffle_buffer: int, canonical: tuple[int, int] | None, pack_length: int | None) -> int:
    """Windows a block of a stream holds: ``shuffle_buffer``; packed rows over canonical streams, shuffle_buffer / A
    (a process holds a block of each of its slots' streams: about shuffle_buffer windows in one process, whatever A;
    unpacked windows read their slots' blocks of a chunk as one block of that size instead, plan/group.py)."""
    if canonical is None or pack_length is None:
        return int(shuffle_buffer)
    return max(1, int(shuffle_buffer) // canonical[0])


def check_canonical(canonical: Any) -> tuple[int, int]:
    """``canonical`` as (rank slots, step phases), two integers >= 1, named as the user typed it."""
    if isinstance(canonical, (str, bytes)) or not hasattr(canonical, "__len__") or len(canonical) != 2:
        raise ValueError(f"canonical must be \"auto\" (the default), None or (rank slots, step phases), two integers "
                         f">= 1, got {canonical!r}")
    for what, value in zip(("rank slots", "step phases"), canonical):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or not 1 <= value <= 4096:
            raise ValueError(f"canonical must be \"auto\", None or (rank slots, step phases), two integers of 1..4096: "
                             f"its {what} is {value!r} in canonical={tuple(canonical)!r}")
    return int(canonical[0]), int(canonical[1])


def check_world(canonical: tuple[int, int], world_size: int, num_workers: int) -> None:
    """Refuse a world or worker count the canonical streams cannot serve in their one order, saying what would."""
    slots, phases = canonical
    if slots % world_size:
        fits = [w for w in range(1, slots + 1) if slots % w == 0]
        raise ValueError(
            f"world_size={world_size} does not divide the {slots} rank slots of canonical={canonical} (each rank "
            f"serves whole slots; worlds of {fits} ranks fit): pass order=sw.Order(canonical="
            f"({_multiple(world_size, slots)}, {phases})) to WindowDataset (the same on every job that should share "
            "one order), or order=sw.Order(canonical=None) for an order that depends on the world size and worker "
            "count")
    if num_workers and phases % num_workers:
        fits = [w for w in range(1, phases + 1) if phases % w == 0]
        raise ValueError(
            f"num_workers={num_workers} does not divide the {phases} step phases of canonical={canonical} (each "
            f"worker serves whole phases; {fits} workers fit, or 0): pass num_workers= one of those to WindowLoader, "
            f"or order=sw.Order(canonical=({slots}, {_multiple(num_workers, phases)})) to WindowDataset")


def _multiple(n: int, at_least: int) -> int:
    """The least multiple of ``n`` that is >= ``at_least``."""
    return -(-at_least // n) * n
