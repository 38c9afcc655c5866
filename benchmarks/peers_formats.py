"""The peers that store records of their own format: MosaicML Streaming, LitData, Hugging Face datasets.

None of them cuts overlapping windows out of variable-length records as it iterates, so each has
two reasonable set-ups for this job, LitData a third; all are measured (peers.py shows each peer's
faster, named, and the others in a second table):

- ``mosaic-windows``: every window a sample of an MDS dataset (``MDSWriter``, column
  ``ndarray:float32:256,8``), fixed-size samples as Mosaic's docs and LLM Foundry's converters make
  them, read by ``StreamingDataset(local, shuffle=True, batch_size)`` + ``StreamingDataLoader``: its
  exact and elastic resume by sample count hold, at 4x the bytes (W / S).
- ``mosaic-seqs``: every sequence an MDS sample (``ndarray:float32``, shape per sample), read by
  ``StreamingDataset(local, shuffle=True)`` inside a :class:`~peers_systems.WindowPool` that cuts
  windows and shuffles them in a 10,000-window pool, in a plain DataLoader; its state is Mosaic's
  after the sequences taken, so the pool's windows are lost on a resume.
- ``litdata-windows`` / ``litdata-seqs``: the same two set-ups with ``litdata.optimize`` chunks and
  ``StreamingDataset(dir, shuffle=True, seed)`` (+ ``StreamingDataLoader`` for windows). Ranks are
  simulated by giving the dataset the ``_DistributedEnv`` it would detect from torch.distributed.
- ``litdata-temporal``: LitData's own window API (its README and ``examples/temporal_arrays``):
  every sequence a ``TemporalArrayLoader`` record, each window a ``read_window(record, start, W)``
  of a map-style (record, start) index over ``frame_counts``, the sampler, rank split and resume
  the application's (StatefulDataLoader(shuffle=True), a DistributedSampler for ranks).
- ``hf-arrow``: the sequences as an Arrow dataset (``Array2D((None, 8))``), every window
  materialized by a batched ``map`` into an Arrow file of ``Array2D((256, 8))`` rows,
  ``with_format("torch")``, ``split_dataset_by_node`` for ranks, torchdata's StatefulDataLoader
  (shuffle=True), which HF's docs name for mid-epoch resume.
- ``hf-stream``: parquet files of whole sequences, ``load_dataset("parquet", streaming=True)``,
  windows cut by a batched ``map`` (one row in, many out, as HF's docs split long examples),
  ``shuffle(buffer_size=10,000)``, ``split_dataset_by_node``, StatefulDataLoader.

The ranks of Mosaic read torchrun's variables and rendezvous over torch.distributed, which the
checks' rank processes provide (one node).
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from peers_systems import (Params, PoolLoader, System, WindowPool, cut, iter_sequences, shard_sequences,
                           window_index)

try:
    import data
except ImportError:  # pragma: no cover - imported as benchmarks.peers_formats
    from . import data

#: Parquet / Arrow shards of hf-* (several, so that workers and ranks each get whole files).
HF_SHARDS = 16


def _stateful_loader(dataset: Any, p: Params, workers: int, shuffle: bool, rank: int = 0, world: int = 1) -> Any:
    """torchdata's StatefulDataLoader, which HF's docs name for resuming mid-epoch; shuffled by a
    DistributedSampler where ``world`` > 1 (the map-style dataset is then every rank's)."""
    import torch  # noqa: PLC0415
    from torch.utils.data import DistributedSampler  # noqa: PLC0415
    from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: PLC0415

    options: dict[str, Any] = {}
    if shuffle and world > 1:
        options = {"sampler": DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=p.seed)}
    elif shuffle:
        options = {"shuffle": True, "generator": torch.Generator().manual_seed(p.seed)}
    return StatefulDataLoader(dataset, batch_size=p.batch_size, num_workers=workers, **options)


