"""The systems peers.py compares, each set up the way its own documentation does the job.

A system is one set-up of one peer: ``prepare`` converts the benchmark corpus into the format the
set-up reads (a no-op for those that read the tar shards as they are), ``disk`` lists what it then
reads from disk, and ``build`` returns the loader of one rank. Windows are always W=256, stride 64,
batches of 256, a shuffle pool of 10,000 windows where the system has one.

- ``streamwin``: WindowDataset over the tar shards + WindowLoader; windows planned, nothing stored.
- ``webdataset``: the tar shards; decode -> per-window generator -> shuffle -> batched (WebLoader).
- ``tutorial``: all sequences in memory, one tensor per window, DataLoader(shuffle) or DistributedSampler.
- ``torchdata-nodes``: one ``.npy`` file per sequence; a map-style (file, start) index, the
  migration guide's graph SamplerWrapper -> Batcher -> ParallelMapper(get batch) -> Prefetcher -> Loader;
  "workers" are ParallelMapper's threads (its default method).

The peers that store records of their own format (MosaicML Streaming, LitData, Hugging Face
datasets) have two set-ups each, in peers_formats.py, which imports this module (never the other
way); :class:`WindowPool` is the window-cutting shuffle pool their sequence set-ups share.
"""
from __future__ import annotations

import io
import itertools
import tarfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

try:  # imported as benchmarks.peers_systems
    from . import data
except ImportError:  # run as a script: benchmarks/ is on sys.path
    import data


Params = data.WindowSetup  # the window, batch and shuffle setup of every system


def iter_sequences(corpus: Path) -> Iterator[tuple[str, np.ndarray]]:
    """``(key, array [T, F])`` of every ``<key>.npy`` member of the corpus's tar shards, in order."""
    for path in data.shard_paths(corpus):
        yield from shard_sequences(path)


