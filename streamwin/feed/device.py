"""Device mode: each block's bytes travel to the device once, and windows are cut there.

The read-ahead thread reads (or maps) a block as usual, copies its bytes and its window
table (offsets, starts, flags) into one page-locked staging buffer, and starts a single
upload on a side CUDA stream. Per batch the trainer's thread then only queues one gather
per field (``index_select`` over a byte-row view of the block, exactly as the CPU gather
does), so a step pays a few kernel launches, never a copy, and overlapping windows
(stride < window) cross PCIe once instead of window/stride times.

Batches are bit for bit those of the CPU path. With ``device="cpu"`` the same code runs
on the CPU (that is how CI tests it). A mixed dataset's blocks carry their source: one
gather spans several sources' blocks, and ``batch["source"]`` is cut on the device from a
small id tensor made once (no per-batch upload). Device memory holds at most the blocks in flight:
the one being batched, ``readahead`` ahead, and one whose last batch may still be in use;
``stats()`` reports the peak.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from streamwin.batch import BatchKeys
from streamwin.read import Block


@dataclass
class DeviceBlock:
    """A block on the device: its bytes and window table, plus what the keys need on the CPU."""

    buf: torch.Tensor  # uint8, the block's bytes
    offs: torch.Tensor  # int64, byte offset of each window in buf
    start: torch.Tensor  # int64
    valid: torch.Tensor  # int64, steps of window + horizon inside the sequence
    weight: torch.Tensor  # float32, 1 for real windows, 0 for repeats and skipped ones
    valid_cpu: np.ndarray
    seq: np.ndarray  # manifest index of each window's sequence (for the keys)
    ready: Any = None  # CUDA event: the upload is done
    source: int = 0  # a mixed dataset's source the block belongs to
    waited: bool = False  # the trainer's stream waits for ``ready`` (once)
    rows: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.valid_cpu)


TABLE_BYTES = 36  # per window: offset, start, valid steps, sequence (int64 each), weight (float32)


def window_table(block: Block) -> np.ndarray:
    """A block's window table as bytes: what the device needs to cut, mask and weigh its windows."""
    cols = [block.offs.astype(np.int64, copy=False), block.start.astype(np.int64, copy=False),
            block.valid.astype(np.int64, copy=False), np.take(block.seq_ids, block.key_index).astype(np.int64),
            block.real.astype(np.float32)]
    return np.concatenate([c.view(np.uint8) for c in cols])


def table_at(nbytes: int) -> int:
    """Where a block's window table starts in its device buffer: after its bytes, 8-byte aligned."""
    return nbytes + (-nbytes % 8)


def device_block(dev: torch.Tensor, nbytes: int, table: np.ndarray, ready=None, source: int = 0) -> DeviceBlock:
    """A DeviceBlock over ``dev`` (bytes, then the table at ``table_at``); ``table`` is the table's CPU copy."""
    w = len(table) // TABLE_BYTES
    t, at = dev[table_at(nbytes) : table_at(nbytes) + len(table)], 8 * w
    cpu = table[: 32 * w].view(np.int64)
    return DeviceBlock(buf=dev[:nbytes], offs=t[:at].view(torch.int64), start=t[at : 2 * at].view(torch.int64),
                       valid=t[2 * at : 3 * at].view(torch.int64), weight=t[4 * at :].view(torch.float32),
                       valid_cpu=cpu[2 * w : 3 * w], seq=cpu[3 * w : 4 * w], ready=ready, source=source)


class DeviceBytes:
    """Counts the blocks uploaded and the device bytes they hold while alive (the peak is reported)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.live_bytes = self.peak_bytes = self.uploaded_bytes = self.blocks = 0

    def count(self, dev: torch.Tensor, nbytes: int) -> None:
        """Account a block's device bytes until the tensor is freed."""
        with self._lock:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.uploaded_bytes += nbytes
            self.blocks += 1
        weakref.finalize(dev, self._freed, nbytes)

    def _freed(self, nbytes: int) -> None:
        with self._lock:
            self.live_bytes -= nbytes


