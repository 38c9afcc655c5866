"""WindowDataset: one or several dataset URLs plus a window spec; the plan of every epoch.

A dataset is a mix of sources (``source.Source``: a URL, its manifest and window space); a
dataset of one URL is a mix of one, and every path below is the same for both. Only a
batch's ``source`` field (which source each window came from) exists where there are
several. The dataset knows nothing of processes: the loader says how many streams a rank
runs (``num_workers``), so two loaders with different worker counts can share one dataset.

Every argument is checked once, in the constructor or in its option group (streamwin/options.py),
into frozen objects that name the argument as the user typed it: ``WindowSpec`` (window, stride,
horizon and the crops), ``ShuffleSpec`` (shuffle_buffer, seed and the order's shuffle and
slice_windows), ``SplitSpec`` (the selection's split) and ``ReadOptions`` (the read options).
"""
from __future__ import annotations

import copy
import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any

from streamwin.arguments import MAX_BATCH, check_fits, check_int, check_keywords
from streamwin.batch import BatchLayout
from streamwin.formats.manifest import Manifest, check_mixable
from streamwin.options import MOVED, Crops, Mix, Order, Read, Select
from streamwin.plan.canon import sharing
from streamwin.plan.epoch import Plan, plan_epoch, rest_plans
from streamwin.plan.options import PlanConfig, ShuffleSpec, canonical_for, pretraining, stream_block
from streamwin.read import zstd_slice_windows
from streamwin.selection import check_where, where_of
from streamwin.seqfields import FieldGather, field_spec, vocabulary_of
from streamwin.source import Source, dataset_inputs, views_named
from streamwin.state import POSITION_ONLY
from streamwin.transform import TIMEOUT_S, Transform
from streamwin.world import resolve

log = logging.getLogger("streamwin")