def shard_sequences(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """``(key, array)`` of one tar shard's ``.npy`` members."""
    with tarfile.open(path, "r:") as tar:
        for member in tar:
            if member.isfile() and member.name.endswith(".npy"):
                payload = tar.extractfile(member).read()
                yield member.name[:-4], np.load(io.BytesIO(payload), allow_pickle=False)


def cut(seq: np.ndarray, p: Params) -> Iterator[np.ndarray]:
    """The windows of one sequence: starts 0, S, 2S, ... while start + W <= T (views)."""
    for start in range(0, len(seq) - p.window + 1, p.stride):
        yield seq[start:start + p.window]


def tree_bytes(paths: Iterable[Path]) -> int:
    """Bytes of the files under ``paths`` (files or directories)."""
    total = 0
    for path in paths:
        files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
        total += sum(f.stat().st_size for f in files)
    return total


def split_by_rank(rank: int, world: int):
    """webdataset's ``split_by_node`` with the rank given rather than read from torch.distributed."""

    def split(src: Iterable[Any]) -> Iterator[Any]:
        return itertools.islice(src, rank, None, world)

    return split


def peer_of(system: "System") -> str:
    """The library a system is a set-up of (its own name where it has one set-up)."""
    return system.peer or system.name


class WindowPool(torch.utils.data.IterableDataset):
    """Whole sequences in, shuffled batches of windows out: the wrapper a user writes around a dataset
    of sequences that cannot cut windows itself.

    Every window of each sequence goes into a pool of ``shuffle_buffer`` windows; once it is full, each
    new window takes the place of a random one, which joins the batch (webdataset's ``shuffle``, done
    on windows); batches are stacked with one ``np.stack``. Its state is the inner dataset's after the
    sequences it has taken (``state(taken)``), so a resume loses the windows still in the pool, as any
    shuffle buffer's does; with workers it has none (DataLoader gives no way to ask them)."""

    def __init__(self, sequences: Iterable[Any], p: Params, key: str | None, state: Callable[[int], Any],
                 load: Callable[[Any], None], rank: int = 0):
        self.sequences, self.p, self.key, self.rank = sequences, p, key, rank
        self.state, self.load, self.taken = state, load, 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        import random  # noqa: PLC0415

        info = torch.utils.data.get_worker_info()
        rng = random.Random(hash((self.p.seed, self.rank, info.id if info else 0)))
        pool: list[np.ndarray] = []
        batch: list[np.ndarray] = []
        for sample in self.sequences:
            self.taken += 1
            for window in cut(sample if self.key is None else sample[self.key], self.p):
                if len(pool) < self.p.shuffle_buffer:
                    pool.append(window)
                    continue
                i = rng.randrange(len(pool))
                batch.append(pool[i])
                pool[i] = window
                if len(batch) == self.p.batch_size:
                    yield torch.from_numpy(np.stack(batch))
                    batch = []
        rng.shuffle(pool)
        batch += pool
        for start in range(0, len(batch), self.p.batch_size):
            yield torch.from_numpy(np.stack(batch[start:start + self.p.batch_size]))

    def state_dict(self) -> Any:
        """The inner dataset's state after the sequences taken so far (in-process loaders only)."""
        return self.state(self.taken)

    def load_state_dict(self, state: Any) -> None:
        """Resume the inner dataset from a state of :meth:`state_dict` (the pool starts empty)."""
        self.load(state)


class PoolLoader(torch.utils.data.DataLoader):
    """DataLoader(pool, batch_size=None) whose state is the pool's (what a user adds to checkpoint it)."""

    def __init__(self, pool: WindowPool, workers: int):
        super().__init__(pool, batch_size=None, num_workers=workers)

    def state_dict(self) -> Any:
        """The pool's state (its inner dataset's after the sequences taken)."""
        return self.dataset.state_dict()

    def load_state_dict(self, state: Any) -> None:
        """Load a state of :meth:`state_dict` into the pool."""
        self.dataset.load_state_dict(state)


class System:
    """One system: how to convert the corpus, what it reads from disk, how to build a rank's loader."""

    name = ""
    peer = ""  # the library; "" means the same as name (a peer with one set-up)
    setup = ""  # the set-up in a few words, for a peer with two (the table names it)
    modules: tuple[str, ...] = ()  # what must be importable
    install = ""  # how to get it
    materializes = False  # True: each window is stored as a record

    def preload(self) -> None:
        """Import the system's modules, so that import time is not counted as set-up."""
        import importlib  # noqa: PLC0415

        import torch  # noqa: F401, PLC0415

        for module in self.modules:
            importlib.import_module(module)

    def prepare(self, corpus: Path, store: Path, p: Params) -> None:
        """Convert the corpus into this system's format under ``store`` (default: read it as is)."""

    def disk(self, corpus: Path, store: Path) -> list[Path]:
        """The files this system reads."""
        return [Path(s) for s in data.shard_paths(corpus)] + [corpus / "index.json"]

    def build(self, corpus: Path, store: Path, p: Params, workers: int, rank: int = 0,
              world: int = 1) -> Iterable[Any]:
        """The loader of rank ``rank`` of ``world``, epoch 0."""
        raise NotImplementedError

    def state(self, loader: Any) -> Any | None:
        """The loader's mid-epoch state, or None where it has no way to give one."""
        return loader.state_dict() if hasattr(loader, "state_dict") else None

    def load(self, loader: Any, state: Any) -> None:
        """Restore a state taken by :meth:`state` into a fresh loader."""
        loader.load_state_dict(state)


class Streamwin(System):
    """WindowDataset(url, window, stride, batch_size, shuffle_buffer, seed) + WindowLoader."""

    name, modules, install = "streamwin", ("streamwin",), "pip install -e ."

    def disk(self, corpus: Path, store: Path) -> list[Path]:
        return [Path(s) for s in data.shard_paths(corpus)] + [corpus / "index.json"]

    def build(self, corpus, store, p, workers, rank=0, world=1):
        import streamwin as sw  # noqa: PLC0415

        ds = sw.WindowDataset(str(corpus), window=p.window, stride=p.stride, batch_size=p.batch_size,
                              shuffle_buffer=p.shuffle_buffer, seed=p.seed, rank=rank, world_size=world)
        return sw.WindowLoader(ds, num_workers=workers)


class WebDataset(System):
    """WebDataset(urls, shardshuffle, split_by_node, split_by_worker) .decode() .compose(windows)
    .shuffle(10,000) .batched(256) in a WebLoader (baselines.py's pipeline)."""

    name, modules, install = "webdataset", ("webdataset",), "pip install webdataset"

    def disk(self, corpus, store):
        return [Path(s) for s in data.shard_paths(corpus)]

    def build(self, corpus, store, p, workers, rank=0, world=1):
        import webdataset as wds  # noqa: PLC0415

        from baselines import cut_windows  # noqa: PLC0415

        urls = data.shard_paths(corpus)
        nodes = split_by_rank(rank, world) if world > 1 else wds.split_by_node
        dataset = (wds.WebDataset(urls, shardshuffle=len(urls), seed=p.seed, nodesplitter=nodes,
                                  workersplitter=wds.split_by_worker, empty_check=False)
                   .decode().compose(cut_windows(p.window, p.stride))
                   .shuffle(p.shuffle_buffer, seed=p.seed).batched(p.batch_size))
        return wds.WebLoader(dataset, batch_size=None, num_workers=workers)


class Tutorial(System):
    """Load every sequence, list every window, DataLoader(shuffle=True) or DistributedSampler."""

    name, modules, install = "tutorial", ("torch",), "pip install torch"

    def disk(self, corpus, store):
        return [Path(s) for s in data.shard_paths(corpus)]

    def build(self, corpus, store, p, workers, rank=0, world=1):
        import torch  # noqa: PLC0415
        from torch.utils.data import DataLoader, DistributedSampler  # noqa: PLC0415

        from baselines import WindowListDataset, load_sequences  # noqa: PLC0415

        dataset = WindowListDataset(load_sequences(data.shard_paths(corpus)), p.window, p.stride)
        if world > 1:
            sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=p.seed)
            return DataLoader(dataset, batch_size=p.batch_size, sampler=sampler, num_workers=workers)
        generator = torch.Generator().manual_seed(p.seed)
        return DataLoader(dataset, batch_size=p.batch_size, shuffle=True, generator=generator,
                          num_workers=workers)