class Uploader:
    """Runs on a read-ahead thread: a CPU Block of source ``index`` in, a DeviceBlock out (the CPU block released
    to its ``reader``).

    A mixed stream has one per source (each on its reader's thread); ``counter`` may be shared.
    """

    def __init__(self, device: torch.device, reader, counter: DeviceBytes, index: int = 0, staging: int = 2):
        self.device, self.reader, self.counter, self.index = device, reader, counter, index
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._staging: list[list] = [[None, None] for _ in range(staging)]  # [pinned tensor, event of its last copy]
        self._next = 0

    def __call__(self, block: Block) -> DeviceBlock:
        n, table = len(block.buf), window_table(block)
        at = table_at(n)
        total = at + len(table)
        dev, host = self._upload_buffers(total)
        np.copyto(host[:n], block.buf)  # page cache -> (page-locked) memory, without the GIL
        host[at:total] = table
        ready = None
        if self.cuda:
            with torch.cuda.stream(self.stream):
                dev.copy_(self._host_tensor[:total], non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self.stream)
            self._slot[1] = ready
        self.reader.release(block)
        self.counter.count(dev, total)
        return device_block(dev, n, table, ready, self.index)

    def _upload_buffers(self, total: int) -> tuple[torch.Tensor, np.ndarray]:
        """(the block's device buffer, host memory to fill): on the CPU they are one and the same."""
        if not self.cuda:
            dev = torch.empty(total, dtype=torch.uint8)
            return dev, dev.numpy()
        self._host_tensor, self._slot = self._stage(total)
        with torch.cuda.stream(self.stream):
            dev = torch.empty(total, dtype=torch.uint8, device=self.device)
        return dev, self._host_tensor.numpy()

    def _stage(self, nbytes: int) -> tuple[torch.Tensor, list]:
        """A page-locked buffer of at least ``nbytes`` whose previous upload has finished."""
        slot = self._staging[self._next]
        self._next = (self._next + 1) % len(self._staging)
        if slot[1] is not None:
            slot[1].synchronize()  # this thread waits, never the trainer's
        if slot[0] is None or slot[0].numel() < nbytes:
            slot[0] = torch.empty(nbytes + nbytes // 4, dtype=torch.uint8, pin_memory=True)
        return slot[0], slot


class DeviceGatherer:
    """Cuts a batch's windows out of DeviceBlocks on the device; returns the batch dict."""

    def __init__(self, manifests: list, spec, device: torch.device, with_weight: bool, batch_size: int):
        """``manifests``: one per source (with several, batches get ``source``)."""
        self.manifests, self.spec, self.device, self.with_weight = manifests, spec, device, with_weight
        manifest = manifests[0]
        self.sb = manifest.step_bytes
        self.dtype = torch.from_numpy(np.zeros(0, dtype=manifest.dtype)).dtype
        self.step_shape = tuple(manifest.step_shape)
        self._ranges = {n: torch.arange(n, device=device) for n in {spec.window, spec.horizon} if n}
        # source i's ids are rows [i * B, (i + 1) * B): a part's source column is a slice, cut on the device
        self._ids = None if len(manifests) == 1 else \
            torch.arange(len(manifests), dtype=torch.int64, device=device).repeat_interleave(batch_size)
        self._b = batch_size

    def gather(self, parts: list[tuple[DeviceBlock, int, int]], out=None, counts=None) -> dict[str, Any]:
        """The batch of the windows ``lo:hi`` of each part, cut on the device (``out`` and ``counts`` are unused:
        the device allocates, and each block knows its source)."""
        spec = self.spec
        for b, _, _ in parts:
            if not b.waited:  # the trainer's stream waits for the upload (on the device, not here)
                if b.ready is not None:
                    stream = torch.cuda.current_stream(self.device)
                    stream.wait_event(b.ready)
                    b.buf.record_stream(stream)
                b.waited = True
        batch: dict[str, Any] = {"x": self._take(parts, 0, spec.window)}
        if spec.horizon:
            batch["y"] = self._take(parts, spec.window * self.sb, spec.horizon)
        if spec.pad:
            valid = self._cat(parts, "valid")
            batch["mask"] = self._ranges[spec.window] < valid[:, None]
            if spec.horizon:
                batch["y_mask"] = self._ranges[spec.horizon] < (valid - spec.window)[:, None]
            if any((b.valid_cpu[lo:hi] < spec.span).any() for b, lo, hi in parts):  # zero past a short sequence
                batch["x"].masked_fill_(~_expand(batch["mask"], batch["x"]), 0)
                if spec.horizon:
                    batch["y"].masked_fill_(~_expand(batch["y_mask"], batch["y"]), 0)
        batch["start"] = self._cat(parts, "start")
        seq = np.concatenate([b.seq[lo:hi] for b, lo, hi in parts])
        source = None if self._ids is None else \
            np.concatenate([np.full(hi - lo, b.source, dtype=np.int64) for b, lo, hi in parts])
        batch["key"] = BatchKeys(manifests=self.manifests, seq=seq, source=source)
        if self.with_weight:
            batch["weight"] = self._cat(parts, "weight")
        if self._ids is not None:  # a copy even for one part: the id tensor is reused by every batch
            batch["source"] = torch.cat([self._ids[b.source * self._b : b.source * self._b + hi - lo]
                                         for b, lo, hi in parts])
        return batch

    def _cat(self, parts, name: str) -> torch.Tensor:
        if len(parts) == 1:
            b, lo, hi = parts[0]
            return getattr(b, name)[lo:hi]
        return torch.cat([getattr(b, name)[lo:hi] for b, lo, hi in parts])

    def _take(self, parts, shift: int, steps: int) -> torch.Tensor:
        nbytes = steps * self.sb
        pieces = [torch.index_select(_rows(b, shift, nbytes), 0, b.offs[lo:hi]) for b, lo, hi in parts]
        raw = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return raw.view(self.dtype).view((len(raw), steps) + self.step_shape)


def _rows(b: DeviceBlock, shift: int, nbytes: int) -> torch.Tensor:
    """Row i = the ``nbytes`` bytes of the block from byte ``shift + i`` (a view, made once per block)."""
    key = (shift, nbytes)
    rows = b.rows.get(key)
    if rows is None:
        buf = b.buf[shift:]
        rows = b.rows[key] = buf.as_strided((max(len(buf) - nbytes + 1, 0), nbytes), (1, 1))
    return rows


def _expand(mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A [B, steps] mask broadcast over x's feature dimensions."""
    return mask.view(mask.shape + (1,) * (x.dim() - 2)).expand_as(x)
