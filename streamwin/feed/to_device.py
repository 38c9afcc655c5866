"""The last hop: a batch buffer to the device in one asynchronous copy, and static batches.

A batch is one byte buffer with its fields at fixed offsets (batch.BatchLayout), so a whole
batch, every field, travels in ONE copy: per batch the trainer's thread issues one
``cudaMemcpyAsync`` from the (page-locked) host buffer on a side stream, records an event,
and makes the current stream wait for it on the device. It never waits for the device
itself: the host buffer goes back to its owner once the event has completed (checked
without blocking by whoever holds it: ``WorkerPool.recycle``), and the device memory comes
from PyTorch's caching allocator on the side stream, marked with ``record_stream`` so that
it is reused only once the work queued on the current stream before the batch was dropped
has run. A batch the user keeps is never overwritten.

Static batches (``WindowLoader(..., static=True)``): every batch arrives in the same device
tensors (``Fixed``), so a training step can be captured once in a CUDA graph and replayed
on each batch. A static batch is valid until the next ``next()``. On CUDA the copy still
runs on the side stream, into fresh memory, overlapping the step before it; at ``next()``
one device-to-device copy on the current stream moves it into the fixed tensors, ordered
after the step that read the previous batch (same stream) without the CPU waiting.

With ``device="cpu"`` the same code copies on the CPU (no streams, no events): that is
how CI tests it.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from streamwin.batch import PER_CROP, BatchKeys, BatchLayout

HOST_ONLY = ("seq", "crops")  # become ``key`` and the per-crop fields' length; never device tensors


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype."""
    return torch.from_numpy(np.zeros(0, dtype=dtype)).dtype


class Fields:
    """How a BatchLayout's fields lie in a byte buffer, as torch views (made once per buffer, where it is fixed)."""

    def __init__(self, layout: BatchLayout):
        self.nbytes = layout.nbytes
        # per dtype, its fields as (name, shape, strides, offset) in elements: one view of the buffer per dtype,
        # then one as_strided per field (fields start 64-byte aligned, so every offset is whole elements)
        self.groups: dict[torch.dtype, list] = {}
        self.order = [f.name for f in layout.fields if f.name not in HOST_ONLY]
        for f in layout.fields:
            if f.name not in HOST_ONLY:
                strides = tuple(int(np.prod(f.shape[i + 1 :], dtype=np.int64)) for i in range(len(f.shape)))
                self.groups.setdefault(torch_dtype(f.dtype), []).append(
                    (f.name, f.shape, strides, f.offset // f.dtype.itemsize))
        at = {f.name: f.offset for f in layout.fields}
        self.seq, self.source, self.crops = at["seq"], at.get("source"), at.get("crops")
        self.items = next(f.shape[0] for f in layout.fields if f.name == "seq")  # windows (or crops) per batch
        self.per_crop = layout.per_crop

    def views(self, raw: torch.Tensor) -> dict[str, torch.Tensor]:
        """The device fields as tensors over ``raw`` (uint8, ``nbytes``)."""
        out = {}
        for dtype, fields in self.groups.items():
            typed = raw.view(dtype)
            for name, shape, strides, offset in fields:
                out[name] = typed.as_strided(shape, strides, offset)
        return {name: out[name] for name in self.order}  # in the layout's order, as CPU batches

    def crops_of(self, host: np.ndarray) -> int | None:
        """Packed rows: how many crops the batch in ``host`` holds (its per-crop fields are cut to them)."""
        return None if self.crops is None else int(host[self.crops : self.crops + 8].view(np.int64)[0])

    def keys(self, host: np.ndarray, manifests: list, crops: int | None) -> BatchKeys:
        """The batch's keys, from its host buffer (decoded on first use, as the CPU path's)."""
        n = self.items if crops is None else crops
        seq = host[self.seq : self.seq + 8 * n].view(np.int64).copy()
        source = None if self.source is None else host[self.source : self.source + 8 * n].view(np.int64).copy()
        return BatchKeys(manifests=manifests, seq=seq, source=source)


def cut_crops(batch: dict[str, Any], crops: int | None, per_crop: tuple[str, ...] = PER_CROP) -> dict[str, Any]:
    """Packed rows: the per-crop fields cut to the batch's crops (views; the rest as they are)."""
    if crops is None:
        return batch
    return {k: v[:crops] if k in per_crop and crops < len(v) else v for k, v in batch.items()}


class Fixed:
    """The tensors a static loader delivers every batch in, epoch after epoch: one device buffer of the batch
    layout, viewed once."""

    def __init__(self, layout: BatchLayout, device: torch.device):
        self.fields = Fields(layout)
        self.raw = torch.zeros(self.fields.nbytes, dtype=torch.uint8, device=device)
        self.tensors = self.fields.views(self.raw)

    def put(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Copy a batch's device fields into the fixed tensors (on the current stream); the batch, in them."""
        out = dict(batch)
        for name, fixed in self.tensors.items():
            value = batch[name]
            dest = fixed if value.shape == fixed.shape else fixed[: len(value)]  # packed: per-crop fields are cut
            dest.copy_(value, non_blocking=True)
            out[name] = dest
        return out


class ToDevice:
    """Copies batch buffers (a worker's slot, an in-process buffer) to ``device``, one copy per batch.

    ``pinned``: the host buffers are page-locked (else a CUDA copy from them makes this thread
    wait while it is staged: counted in ``waits``). ``fixed``: static batches, in those tensors.
    """

    def __init__(self, layout: BatchLayout, device: torch.device, manifests: list, *, fixed: Fixed | None = None,
                 pinned: bool = True):
        self.fields, self.device, self.manifests = Fields(layout), device, manifests
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.fixed, self.pinned = fixed, pinned
        self.last = None  # the event of the latest copy: copies on the side stream complete in order
        self.copies = 0  # batches copied
        self.waits = 0  # copies during which this thread waited for the device (pageable host memory)

    @property
    def copied_bytes(self) -> int:
        return self.copies * self.fields.nbytes

    def __call__(self, host: np.ndarray) -> tuple[dict[str, Any], Any]:
        """(the batch in ``host`` on the device, the CUDA event of its copy: ``host`` may be reused once it has
        completed; None on the CPU, where the copy is done on return)."""
        fields, fixed = self.fields, self.fixed
        src = torch.from_numpy(host[: fields.nbytes])
        done = None
        if not self.cuda:
            raw = fixed.raw if fixed is not None else torch.empty(fields.nbytes, dtype=torch.uint8)
            raw.copy_(src)
        else:
            with torch.cuda.stream(self.side):  # memory of the side stream, filled there
                raw = torch.empty(fields.nbytes, dtype=torch.uint8, device=self.device)
                raw.copy_(src, non_blocking=True)
                done = self.last = torch.cuda.Event()
                done.record()
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)  # the device waits for the copy, this thread does not
            raw.record_stream(current)  # reused only after what the current stream queues before it is dropped
            if fixed is not None:
                fixed.raw.copy_(raw, non_blocking=True)  # device to device, after the step that read the last batch
            if not self.pinned:
                self.waits += 1
        self.copies += 1
        crops = fields.crops_of(host)
        batch = dict(fixed.tensors) if fixed is not None else fields.views(raw)
        batch = cut_crops(batch, crops, fields.per_crop)
        batch["key"] = fields.keys(host, self.manifests, crops)
        return batch, done

    def settle(self) -> None:
        """Wait until every copy queued so far has read its host buffer (before that memory may be unmapped:
        a pass ends). Counted in ``waits`` when it had to wait."""
        if self.last is not None and not self.last.query():
            self.waits += 1
            self.last.synchronize()