class MosaicWindows(System):
    """Windows as MDS samples; StreamingDataset(local, shuffle=True, batch_size) + StreamingDataLoader."""

    name, peer, setup, materializes = "mosaic-windows", "mosaic", "every window an MDS sample", True
    modules, install = ("streaming",), "pip install torch==2.13.0 mosaicml-streaming"

    def preload(self) -> None:
        _import_streaming()
        super().preload()

    def disk(self, corpus, store):
        return [store]

    def prepare(self, corpus, store, p):
        from streaming import MDSWriter  # noqa: PLC0415

        columns = {"x": f"ndarray:float32:{p.window},{_features(corpus)}"}
        with MDSWriter(out=str(store), columns=columns, size_limit=64 << 20, progress_bar=False) as out:
            for _, seq in iter_sequences(corpus):
                for window in cut(seq, p):
                    out.write({"x": np.ascontiguousarray(window)})

    def build(self, corpus, store, p, workers, rank=0, world=1):
        from streaming import StreamingDataLoader, StreamingDataset  # noqa: PLC0415

        _mosaic_world(world)
        dataset = StreamingDataset(local=str(store), shuffle=True, shuffle_seed=p.seed, batch_size=p.batch_size)
        return StreamingDataLoader(dataset, batch_size=p.batch_size, num_workers=workers)


class MosaicSeqs(MosaicWindows):
    """Sequences as MDS samples; StreamingDataset(local, shuffle=True) in a WindowPool, DataLoader."""

    name, setup, materializes = "mosaic-seqs", "every sequence an MDS sample, windows cut in a pool", False

    def prepare(self, corpus, store, p):
        from streaming import MDSWriter  # noqa: PLC0415

        with MDSWriter(out=str(store), columns={"x": "ndarray:float32"}, size_limit=64 << 20,
                       progress_bar=False) as out:
            for _, seq in iter_sequences(corpus):
                out.write({"x": np.ascontiguousarray(seq)})

    def build(self, corpus, store, p, workers, rank=0, world=1):
        from streaming import StreamingDataset  # noqa: PLC0415

        _mosaic_world(world)
        dataset = StreamingDataset(local=str(store), shuffle=True, shuffle_seed=p.seed, batch_size=1)
        state = functools.partial(_mosaic_state, dataset, world)
        return PoolLoader(WindowPool(dataset, p, "x", state, dataset.load_state_dict, rank), workers)


def _mosaic_world(world: int) -> None:
    """Mosaic reads the world from torchrun's variables: the checks' ranks set them, a lone loader here."""
    if world == 1:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")


def _mosaic_state(dataset: Any, world: int, taken: int) -> Any:
    """Mosaic's state after ``taken`` sequences of this rank (its count is over all ranks, as its
    StreamingDataLoader counts it: this rank's times the world)."""
    return dataset.state_dict(num_samples=taken * world, from_beginning=False)


def _import_streaming() -> None:
    """Import Mosaic's ``streaming``, standing in for torchvision where none loads.

    ``streaming/__init__`` imports its vision datasets, which import torchvision; PyPI's torchvision
    wheels are CUDA builds that do not load beside a CPU build of torch (and nothing here uses
    them), so where ``import torchvision`` fails, an empty module with the names those files
    import takes its place."""
    import importlib.machinery  # noqa: PLC0415
    import types  # noqa: PLC0415

    try:
        import torchvision  # noqa: F401, PLC0415
    except Exception:  # noqa: BLE001 - any failure to load it: ImportError, a missing operator
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        names = ("torchvision", "torchvision.datasets", "torchvision.transforms", "torchvision.transforms.functional")
        stubs = {n: types.ModuleType(n) for n in names}
        for n, module in stubs.items():
            module.__spec__ = importlib.machinery.ModuleSpec(n, None)
        stubs["torchvision.datasets"].VisionDataset = stubs["torchvision.datasets"].CIFAR10 = type(
            "VisionDataset", (), {})
        stubs["torchvision.transforms.functional"].to_tensor = lambda x: x
        sys.modules.update(stubs)
    import streaming  # noqa: F401, PLC0415


