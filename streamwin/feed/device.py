"""In-process device mode (``num_workers=0``): each block's bytes travel to the device once, and
windows are cut there, so the trainer's thread never gathers on the CPU.

The read-ahead thread reads (or maps) a block as usual, copies its bytes and its window
table (offsets, starts, flags) into one page-locked staging buffer, and starts a single
upload on a side CUDA stream. Per batch the trainer's thread then only queues one gather
per field (``index_select`` over a byte-row view of the block, exactly as the CPU gather
does), so a step pays a few kernel launches, never a copy, and overlapping windows
(stride < window) cross PCIe once instead of window/stride times.

Batches are bit for bit those of the CPU path. With ``device="cpu"`` the same code runs
on the CPU (that is how CI tests it). Blocks cut into crops (drawn lengths, packed rows)
carry a longer table (``crop_table``: lengths, row offsets, row starts), and their windows
and rows are cut on the device too (device_crops.py). A mixed dataset's blocks carry their source: one
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
import streamwin.feed.device_crops as dc
from streamwin.crop_stage import CropBlock, release_of
from streamwin.feed.device_fields import DeviceFields
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
    length: torch.Tensor | None = None  # crops: int64 steps of each crop
    offset: torch.Tensor | None = None  # packed: patch where each crop starts in its row
    row_ptr: torch.Tensor | None = None  # packed: row r holds crops row_ptr[r]:row_ptr[r + 1]
    length_cpu: np.ndarray | None = None
    row_ptr_cpu: np.ndarray | None = None
    seq_dev: torch.Tensor | None = None  # int64, each window's (crop's) sequence, on the device (fields)

    def __len__(self) -> int:
        return len(self.row_ptr_cpu) - 1 if self.row_ptr_cpu is not None else len(self.valid_cpu)

    def crops(self, lo: int, hi: int) -> tuple[int, int]:
        """The crops of items [lo, hi): rows when packed, else crops themselves."""
        if self.row_ptr_cpu is None:
            return lo, hi
        return int(self.row_ptr_cpu[lo]), int(self.row_ptr_cpu[hi])


TABLE_BYTES = 36  # per window: offset, start, valid steps, sequence (int64 each), weight (float32)


def window_table(block: Block | CropBlock) -> np.ndarray:
    """A block's window table as bytes: what the device needs to cut, mask and weigh its windows."""
    if isinstance(block, CropBlock):
        return crop_table(block)
    cols = [block.offs.astype(np.int64, copy=False), block.start.astype(np.int64, copy=False),
            block.valid.astype(np.int64, copy=False), np.take(block.seq_ids, block.key_index).astype(np.int64),
            block.real.astype(np.float32)]
    return np.concatenate([c.view(np.uint8) for c in cols])


def crop_table(block: CropBlock) -> np.ndarray:
    """A CropBlock's table as bytes: [crops, rows (-1: unpacked)], then per crop offset, start, valid steps,
    sequence, length, patch in its row (int64 each), the rows' first crops (packed), weight (float32)."""
    n = len(block.offs)
    head = np.array([n, len(block) if block.packed else -1], dtype=np.int64)
    offset = block.offset if block.packed else np.zeros(n, dtype=np.int64)
    cols = [head] + [np.asarray(c).astype(np.int64, copy=False) for c in
                     (block.offs, block.start, block.valid, block.seq, block.length, offset)]
    cols += ([block.row_ptr.astype(np.int64, copy=False)] if block.packed else []) + [block.real.astype(np.float32)]
    return np.concatenate([c.view(np.uint8) for c in cols])


def table_at(nbytes: int) -> int:
    """Where a block's window table starts in its device buffer: after its bytes, 8-byte aligned."""
    return nbytes + (-nbytes % 8)


def device_block(dev: torch.Tensor, nbytes: int, table: np.ndarray, ready=None, source: int = 0,
                 crops: bool = False) -> DeviceBlock:
    """A DeviceBlock over ``dev`` (bytes, then the table at ``table_at``); ``table`` is the table's CPU copy
    (``crop_table``'s when ``crops``)."""
    t = dev[table_at(nbytes) : table_at(nbytes) + len(table)]
    if crops:
        return _crop_block(dev[:nbytes], t, table, ready, source)
    w = len(table) // TABLE_BYTES
    at = 8 * w
    cpu = table[: 32 * w].view(np.int64)
    return DeviceBlock(buf=dev[:nbytes], offs=t[:at].view(torch.int64), start=t[at : 2 * at].view(torch.int64),
                       valid=t[2 * at : 3 * at].view(torch.int64), weight=t[4 * at :].view(torch.float32),
                       valid_cpu=cpu[2 * w : 3 * w], seq=cpu[3 * w : 4 * w], ready=ready, source=source,
                       seq_dev=t[3 * at : 4 * at].view(torch.int64))


