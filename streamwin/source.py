"""A source: one dataset of a mix (the whole of an unmixed one), as the loader sees it.

It holds the URL and name, and loads once, when first asked: the manifest (mapping a remote
columnar one from the node cache, so a node keeps one copy), and the window space of the
dataset's window spec and split. It opens the shard reader a stream reads blocks with.
Pickled into a worker process it carries the window space's scan (1/64 of a window-start
array), never the manifest: the worker maps the manifest itself and does not rescan.

A dataset may grow while a loader runs (appends, formats/growth.py). A source plans on the
view of the dataset its manifest held when first loaded (``view``): a worker that loads a
manifest grown since plans on that same view of it (``Growth.lengths_at``), and a state
saved on an earlier view resumes its epoch on that one (``space_at``).
"""
from __future__ import annotations

import numpy as np

from streamwin.errors import ManifestError, StateMismatchError
from streamwin.formats.manifest import Manifest
from streamwin.plan.options import WindowSpec
from streamwin.plan.space import WindowSpace
from streamwin.plan.split import SplitSpec, split_views
from streamwin.read import ReadOptions, ShardReader
from streamwin.seqfields import keep_mask
from streamwin.storage.cache import ShardCache
from streamwin.storage.manifests import load_manifest


class Source:
    """One dataset of a mix: its URL, manifest and window space (each loaded once), and its shard reader."""

    def __init__(self, url: str, name: str, spec: WindowSpec, split: SplitSpec | None, read: ReadOptions,
                 where: dict | None = None, fill: dict | None = None):
        self.url, self.name, self.spec, self.split, self.read = url, name, spec, split, read
        self.where, self.fill = where, fill  # keep only the sequences whose fields hold these values
        self._keep: np.ndarray | bool | None = None
        self._manifest: Manifest | None = None
        self._space: WindowSpace | None = None
        self._coarse: tuple[str, np.ndarray] | None = None  # (manifest digest, a WindowSpace's scan) from the trainer
        self._idle: list[ShardReader] = []  # readers streams gave back, for the next stream of this process
        self._last: tuple | None = None  # (plan config, epoch) of this process's last stream
        self.view: str | None = None  # the view of the dataset the source plans on (its first manifest's)
        self._spaces: dict[str, WindowSpace] = {}  # the window spaces of earlier views (states saved before growth)

    @property
    def manifest(self) -> Manifest:
        """The source's manifest, loaded on first use."""
        if self._manifest is None:
            cache = self.cache()  # a remote columnar manifest is mapped from the node cache: one copy per node
            m = load_manifest(self.url, self.read.storage_options, retries=self.read.retries,
                              backoff=self.read.retry_backoff, fetch_columns=cache.fetch if cache else None)
            if self.view is None:
                self.view = m.view_id()
            elif self.view != m.view_id() and (m.growth is None or m.growth.index(self.view) is None):
                raise ManifestError(f"{self.url} was packed anew while this loader ran (its index.json is no longer a "
                                    f"growth of the one it loaded first, view {self.view}): start the loader again")
            self._manifest = m
        return self._manifest

    def cache(self) -> ShardCache | None:
        """The node cache of remote shards (and columns files), if ``cache_dir`` was given."""
        if self.read.cache_dir is None:
            return None
        return ShardCache(self.read.cache_dir, limit_bytes=self.read.cache_limit, retries=self.read.retries,
                          backoff=self.read.retry_backoff)

    @property
    def space(self) -> WindowSpace:
        """The source's window space, built once (before a loader forks its workers, who share it)."""
        if self._space is None:
            m = self.manifest
            lengths = self.lengths(self.view)
            shipped = self._coarse[1] if self._coarse is not None and self._coarse[0] == m.digest else None
            views = None if self.split is None and not self.where else (lambda seqs: self._views_of(seqs, lengths))
            self._space = WindowSpace(lengths, self.spec, views, coarse=shipped)
            self._coarse = None
        return self._space

    def space_at(self, view: str | None) -> WindowSpace:
        """The window space of an earlier view of the dataset (a state saved before it grew), or ``space``."""
        if view is None or view == self.view:
            return self.space
        if view not in self._spaces:
            lengths = self.lengths(view)
            views = None if self.split is None and not self.where else (lambda seqs: self._views_of(seqs, lengths))
            self._spaces[view] = WindowSpace(lengths, self.spec, views)
        return self._spaces[view]

    def lengths(self, view: str | None) -> np.ndarray:
        """Each sequence's steps in a view of the dataset (0 for sequences appended after it)."""
        m = self.manifest
        if view is None or view == m.view_id():
            return m.length
        v = m.growth.index(view) if m.growth is not None else None
        if v is None:
            raise StateMismatchError(f"cannot plan on view {view} of {self.url}: its manifest holds the views "
                                     f"{', '.join(m.growth.views) if m.growth else m.digest}; the state was saved on "
                                     "another dataset, or on a later view than this loader loaded (load it anew)")
        return m.growth.lengths_at(m.length, v)

    def _views_of(self, seqs: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(first step, steps) of the split's part of sequences ``seqs``, none of those ``where`` excludes."""
        m = self.manifest
        if self.split is not None:
            lo, steps = split_views(self.split, lengths, m.key_blob, m.key_ends, self.spec.window,
                                    span=self.spec.span, seqs=seqs)
        else:
            steps = np.asarray(lengths[seqs], dtype=np.int64)
            lo = np.zeros_like(steps)
        if self.where:
            if self._keep is None:
                self._keep = keep_mask(self.where, m.fields, self.url, self.fill)
            keep = self._keep if isinstance(self._keep, bool) else self._keep[seqs]
            steps = np.where(keep, steps, 0)
        return lo, steps

    def reader(self) -> ShardReader:
        """A reader of the source's shards (with its node cache, retries and error policy): the one its last stream in
        this process gave back (``give_back``), with what it holds (connections, sums, members checked, the next
        epoch's first blocks started early), or a new one."""
        return self._idle.pop() if self._idle else ShardReader(self.url, self.manifest, self.read)

    def follows(self, config, epoch: int) -> bool:
        """Whether this process's last stream of the source was of the epoch before ``epoch`` under ``config`` (a
        process that reads epoch after epoch: worth reading the next one's first blocks early); notes this one."""
        last, self._last = self._last, (config, epoch)
        return last == (config, epoch - 1)

    def give_back(self, reader: ShardReader) -> None:
        """A stream is done with ``reader``: the next one takes it (a block read still on its thread runs first)."""
        self._idle.append(reader)

    def close_readers(self) -> None:
        """Stop the threads and connections of the readers given back (a later stream starts a new one)."""
        while self._idle:
            self._idle.pop().shutdown(wait=False)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_manifest"] = None  # spawned workers reload (map) it; never ship a 100 MB index through a pipe
        state["_keep"] = None  # remade from the mapped manifest
        state["_idle"], state["_last"] = [], None  # readers (threads, connections) and streams are a process's own
        state["_space"] = None  # its coarse scan travels instead (1/64 of a window-start array): no rescan there
        state["_spaces"] = {}
        if self._space is not None:  # the scan of this very manifest: a worker that maps another one rescans
            state["_coarse"] = (self._manifest.digest, self._space.coarse)
        return state


def dataset_inputs(sources: tuple[Source, ...], single: bool) -> dict:
    """The plan inputs that name the data: ``dataset``, each source as first packed (its manifest's digest then,
    however it grew), and ``view``, the view of it planned on, for datasets that grew (absent for the others)."""
    firsts = [s.manifest.lineage() for s in sources]
    out = {"dataset": firsts[0] if single else firsts}
    views = [s.view if s.manifest.growth is not None else None for s in sources]
    if any(v is not None for v in views):
        out["view"] = views[0] if single else views
    return out


def views_named(inputs: dict, count: int) -> list[str | None]:
    """Per source, the view of the dataset plan ``inputs`` name: their ``view``, or for a state saved before the
    dataset grew its first view, the ``dataset`` digest."""
    first, view = inputs.get("dataset"), inputs.get("view")
    firsts = first if isinstance(first, list) else [first] * count
    views = view if isinstance(view, list) else [view] * count
    return [v if v is not None else f for v, f in zip(views, firsts)]
