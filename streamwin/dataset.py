"""WindowDataset: a dataset URL plus a window spec; the plan and the streams of its batches.

A *stream* is one reader of the plan: BlockReader -> Batcher (-> ThreadPrefetcher), run in
the trainer's process or in a worker process of a WindowLoader. The dataset knows nothing
of processes: the loader says how many streams a rank runs (``num_workers``), so two
loaders with different worker counts can share one dataset.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any, Callable

import numpy as np

from .batch import BatchLayout, Gatherer
from .cache import ShardCache
from .errors import StateMismatchError
from .manifest import Manifest
from .nodes import Batcher, BlockReader, ThreadPrefetcher
from .plan import Plan, PlanConfig, WindowIndex, WindowSpec, make_plan
from .read import ShardSource, zstd_slice_windows
from .split import SplitSpec, split_views
from .storage import load_manifest
from .world import resolve

log = logging.getLogger("streamwin")
STATE_VERSION = 2


# -- argument checks: each public argument, once, named as the user typed it -----------------------
_INTS = {"window": 1, "stride": 1, "horizon": 0, "shuffle_buffer": 1, "seed": 0, "batch_size": 1, "rank": 0,
         "world_size": 1, "slice_windows": 1, "readahead": 0, "prefetch": 0, "retries": 0, "cache_limit": 0,
         "split_seed": 0, "holdout": 0}  # name -> smallest valid value
_MAY_BE_NONE = {"stride", "rank", "world_size", "slice_windows", "cache_limit", "storage_options", "cache_dir",
                "split"}
_CHOICES = {"equalize": ("drop", "pad"), "on_error": ("raise", "skip"), "split": ("train", "val", "test")}


def _check_arguments(args: dict[str, Any]) -> None:
    """Refuse a bad WindowDataset argument with one error that names it and says what is valid."""
    given = {k: v for k, v in args.items() if not (v is None and k in _MAY_BE_NONE)}
    if not isinstance(given["url"], (str, os.PathLike)):
        raise TypeError(f"url must be a path or an fsspec URL string, got {given['url']!r}")
    for name, low in _INTS.items():
        if name in given:
            _check_int(name, given[name], low)
    for name in ("pad", "shuffle"):
        if not isinstance(given[name], (bool, np.bool_)):
            raise TypeError(f"{name} must be True or False, got {given[name]!r}")
    for name, choices in _CHOICES.items():
        if name in given and (not isinstance(given[name], str) or given[name] not in choices):
            allowed = " or ".join(map(repr, choices)) + (" (or None)" if name in _MAY_BE_NONE else "")
            raise ValueError(f"{name} must be {allowed}, got {given[name]!r}")
    backoff = given["retry_backoff"]
    if not _is_real(backoff) or not 0 <= backoff < float("inf"):
        error = ValueError if _is_real(backoff) else TypeError
        raise error(f"retry_backoff must be a number of seconds >= 0, got {backoff!r}")
    if "storage_options" in given and not isinstance(given["storage_options"], Mapping):
        raise TypeError(f"storage_options must be a dict of fsspec options (or None), got {given['storage_options']!r}")
    if "cache_dir" in given and not isinstance(given["cache_dir"], (str, os.PathLike)):
        raise TypeError(f"cache_dir must be a directory path (or None), got {given['cache_dir']!r}")
    _check_split(given)
    if "rank" in given and "world_size" in given and given["rank"] >= given["world_size"]:
        raise ValueError(f"rank must be < world_size ({given['world_size']}), got {given['rank']!r}")


def _check_split(given: dict[str, Any]) -> None:
    fractions = given["split_fractions"]
    if (isinstance(fractions, str) or not isinstance(fractions, Sequence) or len(fractions) != 3
            or not all(_is_real(f) and 0 <= f <= 1 for f in fractions) or abs(sum(fractions) - 1) > 1e-9):
        raise ValueError(f"split_fractions must be three numbers >= 0 summing to 1 (train, val, test), got {fractions!r}")
    if given["holdout"] and "split" not in given:
        raise ValueError(f"holdout={given['holdout']!r} needs split='train', 'val' or 'test'")


def _check_int(name: str, value: Any, low: int) -> None:
    """An integer (numpy ones too, bool not) of at least ``low``, else an error naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer >= {low}, got {value!r} ({type(value).__name__})")
    if value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _is_real(value: Any) -> bool:
    """An int or float (numpy ones too) but not a bool; NaN passes here and fails every bound check."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


class WindowDataset:
    """Sliding windows over the sequences of a packed dataset, as batches.

    Args:
        url: dataset root (local path or fsspec URL) holding index.json and the shards.
        window: steps per window (``batch["x"]`` is ``[B, window, *features]``).
        stride: steps between window starts (default: ``window``, no overlap).
        horizon: target steps right after the window (``batch["y"]``), 0 for none.
        pad: give a sequence shorter than window + horizon one zero-padded window with ``batch["mask"]``.
        shuffle: permute slices per epoch and windows within blocks of ``shuffle_buffer``.
        shuffle_buffer: windows per shuffle block; bounds resident memory.
        seed: the order is a pure function of (seed, epoch, world_size, num_workers, batch_size).
        batch_size: windows per batch (batches are formed in the worker).
        equalize: "drop" (each window at most once, < streams * batch_size dropped) or "pad"
            (each at least once, repeats marked ``batch["weight"] == 0``).
        rank, world_size: override the detected ones (see streamwin.world).
        storage_options: passed to fsspec (credentials, endpoint_url, ...).
        slice_windows: windows per read slice (default shuffle_buffer // 8, or with zstd enough to span a
            few of the frames or members a read decompresses whole, so that each is read about once
            an epoch); smaller mixes more.
        readahead: blocks read ahead, on a background thread, of the one being batched (reads
            release the GIL, so this overlaps I/O with batching and training).
        retries: failed attempts in a row allowed per read on transient storage errors.
        retry_backoff: seconds before the first retry, doubling with each failure in a row.
        on_error: "raise" a ShardError on bad data, or "skip": only the windows whose bytes cannot
            be read become zeros with ``batch["weight"] == 0``, counted in ``loader.stats()``, and
            every rank still yields the same number of batches.
        cache_dir, cache_limit: keep verified node-local copies of remote shards (fetched once
            per node, evicted least-recently-used down to ``cache_limit`` bytes).
        split: None (all data), "train", "val" or "test".
        split_fractions, split_seed: with ``holdout=0``, a sequence belongs to one split, chosen by a
            stable hash of (split_seed, key): never in two splits, stable as the dataset grows.
        holdout: H > 0 selects a temporal split instead: "train" windows (with their horizon) lie
            in steps [0, T - 2H) of every sequence; a "val" window's last target step lies in
            [T - 2H, T - H), a "test" window's in [T - H, T) (inputs may look back for context).
        prefetch: batches gathered ahead on another thread. Off by default: the gather holds the
            GIL, so on few cores a third thread only adds hand-offs (measured: 460k -> 130-310k
            windows/s); it can help when the training step leaves the GIL free for long.
    """

    def __init__(self, url: str, window: int, stride: int | None = None, horizon: int = 0, *, pad: bool = False,
                 shuffle: bool = True, shuffle_buffer: int = 10_000, seed: int = 0, batch_size: int = 64,
                 equalize: str = "drop", rank: int | None = None, world_size: int | None = None,
                 storage_options: dict[str, Any] | None = None, slice_windows: int | None = None,
                 readahead: int = 1, prefetch: int = 0, retries: int = 5, retry_backoff: float = 0.2,
                 on_error: str = "raise",
                 cache_dir: str | None = None, cache_limit: int | None = None, split: str | None = None,
                 split_fractions: tuple[float, float, float] = (0.8, 0.1, 0.1), split_seed: int = 0,
                 holdout: int = 0):
        _check_arguments(dict(locals()))  # first: every argument exactly as the user passed it
        self.url = str(url)
        self.spec = WindowSpec(window, window if stride is None else stride, horizon, pad)
        self.shuffle, self.shuffle_buffer, self.seed = bool(shuffle), int(shuffle_buffer), int(seed)
        self.batch_size, self.equalize = int(batch_size), equalize
        self.slice_windows = int(slice_windows) if slice_windows else None  # None: from the manifest (config)
        self._slices: int | None = None  # the default, once computed
        self.readahead, self.prefetch, self.retries = int(readahead), int(prefetch), int(retries)
        self.retry_backoff = float(retry_backoff)
        self.storage_options = storage_options
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.on_error, self.cache_dir, self.cache_limit = on_error, cache_dir, cache_limit
        self._rank, self._world_size = rank, world_size
        self._world: tuple[int, int] | None = None
        self._manifest: Manifest | None = None
        self.split = None if split is None else SplitSpec(split, tuple(split_fractions), int(split_seed), int(holdout))
        if split is None and holdout:
            raise ValueError("holdout needs split='train', 'val' or 'test'")
        self._index: WindowIndex | None = None  # window space: built once, shared by every epoch's plan
        self._coarse: tuple[str, np.ndarray] | None = None  # (manifest digest, a WindowIndex's scan) for workers
        self._lens: dict[PlanConfig, int] = {}
        self.config(world_size=1, slice_windows=self.slice_windows or 1)  # validate now, without the manifest

    # -- configuration ---------------------------------------------------------------------------
    @property
    def manifest(self) -> Manifest:
        if self._manifest is None:
            cache = self._cache()  # a remote columnar manifest is mapped from the node cache: one copy per node
            self._manifest = load_manifest(self.url, self.storage_options, retries=self.retries,
                                           backoff=self.retry_backoff, fetch_columns=cache.fetch if cache else None)
        return self._manifest

    def _cache(self) -> ShardCache | None:
        """The node cache of remote shards (and columns files), if ``cache_dir`` was given."""
        if self.cache_dir is None:
            return None
        return ShardCache(self.cache_dir, limit_bytes=self.cache_limit, retries=self.retries, backoff=self.retry_backoff)

    @property
    def columns(self) -> tuple[str, ...] | None:
        """Names of the features (``x[..., f]``): the table columns pack took the values from, else None."""
        return self.manifest.value_columns

    def world(self, refresh: bool = False) -> tuple[int, int]:
        """(rank, world_size) (see streamwin.world); kept once something definitive says who we are."""
        if self._world is None or refresh:
            world, definitive = resolve(self._rank, self._world_size)
            if not definitive:
                return world  # single process so far; a later init_process_group may still change it
            self._world = world
        return self._world

    def config(self, num_workers: int = 0, world_size: int | None = None, slice_windows: int | None = None) -> PlanConfig:
        """The plan's inputs besides the data, for a rank running ``num_workers`` streams (0: one, in-process)."""
        return PlanConfig(
            spec=self.spec, batch_size=self.batch_size,
            world_size=self.world()[1] if world_size is None else world_size,
            num_workers=num_workers, seed=self.seed, shuffle=self.shuffle,
            block_windows=self.shuffle_buffer, equalize=self.equalize,
            slice_windows=slice_windows or self.slice_windows or self._default_slices())

    def _default_slices(self) -> int:
        """Windows per read slice by default: shuffle_buffer // 8, or more for zstd (read.zstd_slice_windows)."""
        if self._slices is None:
            self._slices = max(self.shuffle_buffer // 8, zstd_slice_windows(self.manifest, self.spec.stride))
        return self._slices

    def views(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Per-sequence (first step, steps) of this dataset's split, or None for all data (not cached)."""
        if self.split is None:
            return None
        m = self.manifest
        return split_views(self.split, m.length, m.key_blob, m.key_ends, self.spec.window, span=self.spec.span)

    def _views_of(self, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        m = self.manifest
        return split_views(self.split, m.length, m.key_blob, m.key_ends, self.spec.window, span=self.spec.span,
                           seqs=seqs)

    def window_index(self) -> WindowIndex:
        """The dataset's window space, built once (before a loader forks its workers, who share it)."""
        if self._index is None:
            m = self.manifest
            shipped = self._coarse[1] if self._coarse is not None and self._coarse[0] == m.digest else None
            self._index = WindowIndex(m.length, self.spec, None if self.split is None else self._views_of,
                                      coarse=shipped)
            self._coarse = None
        return self._index

    def plan(self, epoch: int = 0, num_workers: int = 0) -> Plan:
        """The plan of ``epoch`` for every stream of every rank (pure: no I/O beyond the manifest)."""
        return make_plan(None, self.manifest.shard_starts, self.config(num_workers), epoch, index=self.window_index())

    def plan_of(self, inputs: dict[str, Any], epoch: int = 0) -> Plan:
        """The plan over this dataset under a checkpoint's world, workers and batch size (``plan_inputs``)."""
        cfg = replace(self.config(), **{k: inputs[k] for k in POSITION_ONLY if k in inputs})
        return make_plan(None, self.manifest.shard_starts, cfg, epoch, index=self.window_index())

    def __len__(self) -> int:
        """Batches one rank yields per epoch without worker processes: the same on every rank (cached)."""
        cfg = self.config()
        if cfg not in self._lens:
            self._lens[cfg] = self.plan().batches_per_rank
        return self._lens[cfg]

    def plan_inputs(self, num_workers: int = 0) -> dict[str, Any]:
        """What a checkpoint must agree on to be resumed exactly."""
        cfg = self.config(num_workers)
        d = {k: v for k, v in asdict(cfg).items() if k != "spec"}
        d.update(asdict(cfg.spec))
        d["dataset"] = self.manifest.digest
        d["split"] = None if self.split is None else list(asdict(self.split).values())
        return d

    def summary(self, epoch: int = 0, num_workers: int = 0) -> dict[str, Any]:
        """The numbers users care about for this epoch, for logging."""
        m, p = self.manifest, self.plan(epoch, num_workers)
        totals = p.index.totals()  # of what this split uses
        return {"shards": len(m.shards), "sequences": totals["sequences"], "steps": totals["steps"],
                "windows_per_epoch": p.total_windows, "dropped_windows": p.dropped_windows,
                "repeated_windows": p.repeated_windows, "batches_per_rank": p.batches_per_rank,
                "world_size": self.world()[1], "streams": p.config.num_streams,
                "short_sequences": totals["short_sequences"], "split": self.split.split if self.split else None}

    def layout(self) -> BatchLayout:
        """The fields, shapes and byte offsets of every batch this dataset yields."""
        return BatchLayout(self.manifest, self.spec, self.batch_size,
                           with_weight=self.equalize == "pad" or self.on_error == "skip")

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_manifest"] = None  # spawned workers reload (map) it; never ship a 100 MB index through a pipe
        state["_index"] = None  # its coarse scan travels instead (1/64 of a window-start array): no rescan there
        if self._index is not None:  # the scan of this very manifest: a worker that maps another one rescans
            state["_coarse"] = (self._manifest.digest, self._index.coarse)
        return state

    def __iter__(self):
        raise TypeError("a WindowDataset is iterated through streamwin.WindowLoader(dataset), which runs its "
                        "streams, batches them and keeps the position for resume")

    def __getitem__(self, index):
        raise TypeError("a WindowDataset yields whole batches, not items: use streamwin.WindowLoader(dataset) "
                        "instead of torch.utils.data.DataLoader(dataset), which would add a batch dimension")


def open_stream(ds: WindowDataset, plan: Plan, stream: int, first_batch: int,
                next_buffer: Callable[[], dict[str, np.ndarray]] | None, *, prefetch: bool = True,
                transform: Callable | None = None, gatherer=None) -> tuple[Batcher | ThreadPrefetcher, ShardSource]:
    """The node yielding stream ``stream``'s batches of ``plan`` from batch ``first_batch`` on, and its source.

    ``transform`` runs on each block on the read-ahead thread (device mode uploads it there);
    ``gatherer`` replaces the CPU gather (device mode gathers on the device).
    """
    source = open_source(ds)
    reader = BlockReader(source, plan, stream, readahead=ds.readahead, transform=transform)
    gatherer = gatherer or Gatherer(ds.manifest, ds.spec)
    node: Batcher | ThreadPrefetcher = Batcher(reader, gatherer, next_buffer or (lambda: None))
    if prefetch and ds.prefetch > 0:
        node = ThreadPrefetcher(node, depth=ds.prefetch)
    node.reset({Batcher.BATCH_KEY: first_batch})
    return node, source


def open_source(ds: WindowDataset) -> ShardSource:
    """The reader of the dataset's shards (with its node cache, retries and error policy)."""
    return ShardSource(ds.url, ds.manifest, storage_options=ds.storage_options, retries=ds.retries,
                       backoff=ds.retry_backoff, on_error=ds.on_error, cache=ds._cache())


def open_blocks(ds: WindowDataset, plan: Plan, stream: int, first_block: int) -> tuple[BlockReader, ShardSource]:
    """Stream ``stream``'s blocks of ``plan`` from block ``first_block`` on (device mode ships them whole)."""
    source = open_source(ds)
    reader = BlockReader(source, plan, stream, readahead=ds.readahead)
    reader.reset({BlockReader.BLOCK_KEY: first_block})
    return reader, source


def close_stream(node: Batcher | ThreadPrefetcher | BlockReader | None) -> None:
    """Stop a stream's threads (read-ahead, prefetch)."""
    if isinstance(node, (ThreadPrefetcher, BlockReader)):
        node.close()
    elif node is not None:
        node.reader.close()


def check_state(state: dict[str, Any], inputs: dict[str, Any], *, finished: bool = False) -> None:
    """Refuse a state taken under other plan inputs, naming each difference.

    A state taken after an epoch's last batch (``finished``) carries no position, so only the
    inputs that define the data and its order must agree (not world, workers or batch size).
    """
    if not isinstance(state, dict) or state.get("version") not in (1, STATE_VERSION):
        raise StateMismatchError(f"not a streamwin loader state (version {STATE_VERSION}): {str(state)[:200]}")
    saved = state["inputs"]
    names = sorted(set(saved) | set(inputs))
    if finished:
        names = [k for k in names if k not in POSITION_ONLY]
    diffs = [f"{k}: in checkpoint {saved.get(k)!r} / now {inputs.get(k)!r}" for k in names
             if _planned(k, saved.get(k)) != _planned(k, inputs.get(k))]
    if diffs:
        raise StateMismatchError("cannot resume exactly, the plan inputs differ: " + "; ".join(diffs))


def _planned(name: str, value: Any) -> Any:
    """A plan input as the plan uses it: 0 and 1 workers both run one stream per rank (the same plan)."""
    return max(1, value) if name == "num_workers" and isinstance(value, int) else value


# plan inputs that only matter for a position inside an epoch
POSITION_ONLY = frozenset({"batch_size", "world_size", "num_workers", "equalize", "block_windows", "slice_windows"})