def _crop_block(buf: torch.Tensor, t: torch.Tensor, table: np.ndarray, ready, source: int) -> DeviceBlock:
    """The DeviceBlock of a ``crop_table``: its columns viewed on the device, the ones the CPU reads copied."""
    n, rows = (int(v) for v in table[:16].view(np.int64))
    col = [t[16 + 8 * n * k : 16 + 8 * n * (k + 1)].view(torch.int64) for k in range(6)]
    cpu = table[16 : 16 + 48 * n].view(np.int64).reshape(6, n)
    at = 16 + 48 * n + (8 * (rows + 1) if rows >= 0 else 0)
    ptr = t[16 + 48 * n : at].view(torch.int64) if rows >= 0 else None
    return DeviceBlock(buf=buf, offs=col[0], start=col[1], valid=col[2], weight=t[at : at + 4 * n].view(torch.float32),
                       valid_cpu=cpu[2], seq=cpu[3], ready=ready, source=source, length=col[4], offset=col[5],
                       row_ptr=ptr, length_cpu=cpu[4], seq_dev=col[3],
                       row_ptr_cpu=table[16 + 48 * n : at].view(np.int64) if rows >= 0 else None)


class DeviceBytes:
    """Counts the blocks uploaded and the device bytes they hold while alive (the peak is reported), and the
    times an upload waited for the device (its staging buffer still being copied from)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.live_bytes = self.peak_bytes = self.uploaded_bytes = self.blocks = self.waits = 0

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

    def __call__(self, block: Block | CropBlock) -> DeviceBlock:
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
        self.reader.release(release_of(block))
        self.counter.count(dev, total)
        return device_block(dev, n, table, ready, self.index, crops=isinstance(block, CropBlock))

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
        if slot[1] is not None and not slot[1].query():
            self.counter.waits += 1
            slot[1].synchronize()  # this thread waits, never the trainer's
        if slot[0] is None or slot[0].numel() < nbytes:
            slot[0] = torch.empty(nbytes + nbytes // 4, dtype=torch.uint8, pin_memory=True)
        return slot[0], slot


class DeviceGatherer:
    """Cuts a batch's windows (or packed rows) out of DeviceBlocks on the device; returns the batch dict."""

    def __init__(self, manifests: list, spec, device: torch.device, with_weight: bool, batch_size: int,
                 pack_length: int | None = None, missing: bool = False, fields: DeviceFields | None = None):
        """``manifests``: one per source (with several, batches get ``source``); ``fields``: per-sequence fields."""
        self.manifests, self.spec, self.device, self.with_weight = manifests, spec, device, with_weight
        self.fields = fields
        self.pack_length, self.missing = pack_length, missing
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
        """The batch of the items ``lo:hi`` of each part (windows, or packed rows), cut on the device (``out``
        and ``counts`` are unused: the device allocates, and each block knows its source)."""
        spec = self.spec
        for b, _, _ in parts:
            if not b.waited:  # the trainer's stream waits for the upload (on the device, not here)
                if b.ready is not None:
                    stream = torch.cuda.current_stream(self.device)
                    stream.wait_event(b.ready)
                    b.buf.record_stream(stream)
                b.waited = True
        batch = self._gather_rows(parts) if self.pack_length else self._gather_windows(parts)
        if self.fields is not None:
            self.fields.fill(batch, dc.cat(parts, "seq_dev", crops=bool(self.pack_length)), batch.get("source"))
        return batch

    def _gather_windows(self, parts: list[tuple[DeviceBlock, int, int]]) -> dict[str, Any]:
        """The windows ``lo:hi`` of each part, cut on the device."""
        spec = self.spec
        batch: dict[str, Any] = {"x": self._take(parts, 0, spec.window)}
        if spec.variable:
            self._crop_steps(parts, batch)
        elif spec.horizon:
            batch["y"] = self._take(parts, spec.window * self.sb, spec.horizon)
        if spec.pad and not spec.variable:
            valid = dc.cat(parts, "valid")
            batch["mask"] = self._ranges[spec.window] < valid[:, None]
            if spec.horizon:
                batch["y_mask"] = self._ranges[spec.horizon] < (valid - spec.window)[:, None]
            if any((b.valid_cpu[lo:hi] < spec.span).any() for b, lo, hi in parts):  # zero past a short sequence
                batch["x"].masked_fill_(~dc.expand(batch["mask"], batch["x"]), 0)
                if spec.horizon:
                    batch["y"].masked_fill_(~dc.expand(batch["y_mask"], batch["y"]), 0)
        if self.missing:
            batch["observed"] = dc.observe(batch["x"], batch.get("mask"))
            if spec.horizon:
                batch["y_observed"] = dc.observe(batch["y"], batch.get("y_mask"))
        batch["start"] = dc.cat(parts, "start")
        self._keys(parts, batch, [lo for _, lo, _ in parts], [hi for _, _, hi in parts])
        if self.with_weight:
            batch["weight"] = dc.cat(parts, "weight")
        if self._ids is not None:  # a copy even for one part: the id tensor is reused by every batch
            batch["source"] = torch.cat([self._ids[b.source * self._b : b.source * self._b + hi - lo]
                                         for b, lo, hi in parts])
        return batch

    def _keys(self, parts, batch: dict[str, Any], lo: list[int], hi: list[int]) -> None:
        """``batch["key"]`` of windows (or crops) ``lo[k]:hi[k]`` of each part's block, by source when mixed."""
        seq = np.concatenate([b.seq[a:z] for (b, _, _), a, z in zip(parts, lo, hi)])
        source = None if self._ids is None else \
            np.concatenate([np.full(z - a, b.source, dtype=np.int64) for (b, _, _), a, z in zip(parts, lo, hi)])
        batch["key"] = BatchKeys(manifests=self.manifests, seq=seq, source=source)

    def _crop_steps(self, parts, batch: dict[str, Any]) -> None:
        """Drawn lengths: ``length``, ``mask``, steps past each crop zeroed, the horizon after it (as batch.py)."""
        spec, x = self.spec, batch["x"]
        length = batch["length"] = dc.cat(parts, "length")
        mask = batch["mask"] = self._ranges[spec.window] < length[:, None]
        if any((b.length_cpu[lo:hi] < spec.window).any() for b, lo, hi in parts):
            x.masked_fill_(~dc.expand(mask, x), 0)
        if not spec.horizon:
            return
        nbytes = spec.horizon * self.sb
        pieces = [torch.index_select(dc.byte_rows(b, 0, nbytes), 0, b.offs[lo:hi] + b.length[lo:hi] * self.sb)
                  for b, lo, hi in parts]
        y = batch["y"] = self._shaped(pieces[0] if len(pieces) == 1 else torch.cat(pieces), spec.horizon)
        if spec.pad:
            y_mask = batch["y_mask"] = self._ranges[spec.horizon] < (dc.cat(parts, "valid") - length)[:, None]
            y.masked_fill_(~dc.expand(y_mask, y), 0)

    def _gather_rows(self, parts) -> dict[str, Any]:
        """Packed rows: patches of every row in one copy per part, then segments, positions and the crop table."""
        spec, steps = self.spec, self.pack_length
        p, sb = spec.window_multiple, self.sb
        per_row, rows = steps // p, sum(hi - lo for _, lo, hi in parts)
        pieces, firsts, ranks, row_of, c_lo, c_hi, at = [], [], [], [], [], [], 0
        for b, lo, hi in parts:
            c0, c1 = b.crops(lo, hi)
            row, rank = dc.crop_rows(b.row_ptr, lo, hi, c1 - c0)
            row = row + (at - lo)
            size = (b.length[c0:c1] + p - 1) // p
            patches = int(((b.length_cpu[c0:c1] + p - 1) // p).sum())
            index = dc.patch_index(b.offs[c0:c1], (row - at) * per_row + b.offset[c0:c1], size, patches, p * sb,
                                   (hi - lo) * per_row, len(b.buf) - spec.span * sb)
            pieces.append(torch.index_select(dc.byte_rows(b, 0, p * sb), 0, index))
            firsts.append(row * steps + b.offset[c0:c1] * p)
            ranks.append(rank)
            row_of.append(row)
            c_lo.append(c0)
            c_hi.append(c1)
            at += hi - lo
        x = self._shaped(pieces[0] if len(pieces) == 1 else torch.cat(pieces), steps, rows)
        length = _joined([b.length[a:z] for (b, _, _), a, z in zip(parts, c_lo, c_hi)])
        seg, pos = dc.segments(_joined(firsts), length, _joined(ranks), rows * steps)
        seg, pos = seg.view(rows, steps), pos.view(rows, steps)
        if any((b.length_cpu[a:z] % p).any() for (b, _, _), a, z in zip(parts, c_lo, c_hi)):
            x.masked_fill_(~dc.expand(seg > 0, x), 0)  # a crop shorter than its last patch: zero the rest
        batch: dict[str, Any] = {"x": x, "segment_ids": seg, "positions": pos}
        if self.missing:
            batch["observed"] = dc.observe(x, seg > 0)
        batch.update(start=_joined([b.start[a:z] for (b, _, _), a, z in zip(parts, c_lo, c_hi)]), length=length,
                     row=_joined(row_of))
        self._keys(parts, batch, c_lo, c_hi)
        if self.with_weight:
            batch["weight"] = _joined([b.weight[a:z] for (b, _, _), a, z in zip(parts, c_lo, c_hi)])
        if self._ids is not None:
            batch["source"] = torch.cat([torch.full((z - a,), b.source, dtype=torch.int64, device=self.device)
                                         for (b, _, _), a, z in zip(parts, c_lo, c_hi)])
        return batch

    def _take(self, parts, shift: int, steps: int) -> torch.Tensor:
        nbytes = steps * self.sb
        pieces = [torch.index_select(dc.byte_rows(b, shift, nbytes), 0, b.offs[lo:hi]) for b, lo, hi in parts]
        return self._shaped(pieces[0] if len(pieces) == 1 else torch.cat(pieces), steps)

    def _shaped(self, raw: torch.Tensor, steps: int, rows: int | None = None) -> torch.Tensor:
        """Gathered bytes as the data's dtype, [rows, steps, *features] (rows: one per gathered row by default)."""
        return raw.view(self.dtype).view((len(raw) if rows is None else rows, steps) + self.step_shape)


def _joined(pieces: list[torch.Tensor]) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