class LitDataWindows(System):
    """Windows as LitData items (optimize); StreamingDataset(dir, shuffle=True) + StreamingDataLoader."""

    name, peer, setup, materializes = "litdata-windows", "litdata", "every window a LitData item", True
    modules, install = ("litdata",), "pip install torch==2.13.0 litdata"

    def prepare(self, corpus, store, p):
        from litdata import optimize  # noqa: PLC0415

        optimize(fn=_LitItems(p, "windows"), inputs=data.shard_paths(corpus), output_dir=str(store),
                 chunk_bytes="64MB", num_workers=2)

    def disk(self, corpus, store):
        return [store]

    def dataset(self, store: Path, p: Params, rank: int, world: int) -> Any:
        """LitData's StreamingDataset of rank ``rank`` of ``world``."""
        from litdata import StreamingDataset  # noqa: PLC0415
        from litdata.utilities.env import _DistributedEnv  # noqa: PLC0415

        dataset = StreamingDataset(str(store), shuffle=True, seed=p.seed)
        if world > 1:
            dataset.distributed_env = _DistributedEnv(world, rank, 1)
        return dataset

    def build(self, corpus, store, p, workers, rank=0, world=1):
        from litdata import StreamingDataLoader  # noqa: PLC0415

        return StreamingDataLoader(self.dataset(store, p, rank, world), batch_size=p.batch_size, num_workers=workers)


class LitDataSeqs(LitDataWindows):
    """Sequences as LitData items; StreamingDataset(dir, shuffle=True) in a WindowPool, DataLoader."""

    name, setup, materializes = "litdata-seqs", "every sequence a LitData item, windows cut in a pool", False

    def prepare(self, corpus, store, p):
        from litdata import optimize  # noqa: PLC0415

        optimize(fn=_LitItems(p, "sequences"), inputs=data.shard_paths(corpus), output_dir=str(store),
                 chunk_bytes="64MB", num_workers=2)

    def build(self, corpus, store, p, workers, rank=0, world=1):
        dataset = self.dataset(store, p, rank, world)
        state = functools.partial(_lit_state, dataset)
        return PoolLoader(WindowPool(dataset, p, None, state, dataset.load_state_dict, rank), workers)


def _lit_state(dataset: Any, taken: int) -> Any:
    """LitData's state after ``taken`` sequences of this rank, in-process (as its StreamingDataLoader asks it)."""
    return dataset.state_dict(num_samples_yielded=taken, num_workers=0, batch_size=1)


class LitDataTemporal(LitDataWindows):
    """Sequences as TemporalArrayLoader records; a map-style (record, start) index whose items are
    ``read_window`` calls, StatefulDataLoader(shuffle) or a DistributedSampler."""

    name, setup = "litdata-temporal", "every sequence a TemporalArrayLoader record, read_window per window"
    materializes, modules = False, ("litdata", "torchdata")

    def prepare(self, corpus, store, p):
        from litdata import TemporalArrayLoader, optimize  # noqa: PLC0415

        optimize(fn=_LitItems(p, "records"), inputs=data.shard_paths(corpus), output_dir=str(store),
                 chunk_bytes="64MB", num_workers=2, item_loader=TemporalArrayLoader())

    def build(self, corpus, store, p, workers, rank=0, world=1):
        return _stateful_loader(_TemporalWindows(store, p), p, workers, shuffle=True, rank=rank, world=world)


class _TemporalWindows:
    """LitData's window example's adapter, every window once: index -> (record, start) -> read_window."""

    def __init__(self, store: Path, p: Params):
        from litdata import StreamingDataset, TemporalArrayLoader  # noqa: PLC0415

        self.records, self.window = StreamingDataset(str(store), item_loader=TemporalArrayLoader()), p.window
        self.record_of, self.start_of = window_index(self.records.frame_counts, p)

    def __len__(self) -> int:
        return len(self.record_of)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.records.read_window(int(self.record_of[index]), int(self.start_of[index]), self.window)["x"]


class _LitItems:
    """optimize's fn: one shard path in, its windows, sequences or ``{"x": sequence}`` records out
    (picklable for optimize's workers)."""

    def __init__(self, p: Params, mode: str):
        self.p, self.mode = p, mode

    def __call__(self, shard: str):
        for _, seq in shard_sequences(shard):
            if self.mode == "windows":
                yield from (np.ascontiguousarray(window) for window in cut(seq, self.p))
            else:
                yield np.ascontiguousarray(seq) if self.mode == "sequences" else {"x": np.ascontiguousarray(seq)}


def _features(corpus: Path) -> int:
    """F of the corpus (its marker's spec)."""
    import json  # noqa: PLC0415

    return int(json.loads((corpus / data.MARKER).read_text())["spec"]["features"])


