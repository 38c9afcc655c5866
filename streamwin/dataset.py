"""WindowDataset: a dataset URL plus a window spec; the plan and the streams of its batches.

A *stream* is one reader of the plan: BlockReader -> Batcher (-> ThreadPrefetcher), run in
the trainer's process or in a worker process of a WindowLoader. The dataset knows nothing
of processes: the loader says how many streams a rank runs (``num_workers``), so two
loaders with different worker counts can share one dataset.

A *mixed* dataset (a list or dict of URLs, with weights) holds one WindowDataset per source
(its manifest, window space and shard reader); its plan is a ``mix.MixPlan`` (one plan per
source plus the windows of each source in every batch) and its stream a MixBatcher over one
BlockReader per source. Everything else (window spec, seed, batch size, split) is shared.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from functools import partial
from typing import Any, Callable

import numpy as np

from streamwin.batch import BatchLayout, Gatherer
from streamwin.storage.cache import ShardCache
from streamwin.errors import StateMismatchError
from streamwin.formats.manifest import Manifest
from streamwin.plan.mix import MixPlan, normalized, plan_epoch, rest_mix
from streamwin.nodes import Batcher, BlockReader, MixBatcher, ShipOrder, ThreadPrefetcher
from streamwin.plan.epoch import Plan, PlanConfig, WindowIndex, WindowSpec, make_plan, rest_plan
from streamwin.read import ReadOptions, ReadStats, ShardReader, zstd_slice_windows
from streamwin.plan.split import SplitSpec, split_views
from streamwin.storage.manifests import load_manifest
from streamwin.world import resolve

log = logging.getLogger("streamwin")
STATE_VERSION = 2


# -- argument checks: each public argument, once, named as the user typed it -----------------------
_INTS = {"window": 1, "stride": 1, "horizon": 0, "shuffle_buffer": 1, "seed": 0, "batch_size": 1, "rank": 0,
         "world_size": 1, "slice_windows": 1, "readahead": 0, "prefetch": 0, "retries": 0, "cache_limit": 0,
         "split_seed": 0, "holdout": 0}  # name -> smallest valid value
_MAY_BE_NONE = {"stride", "rank", "world_size", "slice_windows", "cache_limit", "storage_options", "cache_dir",
                "split", "weights", "epoch_windows"}
_CHOICES = {"equalize": ("drop", "pad"), "on_error": ("raise", "skip"), "split": ("train", "val", "test")}


def _check_arguments(args: dict[str, Any]) -> None:
    """Refuse a bad WindowDataset argument with one error that names it and says what is valid."""
    given = {k: v for k, v in args.items() if not (v is None and k in _MAY_BE_NONE)}
    _check_sources(given)
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


def _check_sources(given: dict[str, Any]) -> None:
    """One URL, or a list / dict of them (mixing) with weights of the same length / keys and epoch_windows."""
    url = given["url"]
    if isinstance(url, (str, os.PathLike)):
        for name in ("weights", "epoch_windows"):
            if name in given:
                raise ValueError(f"{name}={given[name]!r} mixes several datasets: pass url as a list or dict of URLs")
        return
    urls = list(url.values()) if isinstance(url, Mapping) else list(url) if isinstance(url, (list, tuple)) else None
    if not urls or not all(isinstance(u, (str, os.PathLike)) for u in urls):
        raise TypeError(f"url must be a path or an fsspec URL string, or a non-empty list or dict of them, got {url!r}")
    if isinstance(url, Mapping) and not all(isinstance(k, str) for k in url):
        raise TypeError(f"the names of a dict of URLs must be strings, got {list(url)!r}")
    if "epoch_windows" in given:
        _check_int("epoch_windows", given["epoch_windows"], 0)
    if "weights" in given:
        _check_weights(url, given["weights"])


def _check_weights(url: Sequence | Mapping, weights: Any) -> None:
    """Weights matching the sources: a list as long as the list of URLs, or a dict with the same names."""
    if isinstance(url, Mapping):
        if not isinstance(weights, Mapping) or set(weights) != set(url):
            raise ValueError(f"weights must be a dict with the names of url ({sorted(url)}), got {weights!r}")
        values = [weights[k] for k in url]
    else:
        if isinstance(weights, (str, Mapping)) or not isinstance(weights, (Sequence, np.ndarray)) \
                or np.ndim(weights) != 1 or len(weights) != len(url):
            raise ValueError(f"weights must be a list of {len(url)} numbers, one per URL, got {weights!r}")
        values = list(weights)
    if not all(_is_real(v) for v in values):
        raise TypeError(f"weights must be numbers >= 0, got {weights!r}")
    try:
        normalized(values)
    except ValueError:
        raise ValueError(f"weights must be finite numbers >= 0, not all 0, got {weights!r}") from None


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
        url: dataset root (local path or fsspec URL) holding index.json and the shards; or a list
            of them, or a dict {name: url}, to mix several datasets (same dtype and feature shape)
            into every batch: ``batch["source"]`` says which each window came from (its position
            in the list or dict).
        weights: with several URLs, each source's share of the epoch and of every batch (a list,
            or a dict by name; normalized). Source i gives round(w_i * E) windows of an epoch of E
            (a small source repeats, a large one gives another subset each epoch) and
            floor(w_i * B) or ceil(w_i * B) windows of every batch. Default: each source all of
            its windows once, batches mixed in proportion.
        epoch_windows: with several URLs, the windows of an epoch (default: every source's, summed).
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
                 holdout: int = 0, weights: Sequence[float] | Mapping[str, float] | None = None,
                 epoch_windows: int | None = None):
        args = dict(locals())
        _check_arguments(args)  # first: every argument exactly as the user passed it
        self.sources: list[WindowDataset] = []  # a mixed dataset's sources (one dataset each), else empty
        if isinstance(url, (str, os.PathLike)):
            self.url = str(url)
        else:
            self._init_sources(args)
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
        if self.sources:
            self._check_compatible()

    def _init_sources(self, args: dict[str, Any]) -> None:
        """One child dataset per URL, sharing every other argument; the names, weights and epoch size."""
        url, weights = args["url"], args["weights"]
        urls = list(url.values()) if isinstance(url, Mapping) else list(url)
        self.names = list(url) if isinstance(url, Mapping) else [str(u) for u in urls]
        self.url = tuple(str(u) for u in urls)
        shared = {k: v for k, v in args.items() if k not in ("self", "url", "weights", "epoch_windows")}
        self.sources = [WindowDataset(u, **shared) for u in urls]
        if weights is not None:
            weights = [weights[k] for k in url] if isinstance(url, Mapping) else list(weights)
        self.weights = None if weights is None else [float(w) for w in weights]
        self.epoch_windows = None if args["epoch_windows"] is None else int(args["epoch_windows"])

    def _check_compatible(self) -> None:
        """Mixed sources share dtype and feature shape (one batch holds them all), else name both URLs."""
        first = self.sources[0]
        a = first.manifest
        for other in self.sources[1:]:
            b = other.manifest
            for what, x, y in (("dtype", np.dtype(a.dtype), np.dtype(b.dtype)),
                               ("feature shape", tuple(a.step_shape), tuple(b.step_shape))):
                if x != y:
                    raise ValueError(f"mixed datasets must share dtype and feature shape: {first.url!r} has {what} "
                                     f"{x}, {other.url!r} has {what} {y}")

    # -- configuration ---------------------------------------------------------------------------
    @property
    def manifest(self) -> Manifest:
        """The dataset's manifest (a mixed dataset's first source's: dtype and feature shape are shared)."""
        if self.sources:
            return self.sources[0].manifest
        if self._manifest is None:
            cache = self._cache()  # a remote columnar manifest is mapped from the node cache: one copy per node
            self._manifest = load_manifest(self.url, self.storage_options, retries=self.retries,
                                           backoff=self.retry_backoff, fetch_columns=cache.fetch if cache else None)
        return self._manifest

    @property
    def manifests(self) -> list[Manifest]:
        """One manifest per source (a batch's keys are looked up in its window's source's)."""
        return [s.manifest for s in self.sources] if self.sources else [self.manifest]

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
            zstd = [zstd_slice_windows(m, self.spec.stride) for m in self.manifests]  # mixed: every source's
            self._slices = max([self.shuffle_buffer // 8, *zstd])
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
        if self.sources:
            raise TypeError("a mixed dataset has one window space per source: use dataset.sources[i].window_index()")
        if self._index is None:
            m = self.manifest
            shipped = self._coarse[1] if self._coarse is not None and self._coarse[0] == m.digest else None
            self._index = WindowIndex(m.length, self.spec, None if self.split is None else self._views_of,
                                      coarse=shipped)
            self._coarse = None
        return self._index

    def plan(self, epoch: int = 0, num_workers: int = 0, rest_of: Sequence[Mapping[str, Any]] = ()) -> Plan:
        """The plan of ``epoch`` for every stream of every rank (pure: no I/O beyond the manifest).

        ``rest_of`` (elastic resume) lists the interrupted runs of this epoch, oldest first, each
        {"inputs": its plan inputs, "batches": batches per rank taken when it stopped}: the plan
        is then the rest of the epoch, dealt over this world.
        """
        return self._plan(self.config(num_workers), epoch, rest_of)

    def plan_of(self, inputs: Mapping[str, Any], epoch: int = 0, rest_of: Sequence[Mapping[str, Any]] = ()) -> Plan:
        """The plan over this dataset under a checkpoint's world, workers and batch size (``plan_inputs``)."""
        return self._plan(self.config_of(inputs), epoch, rest_of)

    def config_of(self, inputs: Mapping[str, Any]) -> PlanConfig:
        """The plan config of a checkpoint's inputs: its world, workers and batch size over this dataset."""
        return replace(self.config(), **{k: inputs[k] for k in POSITION_ONLY if k in inputs})

    def _plan(self, config: PlanConfig, epoch: int, rest_of: Sequence[Mapping[str, Any]]) -> Plan | MixPlan:
        if not rest_of:
            return self._fresh(config, epoch)
        plan, before = self.plan_of(rest_of[0]["inputs"], epoch), 0
        configs = [self.config_of(r["inputs"]) for r in rest_of[1:]] + [config]
        rest = rest_mix if self.sources else rest_plan
        for run, nxt in zip(rest_of, configs):
            plan, before = rest(plan, int(run["batches"]) - before, nxt), int(run["batches"])
        return plan

    def _fresh(self, config: PlanConfig, epoch: int) -> Plan | MixPlan:
        """A whole epoch's plan under ``config``."""
        if not self.sources:
            return make_plan(None, self.manifest.shard_starts, config, epoch, index=self.window_index())
        return plan_epoch(config, epoch, [src.window_index() for src in self.sources],
                          [src.manifest.shard_starts for src in self.sources], self.weights, self.epoch_windows,
                          [src.url for src in self.sources])

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
        if self.sources:  # a mixed dataset: every source's data, the names, weights and epoch size
            d.update(dataset=[s.manifest.digest for s in self.sources], sources=list(self.names),
                     weights=self.weights, epoch_windows=self.epoch_windows)
        return d

    def summary(self, epoch: int = 0, num_workers: int = 0) -> dict[str, Any]:
        """The numbers users care about for this epoch, for logging (per source too, when mixed)."""
        p = self.plan(epoch, num_workers)
        counted = [q.index.totals() for q in p.plans] if self.sources else [p.index.totals()]  # one scan each
        totals = {k: sum(c[k] for c in counted) for k in ("sequences", "steps", "short_sequences")}
        out = {"shards": sum(len(m.shards) for m in self.manifests), "sequences": totals["sequences"],
               "steps": totals["steps"], "windows_per_epoch": p.total_windows, "dropped_windows": p.dropped_windows,
               "repeated_windows": p.repeated_windows, "batches_per_rank": p.batches_per_rank,
               "world_size": self.world()[1], "streams": p.config.num_streams,
               "short_sequences": totals["short_sequences"], "split": self.split.split if self.split else None}
        if self.sources:
            out["sources"] = self._source_summary(p)
        return out

    def _source_summary(self, p: MixPlan) -> list[dict[str, Any]]:
        """Per source: its windows, its share of the epoch, how often each window repeats, its batch weight."""
        out = []
        for name, src, plan, w in zip(self.names, self.sources, p.plans, p.weights):
            windows, share = plan.index.total, plan.total_windows
            out.append({"name": name, "url": src.url, "windows": windows, "share": share,
                        "repeat": round(share / windows, 4) if windows else 0.0, "weight": round(float(w), 6)})
        return out

    def layout(self) -> BatchLayout:
        """The fields, shapes and byte offsets of every batch this dataset yields."""
        return BatchLayout(self.manifest, self.spec, self.batch_size,
                           with_weight=self.equalize == "pad" or self.on_error == "skip", with_source=bool(self.sources))

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
                transform: Callable | None = None, gatherer=None) -> tuple[Batcher | MixBatcher | ThreadPrefetcher,
                                                                 "ShardSource | SourceGroup"]:
    """The node yielding stream ``stream``'s batches of ``plan`` from batch ``first_batch`` on, and its source.

    ``transform`` runs on each block on the read-ahead thread (device mode uploads it there);
    ``gatherer`` replaces the CPU gather (device mode gathers on the device).
    """
    if ds.sources:
        return _open_mixed(ds, plan, stream, first_batch, next_buffer, prefetch=prefetch, transform=transform,
                           gatherer=gatherer)
    source = open_source(ds)
    reader = BlockReader(source, plan, stream, readahead=ds.readahead, transform=transform)
    gatherer = gatherer or Gatherer(ds.manifest, ds.spec)
    node: Batcher | ThreadPrefetcher = Batcher(reader, gatherer, next_buffer or (lambda: None))
    if prefetch and ds.prefetch > 0:
        node = ThreadPrefetcher(node, depth=ds.prefetch)
    node.reset({Batcher.BATCH_KEY: first_batch})
    return node, source


def _open_mixed(ds: WindowDataset, plan: MixPlan, stream: int, first_batch: int,
                next_buffer: Callable[[], dict[str, np.ndarray]] | None, *, prefetch: bool, transform: Callable | None,
                gatherer) -> tuple[MixBatcher | ThreadPrefetcher, "SourceGroup"]:
    """A mixed dataset's stream: one block reader per source, batches filled by their quotas.

    ``transform(block, source=i)`` runs on source i's read-ahead thread (device mode uploads there).
    """
    sources = [open_source(src) for src in ds.sources]
    readers = [BlockReader(source, p, stream, readahead=ds.readahead,
                           transform=None if transform is None else partial(transform, source=i))
               for i, (source, p) in enumerate(zip(sources, plan.plans))]
    node: MixBatcher | ThreadPrefetcher = MixBatcher(readers, plan.quotas, gatherer or Gatherer(ds.manifest, ds.spec),
                                                     next_buffer or (lambda: None))
    if prefetch and ds.prefetch > 0:
        node = ThreadPrefetcher(node, depth=ds.prefetch)
    node.reset({MixBatcher.BATCH_KEY: first_batch})
    return node, SourceGroup(sources)


class SourceGroup:
    """The shard readers of a mixed stream's sources; ``stats`` sums theirs."""

    def __init__(self, sources: list[ShardSource]):
        self.sources = sources

    @property
    def stats(self) -> ReadStats:
        out = ReadStats()
        for source in self.sources:
            for name, value in vars(source.stats).items():
                setattr(out, name, getattr(out, name) + value)
        return out


def open_source(ds: WindowDataset) -> ShardReader:
    """The reader of the dataset's shards (with its node cache, retries and error policy)."""
    options = ReadOptions(storage_options=ds.storage_options, retries=ds.retries, retry_backoff=ds.retry_backoff,
                          on_error=ds.on_error, cache_dir=ds.cache_dir, cache_limit=ds.cache_limit)
    return ShardReader(ds.url, ds.manifest, options)


def open_blocks(ds: WindowDataset, plan: Plan | MixPlan, stream: int, first_batch: int) -> tuple[ShipOrder,
                                                                                             "ShardSource | SourceGroup"]:
    """Every source's blocks of stream ``stream`` that its batches from ``first_batch`` on read, in the
    order they read them (device mode: workers ship blocks whole)."""
    if ds.sources:
        sources, plans, quotas = [open_source(src) for src in ds.sources], plan.plans, plan.quotas
    else:
        sources, plans = [open_source(ds)], [plan]
        quotas = np.full((plan.batches_per_stream, 1), plan.config.batch_size, dtype=np.int64)
    readers = [BlockReader(source, p, stream, readahead=ds.readahead) for source, p in zip(sources, plans)]
    return ShipOrder(readers, quotas, first_batch), SourceGroup(sources) if ds.sources else sources[0]


def close_stream(node: Batcher | MixBatcher | ThreadPrefetcher | ShipOrder | None) -> None:
    """Stop a stream's threads (read-ahead, prefetch)."""
    if node is not None:
        node.close()


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


def same_position(saved: Mapping[str, Any], now: Mapping[str, Any]) -> bool:
    """Whether a position taken under ``saved`` inputs means the same batches under ``now`` (no elastic resume)."""
    return all(_planned(k, saved.get(k)) == _planned(k, now.get(k)) for k in POSITION_ONLY)


def _planned(name: str, value: Any) -> Any:
    """A plan input as the plan uses it: 0 and 1 workers both run one stream per rank (the same plan)."""
    return max(1, value) if name == "num_workers" and isinstance(value, int) else value


# plan inputs that only matter for a position inside an epoch
POSITION_ONLY = frozenset({"batch_size", "world_size", "num_workers", "equalize", "block_windows", "slice_windows"})