def window_index(lengths: Sequence[int], p: Params) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, start) of every window of sequences of these lengths, as two arrays (a map-style index)."""
    per_seq = [range(0, n - p.window + 1, p.stride) for n in lengths]
    seq_of = np.repeat(np.arange(len(per_seq)), [len(r) for r in per_seq])
    return seq_of, np.fromiter(itertools.chain.from_iterable(per_seq), dtype=np.int64, count=len(seq_of))


class NpyWindows:
    """Map-style windows over one ``.npy`` file per sequence: index -> (file, start), memory-mapped."""

    def __init__(self, files: list[Path], p: Params):
        self.files, self.window = [str(f) for f in files], p.window
        self.file_of, self.start_of = window_index([np.load(f, mmap_mode="r").shape[0] for f in self.files], p)
        self._open: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.file_of)

    def __getitem__(self, index: int) -> np.ndarray:
        f = int(self.file_of[index])
        if f not in self._open:
            self._open[f] = np.load(self.files[f], mmap_mode="r")
        start = int(self.start_of[index])
        return self._open[f][start:start + self.window]

    def get_batch(self, indices: list[int]) -> Any:
        """One batch: the windows stacked into a new tensor (the map_fn of the graph)."""
        import torch  # noqa: PLC0415

        return torch.from_numpy(np.stack([self[i] for i in indices]))


class TorchdataNodes(System):
    """.npy files; SamplerWrapper -> Batcher -> ParallelMapper(get_batch) -> Prefetcher -> Loader."""

    name, modules, install = "torchdata-nodes", ("torchdata.nodes",), "pip install torchdata"

    def prepare(self, corpus, store, p):
        store.mkdir(parents=True, exist_ok=True)
        for key, seq in iter_sequences(corpus):
            np.save(store / f"{key}.npy", seq)

    def disk(self, corpus, store):
        return [store]

    def build(self, corpus, store, p, workers, rank=0, world=1):
        import torch  # noqa: PLC0415
        import torchdata.nodes as tn  # noqa: PLC0415
        from torch.utils.data import DistributedSampler, RandomSampler  # noqa: PLC0415

        dataset = NpyWindows(sorted(store.glob("*.npy")), p)
        if world > 1:
            sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=p.seed)
        else:
            sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(p.seed))
        node = tn.Batcher(tn.SamplerWrapper(sampler), batch_size=p.batch_size, drop_last=False)
        if workers:
            node = tn.ParallelMapper(node, map_fn=dataset.get_batch, num_workers=workers, in_order=True)
        else:
            node = tn.Mapper(node, map_fn=dataset.get_batch)
        node = tn.Prefetcher(node, prefetch_factor=max(2, 2 * workers))
        return tn.Loader(node)
