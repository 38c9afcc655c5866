"""What streamwin is compared with: the pipelines users write today, and two hardware ceilings.

Every pipeline here does the same job as ``streamwin.WindowLoader``: read ``<key>.npy``
sequences from the corpus's tar shards, cut windows (W, stride S, start + W <= T), shuffle
them through a pool, and yield batches ``[B, W, F]``. Each is written the way its docs or
tutorials write it, not tuned, because the point is what a typical user gets.

- :func:`webdataset_pipeline`: WebDataset -> decode -> per-window generator -> shuffle -> batched.
- :func:`tutorial_inmemory`: load everything, list every window, DataLoader(shuffle) + default_collate.
- :func:`read_limit`: how fast the shard bytes can be read at all (bytes/s).
- :func:`copy_batches` / :func:`copy_limit`: one memcpy per batch into a reused array, the
  floor cost of delivering the window bytes (windows/s).
"""
from __future__ import annotations

import io
import mmap
import tarfile
import time
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


# --------------------------------------------------------------------------- helpers


def window_starts(length: int, window: int, stride: int) -> range:
    """Starts 0, S, 2S, ... while start + W <= T (the same rule streamwin uses, horizon 0)."""
    return range(0, length - window + 1, stride)


def batch_tensor(batch: Any) -> torch.Tensor:
    """The [B, W, F] tensor of a batch, whatever container a system yields it in."""
    if isinstance(batch, dict):
        batch = batch["x"]
    elif isinstance(batch, (list, tuple)):
        batch = batch[0]
    if isinstance(batch, np.ndarray):
        batch = torch.from_numpy(batch)
    return batch


# --------------------------------------------------------------------------- webdataset


def cut_windows(window: int, stride: int):
    """A webdataset pipeline stage yielding ``{"x": seq[s:s+W]}`` for every window of every sample.

    This is the per-window generator users write (one numpy slice and one dict per window);
    slices are views, the copy happens when ``batched`` stacks them.
    """

    def stage(samples: Iterable[dict]) -> Iterator[dict]:
        for sample in samples:
            seq = sample["npy"]
            for start in window_starts(len(seq), window, stride):
                yield {"x": seq[start:start + window]}

    return stage


def webdataset_pipeline(shard_paths: Sequence[str], window: int = 256, stride: int = 64,
                        batch_size: int = 256, shuffle_buffer: int = 10_000, seed: int = 0,
                        num_workers: int = 0) -> Iterable[dict]:
    """The idiomatic WebDataset pipeline for sliding windows, wrapped in a WebLoader.

    ``WebDataset(urls, shardshuffle, nodesplitter, workersplitter) .decode() .compose(windows)
    .shuffle(buffer) .batched(B)`` with batching inside the workers and ``batch_size=None``
    in the loader, as the webdataset docs recommend. Batches are dicts ``{"x": Tensor[B, W, F]}``
    (the loader's default_convert turns the stacked numpy array into a tensor).
    """
    import webdataset as wds  # noqa: PLC0415 - keep this module importable without it

    dataset = (
        wds.WebDataset(list(shard_paths), shardshuffle=len(shard_paths), seed=seed,
                       nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker,
                       empty_check=False)
        .decode()
        .compose(cut_windows(window, stride))
        .shuffle(shuffle_buffer, seed=seed)
        .batched(batch_size)
    )
    return wds.WebLoader(dataset, batch_size=None, num_workers=num_workers,
                         persistent_workers=False)


# --------------------------------------------------------------------------- tutorial


def load_sequences(shard_paths: Sequence[str]) -> list[np.ndarray]:
    """Read every ``.npy`` member of every shard into memory (the tutorial's first step)."""
    sequences = []
    for path in shard_paths:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                if member.isfile() and member.name.endswith(".npy"):
                    payload = tar.extractfile(member).read()
                    sequences.append(np.load(io.BytesIO(payload), allow_pickle=False))
    return sequences


class WindowListDataset(Dataset):
    """The tutorial recipe: a list with one tensor per window; ``__getitem__`` returns it.

    Windows are tensor slices of the in-memory sequences (views, as ``t[s:s+W]`` gives),
    so memory is all the data plus one tensor object per window.
    """

    def __init__(self, sequences: Iterable[np.ndarray], window: int, stride: int):
        self.windows: list[torch.Tensor] = []
        for seq in sequences:
            tensor = torch.from_numpy(seq)
            for start in window_starts(len(seq), window, stride):
                self.windows.append(tensor[start:start + window])

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.windows[index]