@check_keywords(moved=MOVED)
class WindowDataset:
    """Sliding windows over the sequences of a packed dataset (or a mix of several), as batches.

    Args:
        url: dataset root (local path or fsspec URL) holding index.json and the shards; or a list
            of them, or a dict {name: url}, to mix several datasets (same dtype and feature shape)
            into every batch: ``batch["source"]`` says which each window came from (its position
            in the list or dict).
        window: steps per window (``batch["x"]`` is ``[B, window, *features]``).
        stride: steps between window starts (default: ``window``, no overlap).
        horizon: target steps right after the window (``batch["y"]``), 0 for none.
        batch_size: windows per batch of one rank (batches are formed in the worker).
        shuffle_buffer: windows per shuffle block; bounds resident memory.
        seed: the order is a pure function of (seed, epoch, world_size x batch_size) with canonical
            streams, else of (seed, epoch, world_size, num_workers, batch_size).
        crops: how windows are cut and packed beyond the stride grid: ``sw.Crops(pad, jitter,
            min_window, window_multiple, windows_per_sequence, pack_length, missing)``.
        order: how the order is drawn: ``sw.Order(shuffle, slice_windows, equalize, canonical)``.
        select: which sequences and fields: ``sw.Select(split, split_fractions, split_seed, holdout,
            where, fields, fill)``.
        mix: with several URLs, how they mix: ``sw.Mix(weights, epoch_windows)``.
        read: how bytes are read: ``sw.Read(storage_options, retries, retry_backoff, on_error,
            cache_dir, cache_limit, verify_checksums, readahead, readahead_bytes, prefetch)``.
        rank, world_size: override the detected ones (see streamwin.world).

    Each group's defaults are the dataset's (None: every default); streamwin/options.py says what
    each option does.
    """

    def __init__(self, url: str | Sequence[str] | Mapping[str, str], window: int, stride: int | None = None,
                 horizon: int = 0, *, batch_size: int = 64, shuffle_buffer: int = 10_000, seed: int = 0,
                 crops: Crops | None = None, order: Order | None = None, select: Select | None = None,
                 mix: Mix | None = None, read: Read | None = None, rank: int | None = None,
                 world_size: int | None = None):
        crops, order, select, mix, read = (Crops.given(crops), Order.given(order), Select.given(select),
                                           Mix.given(mix), Read.given(read))
        self.mixing, urls = mix.of(url)  # a URL alone is a mix of one
        self.spec = crops.window_spec(window, window if stride is None else stride, horizon)
        with crops.named():
            self.pack_length, self.missing = pretraining(self.spec, crops.pack_length, order.equalize, crops.missing)
        self.shuffle_spec = ShuffleSpec(order.shuffle, shuffle_buffer, seed, order.slice_windows)
        check_int("batch_size", batch_size, 1, MAX_BATCH)
        self.batch_size, self.equalize, self.canonical = int(batch_size), order.equalize, order.canonical
        self._rank, self._world_size = _explicit_world(rank, world_size)
        self.read, self.readahead, self.prefetch = read.options(), int(read.readahead), int(read.prefetch)
        self.split = select.split_spec()
        self.url = str(url) if isinstance(url, (str, os.PathLike)) else tuple(urls)
        self.names, self.weights, self.epoch_windows = self.mixing.names, self.mixing.weights, self.mixing.epoch_windows
        self.where = where_of(select.where)
        self.sources = tuple(Source(u, n, self.spec, self.split, self.read, self.where, select.fill)
                             for n, u in zip(self.names, urls))
        self._world: tuple[int, int] | None = None
        self._slices: int | None = None  # the default slice_windows, once computed
        self._lens: dict[PlanConfig, int] = {}
        self._check_sources()
        with select.named():
            if self.where:  # each value of the field's kind, held by some sequence; every source keeps one
                check_where(select.where, self.where, self.sources)
            self.field_spec = field_spec(select.fields, select.fill, [(s.url, s.manifest.fields) for s in self.sources])
        self.transform: Transform | None = None  # a loader's (``transformed``): batches hold its outputs
        self.check_fits()

    def _check_sources(self) -> None:
        """Each source's manifest, loaded now (one read each): a URL that is not a dataset fails here, naming
        it, not at ``len()`` or iteration; mixed sources share dtype and feature shape (one batch holds them
        all), else name both URLs. An unsealed manifest (an older streamwin's) is a warning."""
        for s in self.sources:
            if not s.manifest.sealed:
                warnings.warn(f"streamwin: {s.url}/index.json was written by an older streamwin and carries no checksum "
                              "of its own content, so an edit to it would go unnoticed: run `streamwin index "
                              f"{s.url}` (or repack) to rewrite it with one", RuntimeWarning, stacklevel=3)
        check_mixable([s.url for s in self.sources], [s.manifest for s in self.sources])

    def check_fits(self) -> None:
        """ValueError naming the arguments whose buffers cannot fit in this machine's memory, with the size they
        would need (the loader checks before it allocates anything: a batch, the blocks read ahead)."""
        sb, span, spec = self.manifest.step_bytes, self.spec.span, self.spec
        rows = f"rows of pack_length={self.pack_length}" if self.pack_length else (
            f"windows of window={spec.window} + horizon={spec.horizon}")
        what = f"a batch of batch_size={self.batch_size} {rows} steps of {sb} bytes"
        check_fits(self.batch_size * (self.pack_length or span) * sb, what)  # exact ints first: the layout's
        check_fits(self.layout().nbytes, what)  # int64 sizes cannot overflow once its values alone fit
        data = sum(s.bytes for m in self.manifests for s in m.shards)  # a block holds at most every step, once
        block = min(self.shuffle_spec.shuffle_buffer * min(spec.stride, span) * sb + span * sb, data)
        check_fits((self.readahead + 2) * block, f"blocks of shuffle_buffer={self.shuffle_spec.shuffle_buffer} "
                   f"windows (stride {spec.stride}, {sb}-byte steps), readahead={self.readahead} of them ahead")

    # -- what the data is --------------------------------------------------------------------------
    @property
    def manifest(self) -> Manifest:
        """The first source's manifest (every source shares its dtype and feature shape)."""
        return self.sources[0].manifest

    @property
    def manifests(self) -> list[Manifest]:
        """One manifest per source (a batch's keys are looked up in its window's source's)."""
        return [s.manifest for s in self.sources]

    @property
    def columns(self) -> tuple[str, ...] | None:
        """Names of the features (``x[..., f]``): the table columns pack took the values from, else None."""
        return self.manifest.value_columns

    def vocabulary(self, name: str) -> tuple[str, ...]:
        """The strings of str field ``name``: ``batch[name]`` holds codes into this tuple (every source's, sorted)."""
        return vocabulary_of(self.field_spec, name)

    def field_gather(self) -> FieldGather | None:
        """What fills a batch's fields (made where batches are gathered: the manifests are mapped there)."""
        if self.field_spec is None:
            return None
        return FieldGather(self.field_spec, [s.manifest.fields for s in self.sources])

    @property
    def seed(self) -> int:
        return self.shuffle_spec.seed

    def world(self, refresh: bool = False) -> tuple[int, int]:
        """(rank, world_size) (see streamwin.world); kept once something definitive says who we are."""
        if self._world is None or refresh:
            world, definitive = resolve(self._rank, self._world_size)
            if not definitive:
                return world  # single process so far; a later init_process_group may still change it
            self._world = world
        return self._world

    def transformed(self, fn: Any, timeout: float | None = TIMEOUT_S) -> "WindowDataset":
        """This dataset with ``fn`` applied to each batch where it is gathered (``WindowLoader(transform=fn)``)."""
        out = copy.copy(self)
        out.transform = Transform(fn, self.layout(), timeout)
        return out

    def layout(self) -> BatchLayout:
        """The fields, shapes and byte offsets of every batch this dataset yields."""
        if self.transform is not None:
            return self.transform.output
        return BatchLayout(self.manifest, self.spec, self.batch_size,
                           with_weight=self.equalize == "pad" or self.read.on_error == "skip",
                           with_source=len(self.sources) > 1, pack_length=self.pack_length, missing=self.missing,
                           fields=self.field_spec.dtypes() if self.field_spec is not None else ())

    # -- the plan ----------------------------------------------------------------------------------
    def config(self, num_workers: int = 0, world_size: int | None = None) -> PlanConfig:
        """The plan's inputs besides the data, for a rank running ``num_workers`` streams (0: one, in-process)."""
        s, world = self.shuffle_spec, self.world()[1] if world_size is None else world_size
        canonical = canonical_for(self.canonical, world)
        return PlanConfig(spec=self.spec, batch_size=self.batch_size, world_size=world, num_workers=num_workers,
                          seed=s.seed, shuffle=bool(s.shuffle), equalize=self.equalize, pack_length=self.pack_length,
                          block_windows=stream_block(s.shuffle_buffer, canonical, self.pack_length),
                          slice_windows=s.slice_windows or self._default_slices(), canonical=canonical)

    def _default_slices(self) -> int:
        """Windows per read slice by default: shuffle_buffer // 8, or more for zstd (read.zstd_slice_windows)."""
        if self._slices is None:
            zstd = [zstd_slice_windows(m, self.spec.stride) for m in self.manifests]
            self._slices = max([self.shuffle_spec.shuffle_buffer // 8, *zstd])
        return self._slices

    def plan(self, epoch: int = 0, num_workers: int = 0, rest_of: Sequence[Mapping[str, Any]] = (), *,
             world_size: int | None = None) -> Plan:
        """The plan of ``epoch`` for every stream of every rank (pure: no I/O beyond the manifests).

        ``rest_of`` (elastic resume) lists the interrupted runs of this epoch, oldest first, each
        {"inputs": its plan inputs, "batches": batches per rank taken when it stopped}: the plan
        is then the rest of the epoch, dealt over this world.
        """
        return self._plan(self.config(num_workers, world_size), epoch, rest_of)

    def plan_of(self, inputs: Mapping[str, Any], epoch: int = 0, rest_of: Sequence[Mapping[str, Any]] = ()) -> Plan:
        """The plan under a checkpoint's world, workers and batch size (``plan_inputs``), on the view it names."""
        return self._plan(self.config_of(inputs), epoch, rest_of, views_named(inputs, len(self.sources)))

    def config_of(self, inputs: Mapping[str, Any]) -> PlanConfig:
        """The plan config of a checkpoint's inputs: its world, workers and batch size over this dataset."""
        given = {k: inputs[k] for k in POSITION_ONLY - {"view"} if k in inputs} | {"canonical": inputs.get("canonical")}
        return replace(self.config(), **given)  # no canonical in it: one stream per rank and worker

    def _plan(self, config: PlanConfig, epoch: int, rest_of: Sequence[Mapping[str, Any]], views=None) -> Plan:
        streams = config.world_size * max(1, config.num_workers)  # a plan keeps some 64 bytes per stream
        check_fits(streams * 64, f"a plan for world_size={config.world_size} ranks x {max(1, config.num_workers)} "
                   f"stream(s) ({streams:,} streams)")
        if not rest_of:
            spaces = [s.space_at(v) for s, v in zip(self.sources, views or [None] * len(self.sources))]
            return sharing(plan_epoch(config, epoch, spaces, [s.manifest.shard_starts for s in self.sources],
                                      self.weights, self.epoch_windows, [s.url for s in self.sources]),
                           self.transform is not None)
        configs, pin = [self.config_of(r["inputs"]) for r in rest_of[1:]] + [config], not rest_of[0]["batches"]
        # a first run of no batches (a loaded state's) names the data its epoch is on: planned on it afresh
        plan = self._plan(configs[0] if pin else self.config_of(rest_of[0]["inputs"]), epoch, (),
                          views_named(rest_of[0]["inputs"], len(self.sources)))
        return sharing(rest_plans(plan, rest_of, configs, skip=int(pin)), self.transform is not None)

    def __len__(self) -> int:
        """Batches one rank yields per epoch without worker processes: the same on every rank (cached)."""
        cfg = self.config()
        if cfg not in self._lens:
            self._lens[cfg] = self.plan().batches_per_rank
        return self._lens[cfg]

    def plan_inputs(self, num_workers: int = 0) -> dict[str, Any]:
        """What a checkpoint must agree on to be resumed exactly (the state format of version 2)."""
        cfg = self.config(num_workers)
        d = cfg.inputs()
        if cfg.canonical is not None:  # absent: one stream per rank and worker (a state that does not record it)
            d["canonical"] = list(cfg.canonical)
        d.update(cfg.spec.plain())
        d.update(dataset_inputs(self.sources, self.mixing.alone))  # which data, and which view of it
        d["split"] = None if self.split is None else list(asdict(self.split).values())
        if self.where:  # which sequences the plan holds
            d["where"] = {k: list(v) for k, v in self.where.items()}
        return d | self.mixing.inputs()  # a list or dict of URLs: their names, weights and epoch size too

    def summary(self, epoch: int = 0, num_workers: int = 0) -> dict[str, Any]:
        """The numbers users care about for this epoch, for logging (per source too, when mixed)."""
        p = self.plan(epoch, num_workers)
        counted = [q.space.totals() for q in p.sources]  # one scan each
        totals = {k: sum(c[k] for c in counted) for k in ("sequences", "steps", "short_sequences")}
        out = {"shards": sum(len(m.shards) for m in self.manifests), "sequences": totals["sequences"],
               "steps": totals["steps"], "windows_per_epoch": p.total_windows, "dropped_windows": p.dropped_windows,
               "repeated_windows": p.repeated_windows, "batches_per_rank": p.batches_per_rank,
               "world_size": self.world()[1], "streams": p.config.num_streams, "canonical": p.config.canonical,
               "short_sequences": totals["short_sequences"], "split": self.split.split if self.split else None}
        if self.pack_length:  # rows: every rank's batches times batch_size; rows the streams leave to stay equal
            out.update(pack_length=self.pack_length, rows_per_rank=p.batches_per_rank * self.batch_size,
                       dropped_rows=p.dropped_rows)
        if len(self.sources) > 1:
            out["sources"] = [{"name": s.name, "url": s.url, "windows": q.space.total, "share": q.total_windows,
                               "repeat": round(q.total_windows / q.space.total, 4) if q.space.total else 0.0,
                               "weight": round(float(w), 6)} for s, q, w in zip(self.sources, p.sources, p.weights)]
        return out

    def __iter__(self):
        raise TypeError("a WindowDataset is iterated through streamwin.WindowLoader(dataset), which runs its "
                        "streams, batches them and keeps the position for resume")

    def __getitem__(self, index):
        raise TypeError("a WindowDataset yields whole batches, not items: use streamwin.WindowLoader(dataset) "
                        "instead of torch.utils.data.DataLoader(dataset), which would add a batch dimension")


# -- arguments: each checked once, named as the user typed it ----------------------------------------

def _explicit_world(rank: Any, world_size: Any) -> tuple[int | None, int | None]:
    """The rank and world size the user gave (None: detect them when iteration starts)."""
    if rank is not None:
        check_int("rank", rank, 0)
    if world_size is not None:
        check_int("world_size", world_size, 1)
    if rank is not None and world_size is not None and rank >= world_size:
        raise ValueError(f"rank must be < world_size ({world_size}), got {rank!r}")
    return rank, world_size