def _hf_sequences(corpus: Path, out: Path) -> Any:
    """The corpus's sequences as an Arrow dataset of ``Array2D((None, F))`` rows, saved under ``out``."""
    from datasets import Array2D, Dataset, Features, Value  # noqa: PLC0415

    features = Features({"key": Value("string"), "x": Array2D((None, _features(corpus)), "float32")})
    return Dataset.from_generator(_hf_rows, gen_kwargs={"corpus": str(corpus)}, features=features,
                                  cache_dir=str(out / "cache"))


def _hf_rows(corpus: str) -> Iterator[dict[str, Any]]:
    """from_generator's generator: one row per sequence (a module-level function: HF hashes it)."""
    for key, seq in iter_sequences(Path(corpus)):
        yield {"key": key, "x": seq}


def _window_batch(p: Params):
    """A batched map function: every window of every sequence in the batch, one row each."""

    def windows(batch: dict[str, list]) -> dict[str, list]:
        out = []
        for seq in batch["x"]:
            seq = np.asarray(seq, dtype=np.float32)
            out.extend(cut(seq, p))
        return {"x": out}

    return windows


class HFArrow(System):
    """Windows materialized by Dataset.map into Arrow; with_format("torch"); StatefulDataLoader(shuffle)."""

    name, peer, setup, materializes = "hf-arrow", "hf", "every window an Arrow row (map-style)", True
    modules = ("datasets", "torchdata")
    install = "pip install torch==2.13.0 datasets torchdata"

    def prepare(self, corpus, store, p):
        from datasets import Array2D, Features  # noqa: PLC0415

        store.mkdir(parents=True, exist_ok=True)
        seqs = _hf_sequences(corpus, store)
        features = Features({"x": Array2D((p.window, _features(corpus)), "float32")})
        seqs.with_format("numpy").map(_window_batch(p), batched=True, batch_size=16, remove_columns=["key", "x"],
                                      features=features, cache_file_name=str(store / "windows.arrow"))
        import shutil  # noqa: PLC0415

        shutil.rmtree(store / "cache")  # the sequences were only the map's input

    def disk(self, corpus, store):
        return [store / "windows.arrow"]

    def build(self, corpus, store, p, workers, rank=0, world=1):
        from datasets import Dataset  # noqa: PLC0415
        from datasets.distributed import split_dataset_by_node  # noqa: PLC0415

        ds = Dataset.from_file(str(store / "windows.arrow")).with_format("torch")
        if world > 1:
            ds = split_dataset_by_node(ds, rank=rank, world_size=world)
        return _stateful_loader(ds, p, workers, shuffle=True)


class HFStream(System):
    """Parquet of whole sequences; load_dataset(streaming=True) .map(windows, batched) .shuffle(10,000)."""

    name, peer, setup = "hf-stream", "hf", "parquet of sequences, streaming=True, windows cut by map"
    modules = ("datasets", "torchdata")
    install = "pip install torch==2.13.0 datasets torchdata"

    def prepare(self, corpus, store, p):
        store.mkdir(parents=True, exist_ok=True)
        seqs = _hf_sequences(corpus, store)
        for i in range(HF_SHARDS):
            seqs.shard(HF_SHARDS, i, contiguous=True).to_parquet(str(store / f"part-{i:03d}.parquet"))
        import shutil  # noqa: PLC0415

        shutil.rmtree(store / "cache")

    def disk(self, corpus, store):
        return sorted(store.glob("*.parquet"))

    def build(self, corpus, store, p, workers, rank=0, world=1):
        from datasets import load_dataset  # noqa: PLC0415
        from datasets.distributed import split_dataset_by_node  # noqa: PLC0415

        files = [str(f) for f in sorted(store.glob("*.parquet"))]
        ds = load_dataset("parquet", data_files=files, split="train", streaming=True)
        ds = ds.with_format("numpy").map(_window_batch(p), batched=True, batch_size=16, remove_columns=["key", "x"])
        ds = ds.shuffle(seed=p.seed, buffer_size=p.shuffle_buffer)
        if world > 1:
            ds = split_dataset_by_node(ds, rank=rank, world_size=world)
        return _stateful_loader(ds.with_format("torch"), p, workers, shuffle=False)