def tutorial_inmemory(shard_paths: Sequence[str], window: int = 256, stride: int = 64,
                      batch_size: int = 256, seed: int = 0, num_workers: int = 0,
                      distributed_sampler: bool = False) -> DataLoader:
    """Load all sequences, list all windows, and batch them with a plain DataLoader.

    ``DataLoader(shuffle=True)`` by default, or ``DistributedSampler(world 1)`` as a DDP
    script would use; default_collate stacks the window tensors. All set-up (reading the
    shards and building the window list) happens here, before the first batch.
    """
    dataset = WindowListDataset(load_sequences(shard_paths), window, stride)
    generator = torch.Generator().manual_seed(seed)
    if distributed_sampler:
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers)
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=generator,
                      num_workers=num_workers)


# --------------------------------------------------------------------------- limits


def read_limit(shard_paths: Sequence[str], block_bytes: int = 4 << 20,
               min_seconds: float = 0.5) -> dict[str, float]:
    """Read every shard file sequentially in large blocks into one reused buffer.

    Passes over all files repeat until ``min_seconds`` have elapsed (at least one pass),
    so small corpora still give a stable rate. The buffer is touched before the clock
    starts, and blocks are a few MB so the kernel's copy stays in cache. Returns
    ``{"bytes", "seconds", "bytes_per_s", "passes"}``; with a warm page cache this is the
    ceiling of getting shard bytes into the process.
    """
    buffer = mmap.mmap(-1, block_bytes)  # page-aligned: a misaligned target slows the kernel copy ~5x
    buffer.write(b"\x01" * block_bytes)  # pre-fault
    view = memoryview(buffer)
    total = passes = 0
    started = time.perf_counter()
    while True:
        for path in shard_paths:
            with open(path, "rb", buffering=0) as stream:
                while True:
                    got = stream.readinto(view)
                    if not got:
                        break
                    total += got
        passes += 1
        seconds = time.perf_counter() - started
        if seconds >= min_seconds or not total:
            break
    view.release()
    buffer.close()
    return {"bytes": float(total), "seconds": seconds, "bytes_per_s": total / max(seconds, 1e-9),
            "passes": float(passes)}


def copy_batches(n_windows: int, window: int = 256, features: int = 8, batch_size: int = 256,
                 dtype: np.dtype | str = np.float32,
                 source_bytes: int = 256 << 20) -> Iterator[dict[str, torch.Tensor]]:
    """Return an iterator of ``{"x": Tensor[B, W, F]}`` batches made by one memcpy each.

    Each batch is copied into one reused array from a ``source_bytes`` buffer (larger
    than any CPU cache) walked batch by batch, so each copy reads memory as a real gather
    would. The source is allocated and filled here, before iteration, so that iterating
    measures only the copies: the cost floor of delivering the window bytes; anything a
    pipeline adds is overhead above it.
    """
    dtype = np.dtype(dtype)
    per_batch = batch_size * window * features
    n_slots = max(1, source_bytes // (per_batch * dtype.itemsize))
    source = np.full(n_slots * per_batch, 1.0, dtype=dtype)
    out = np.ones((batch_size, window, features), dtype=dtype)

    def batches() -> Iterator[dict[str, torch.Tensor]]:
        flat_out = out.reshape(-1)
        tensor = torch.from_numpy(out)
        remaining, slot = n_windows, 0
        while remaining > 0:
            np.copyto(flat_out, source[slot * per_batch:(slot + 1) * per_batch])
            slot = (slot + 1) % n_slots
            take = min(batch_size, remaining)
            remaining -= take
            yield {"x": tensor if take == batch_size else tensor[:take]}

    return batches()


def copy_limit(n_windows: int = 2_000_000, window: int = 256, features: int = 8,
               batch_size: int = 256, dtype: np.dtype | str = np.float32) -> dict[str, float]:
    """Windows/s of :func:`copy_batches` with nothing else in the loop (setup not timed)."""
    batches = copy_batches(n_windows, window, features, batch_size, dtype)
    count = 0
    started = time.perf_counter()
    for batch in batches:
        count += batch["x"].shape[0]
    seconds = time.perf_counter() - started
    return {"windows": float(count), "seconds": seconds, "windows_per_s": count / max(seconds, 1e-9)}
