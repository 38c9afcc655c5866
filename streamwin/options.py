"""WindowDataset's options beyond the window, in five groups a user meets one at a time.

    ds = sw.WindowDataset([url_a, url_b], window=512, stride=256, batch_size=64,  # what every dataset needs
                          crops=sw.Crops(jitter=True, pack_length=4096),          # how windows are cut and packed
                          order=sw.Order(canonical=(16, 1)),                      # how the order is drawn
                          select=sw.Select(split="train", fields=["label"]),      # which sequences, which fields
                          mix=sw.Mix(weights=[0.7, 0.3]),                         # how the datasets mix
                          read=sw.Read(cache_dir="/local/cache"))                 # how bytes are read

Each group is a frozen dataclass of keyword-only fields whose defaults are WindowDataset's,
checked when it is made: a bad value is one ValueError or TypeError that starts with the group
as the user typed it (``read=sw.Read(retries=-1): retries must be an integer >= 0, got -1``).
What a group can only be checked against the rest (``min_window <= window``, a field every
source holds, as many weights as URLs) WindowDataset checks, with the same start.
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

import numpy as np

from streamwin.arguments import MAX_STEPS, MAX_WINDOWS, check_bool, check_choice, check_int, check_keywords, is_real
from streamwin.plan.mix import Mixing, normalized
from streamwin.plan.options import AUTO, DEFAULT_CANONICAL, EQUALIZE, WindowSpec, check_canonical
from streamwin.plan.split import SplitSpec, split_spec
from streamwin.read import READAHEAD_BYTES, ReadOptions
from streamwin.selection import where_of
from streamwin.seqfields import field_names

G = TypeVar("G", bound="Group")


class Group:
    """What the option groups share: the keyword WindowDataset takes each by, and errors that name it."""

    KEYWORD: ClassVar[str]

    def typed(self) -> str:
        """The group as the user typed it, ``read=sw.Read(retries=-1)``: the fields not at their defaults
        (of ``storage_options`` the keys only: it may hold credentials)."""
        given = []
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if _same(value, f.default):
                continue
            if f.name == "storage_options" and isinstance(value, Mapping):
                given.append(f"storage_options={{{', '.join(f'{k!r}: ...' for k in value)}}}")
            else:
                given.append(f"{f.name}={value!r}")
        return f"{self.KEYWORD}=sw.{type(self).__name__}({', '.join(given)})"

    @contextmanager
    def named(self) -> Iterator[None]:
        """Re-raise a ValueError or TypeError raised inside with the group as typed in front of its message."""
        try:
            yield
        except (ValueError, TypeError) as e:
            if type(e) not in (ValueError, TypeError):
                raise
            raise type(e)(f"{self.typed()}: {e}") from None

    @classmethod
    def given(cls: type[G], value: Any) -> G:
        """The group passed to WindowDataset (None: every default), else a TypeError saying how to spell it."""
        if value is None:
            return cls()
        if not isinstance(value, cls):
            first = ", ".join(f"{f.name}=..." for f in fields(cls)[:2])  # type: ignore[arg-type]
            hint = f"{cls.KEYWORD}=sw.{cls.__name__}(**{value!r})" if isinstance(value, Mapping) else \
                f"{cls.KEYWORD}=sw.{cls.__name__}({first})"
            raise TypeError(f"{cls.KEYWORD} must be a streamwin.{cls.__name__} or None, got {value!r}: pass {hint}")
        return value


def _same(value: Any, default: Any) -> bool:
    """Whether a field holds its default (arrays and other odd values never do)."""
    if value is default:
        return True
    try:
        return type(value) is type(default) and bool(value == default)
    except (TypeError, ValueError):
        return False


@check_keywords()
@dataclass(frozen=True, kw_only=True)
class Crops(Group):
    """How windows are cut from a sequence and laid into batches, beyond the stride grid
    (docs/pretraining.md).

    Args:
        pad: give a sequence shorter than window + horizon one zero-padded window with ``batch["mask"]``.
        jitter: move each window's start by a random offset in [0, stride) (staying inside its
            sequence), drawn afresh each epoch from (seed, epoch, window); windows per sequence
            stay the grid's.
        min_window, window_multiple: draw each crop's length among the multiples of
            ``window_multiple`` in [min_window, window] (patch-aligned); batches stay ``window``
            long, right-padded with zeros, with ``batch["length"]`` and ``batch["mask"]``.
        windows_per_sequence: k crops per sequence per epoch at stratified random starts (fewer
            when a sequence has fewer than k distinct starts) instead of the stride grid.
        pack_length: rows of this many steps, each holding whole crops: ``x`` [B, L, ...],
            ``segment_ids`` and ``positions`` [B, L] (int32, 0 = padding), and per crop, flat in
            row-major order, ``key``, ``start``, ``length``, ``row`` (``source`` when mixed).
            A batch is B rows; needs horizon=0 and equalize="drop".
        missing: None, or "mask": ``batch["observed"]`` (bool, like x) says where x holds a finite
            value, and NaN and inf in x become 0.
    """

    KEYWORD: ClassVar[str] = "crops"
    pad: bool = False
    jitter: bool = False
    min_window: int | None = None
    window_multiple: int = 1
    windows_per_sequence: int | None = None
    pack_length: int | None = None
    missing: str | None = None

    def __post_init__(self) -> None:
        with self.named():
            check_bool("pad", self.pad)
            check_bool("jitter", self.jitter)
            check_int("window_multiple", self.window_multiple, 1, MAX_STEPS)
            for name in ("min_window", "windows_per_sequence", "pack_length"):
                if getattr(self, name) is not None:
                    check_int(name, getattr(self, name), 1, MAX_STEPS)
            if self.missing not in (None, "mask"):
                raise ValueError(f"missing must be None or 'mask', got {self.missing!r}")

    def window_spec(self, window: Any, stride: Any, horizon: Any) -> WindowSpec:
        """The WindowSpec of the top-level window, stride and horizon with these crops; what the crops cannot
        be with that window (min_window > window, ...) is named with the group."""
        WindowSpec(window, stride, horizon)  # the top-level arguments, named alone
        with self.named():
            return WindowSpec(window, stride, horizon, self.pad, self.jitter, self.min_window, self.window_multiple,
                              self.windows_per_sequence)


@check_keywords()
@dataclass(frozen=True, kw_only=True)
class Order(Group):
    """How an epoch's order is drawn, besides ``shuffle_buffer`` and ``seed`` (docs/concepts.md, docs/resume.md).

    Args:
        shuffle: permute slices per epoch and windows within blocks of ``shuffle_buffer``.
        slice_windows: windows per read slice (default shuffle_buffer // 8, or with zstd enough to
            span a few of the frames or members a read decompresses whole, so that each is read
            about once an epoch); smaller mixes more.
        equalize: "drop" (each window at most once, < streams * batch_size dropped) or "pad"
            (each at least once, repeats marked ``batch["weight"] == 0``).
        canonical: "auto" (default): (8, 1) for 1, 2, 4 or 8 ranks (windows or packed rows, one
            source or a mix), else None (one stream per rank and worker); (A, P): rank slots x
            step phases, the same global batches for every world that divides A (plan/canon.py).
    """

    KEYWORD: ClassVar[str] = "order"
    shuffle: bool = True
    slice_windows: int | None = None
    equalize: str = "drop"
    canonical: tuple[int, int] | str | None = DEFAULT_CANONICAL

    def __post_init__(self) -> None:
        with self.named():
            check_bool("shuffle", self.shuffle)
            if self.slice_windows is not None:
                check_int("slice_windows", self.slice_windows, 1, MAX_WINDOWS)
            check_choice("equalize", self.equalize, EQUALIZE)
            if self.canonical is not None and not (isinstance(self.canonical, str) and self.canonical == AUTO):
                object.__setattr__(self, "canonical", check_canonical(self.canonical))


@check_keywords()
@dataclass(frozen=True, kw_only=True)
class Select(Group):
    """Which sequences a dataset reads and which of their fields every batch carries (docs/integrity.md,
    docs/fields.md).

    Args:
        split: None (all data), "train", "val" or "test".
        split_fractions, split_seed: with ``holdout=0``, a sequence belongs to one split, chosen by a
            stable hash of (split_seed, key): never in two splits, stable as the dataset grows.
        holdout: H > 0 selects a temporal split instead: "train" windows (with their horizon) lie
            in steps [0, T - 2H) of every sequence; a "val" window's last target step lies in
            [T - 2H, T - H), a "test" window's in [T - H, T) (inputs may look back for context).
        where: {field: [values]}: only the sequences whose field holds one of the values; applied
            in the plan, so the other sequences' windows are never read.
        fields: per-sequence fields stored at pack time (a label, a store, a start time; see
            ``manifest.fields``) to put in every batch: ``batch[name]``, one value per window (per
            crop, flat like ``start``, with ``pack_length``); str fields as int64 codes into
            ``ds.vocabulary(name)``; ``"time"``: each window's first step's timestamp, int64,
            start + offset x freq. Names of batch keys (x, y, key, start, mask, ...) are refused.
        fill: {field: value} for sources of a mix that lack the field (else refused, naming them).
    """

    KEYWORD: ClassVar[str] = "select"
    split: str | None = None
    split_fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)
    split_seed: int = 0
    holdout: int = 0
    where: Mapping[str, Sequence[Any]] | None = None
    fields: Sequence[str] | None = None
    fill: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        with self.named():
            self.split_spec()
            where_of(self.where)
            field_names(self.fields, self.fill)

    def split_spec(self) -> SplitSpec | None:
        """The split these options select (None: all data)."""
        return split_spec(self.split, self.split_fractions, self.split_seed, self.holdout)


@check_keywords()
@dataclass(frozen=True, kw_only=True)
class Mix(Group):
    """How the datasets of a list or dict of URLs mix into every batch (docs/mixing.md).

    Args:
        weights: each source's share of the epoch and of every batch (a list, or a dict by name;
            normalized). Source i gives round(w_i * E) windows of an epoch of E (a small source
            repeats, a large one gives another subset each epoch) and floor(w_i * B) or
            ceil(w_i * B) windows of every batch. Default: each source all of its windows once,
            batches mixed in proportion.
        epoch_windows: the windows of an epoch (default: every source's, summed).
    """

    KEYWORD: ClassVar[str] = "mix"
    weights: Sequence[float] | Mapping[str, float] | None = None
    epoch_windows: int | None = None

    def __post_init__(self) -> None:
        with self.named():
            if self.epoch_windows is not None:
                check_int("epoch_windows", self.epoch_windows, 0)
            if self.weights is not None:
                _weight_values(self.weights)

    def of(self, url: Any) -> tuple[Mixing, list[str]]:
        """(the mixing, the URLs) of one URL (a mix of one), or of a list or dict of them."""
        if isinstance(url, (str, os.PathLike)):
            if self.weights is not None or self.epoch_windows is not None:
                raise ValueError(f"{self.typed()} mixes several datasets: pass url as a list or dict of URLs")
            return Mixing([str(url)], alone=True), [str(url)]
        urls = list(url.values()) if isinstance(url, Mapping) else list(url) if isinstance(url, (list, tuple)) else None
        if not urls or not all(isinstance(u, (str, os.PathLike)) for u in urls):
            raise TypeError(f"url must be a path or an fsspec URL string, or a non-empty list or dict of them, "
                            f"got {url!r}")
        if isinstance(url, Mapping) and not all(isinstance(k, str) for k in url):
            raise TypeError(f"the names of a dict of URLs must be strings, got {list(url)!r}")
        names = list(url) if isinstance(url, Mapping) else [str(u) for u in urls]
        with self.named():
            weights = None if self.weights is None else _matched(url, self.weights)
        epoch_windows = None if self.epoch_windows is None else int(self.epoch_windows)
        return Mixing(names, weights, epoch_windows), [str(u) for u in urls]


def _weight_values(weights: Any) -> list[float]:
    """The numbers of ``weights`` (a dict's values, or a flat list's), each finite and >= 0, not all 0."""
    if isinstance(weights, Mapping):
        values = list(weights.values())
    elif isinstance(weights, (str, bytes)) or not isinstance(weights, (Sequence, np.ndarray)) or np.ndim(weights) != 1:
        raise ValueError(f"weights must be a list of numbers, one per URL, or a dict by name, got {weights!r}")
    else:
        values = list(weights)
    if not all(is_real(v) for v in values):
        raise TypeError(f"weights must be numbers >= 0, got {weights!r}")
    try:
        normalized(values)
    except ValueError:
        raise ValueError(f"weights must be finite numbers >= 0, not all 0, got {weights!r}") from None
    return [float(w) for w in values]


def _matched(url: Sequence | Mapping, weights: Any) -> list[float]:
    """Weights matching the sources, in their order: a list as long as the list of URLs, or a dict with the same
    names."""
    if isinstance(url, Mapping):
        if not isinstance(weights, Mapping) or set(weights) != set(url):
            raise ValueError(f"weights must be a dict with the names of url ({sorted(url)}), got {weights!r}")
        return _weight_values([weights[k] for k in url])
    if isinstance(weights, Mapping) or len(weights) != len(url):
        raise ValueError(f"weights must be a list of {len(url)} numbers, one per URL, got {weights!r}")
    return _weight_values(weights)


@check_keywords()
@dataclass(frozen=True, kw_only=True)
class Read(Group):
    """How a dataset's bytes are read: storage, retries, bad data, the node cache, checksums, read-ahead
    (docs/integrity.md, docs/remote.md).

    Args:
        storage_options: passed to fsspec (credentials, endpoint_url, ...).
        retries: failed attempts in a row allowed per read on transient storage errors.
        retry_backoff: seconds before the first retry, doubling with each failure in a row.
        on_error: "raise" a ShardError on bad data, or "skip": only the windows whose bytes cannot
            be read become zeros with ``batch["weight"] == 0``, counted in ``loader.stats()``, and
            every rank still yields the same number of batches.
        cache_dir, cache_limit: keep verified node-local copies of remote shards (fetched once
            per node, evicted least-recently-used down to ``cache_limit`` bytes).
        verify_checksums: check every byte read against the manifest's chunk checksums (a byte that
            differs is a ShardError, or with on_error="skip" its windows weigh 0); False only to
            measure what that costs.
        readahead, readahead_bytes: blocks read ahead of the one being batched, on a thread; on
            remote storage more, as far as the latency needs, within ``readahead_bytes`` a source
            and process.
        prefetch: batches gathered ahead on another thread. Off by default: the gather holds the
            GIL, so on few cores a third thread only adds hand-offs; it can help when the training
            step leaves the GIL free for long.
    """

    KEYWORD: ClassVar[str] = "read"
    storage_options: Mapping[str, Any] | None = None
    retries: int = 5
    retry_backoff: float = 0.2
    on_error: str = "raise"
    cache_dir: str | os.PathLike | None = None
    cache_limit: int | None = None
    verify_checksums: bool = True
    readahead: int = 1
    readahead_bytes: int = READAHEAD_BYTES
    prefetch: int = 0

    def __post_init__(self) -> None:
        with self.named():
            self.options()
            check_int("readahead", self.readahead, 0)
            check_int("prefetch", self.prefetch, 0)

    def options(self) -> ReadOptions:
        """What each shard reader takes of these options (all but readahead and prefetch, the dataset's)."""
        return ReadOptions(self.storage_options, self.retries, self.retry_backoff, self.on_error, self.cache_dir,
                           self.cache_limit, self.verify_checksums, self.readahead_bytes)


GROUPS = (Crops, Order, Select, Mix, Read)
#: Each option that moved from WindowDataset's keywords into a group, with its new spelling.
MOVED = {f.name: f"{g.KEYWORD}=sw.{g.__name__}({f.name}=...)" for g in GROUPS for f in fields(g)}  # type: ignore
