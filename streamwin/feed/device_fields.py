"""Per-sequence fields of device batches (in-process device mode): looked up on the device, never uploaded per batch.

Each field's values for every sequence of every source go to the device once, in one column
(sources end to end, str codes already in the dataset's vocabulary, a missing field's fill
value repeated), and per batch one ``index_select`` by the windows' sequence indices (which
the blocks' window tables carry on the device) gives the field: no copy from the host, no
wait for the device. ``time`` is start + offset x freq, cut the same way.
"""
from __future__ import annotations

import numpy as np
import torch

from streamwin.formats.meta import BATCH_DTYPES, DERIVED
from streamwin.seqfields import FieldGather


class DeviceFields:
    """The fields of a FieldGather as device columns, made on first use; ``fill`` adds them to a device batch."""

    def __init__(self, gather: FieldGather, sizes: list[int], device: torch.device):
        self.gather, self.sizes, self.device = gather, sizes, device
        self.columns: list | None = None
        self.offsets = torch.tensor(np.concatenate([[0], np.cumsum(sizes)[:-1]]), dtype=torch.int64, device=device)

    def _make(self) -> list:
        out = []
        for (name, per), kind in zip(self.gather.tables, self.gather.spec.kinds):
            dtype = np.dtype(BATCH_DTYPES[kind])
            if name == DERIVED:
                start = np.concatenate([np.asarray(c, dtype=np.int64) for c, _, _ in per])
                freq = np.concatenate([np.asarray(f, dtype=np.int64) for _, f, _ in per])
                out.append((name, torch.from_numpy(start).to(self.device), torch.from_numpy(freq).to(self.device)))
                continue
            pieces = []
            for (col, remap, value), n in zip(per, self.sizes):
                if col is None:
                    pieces.append(np.full(n, value, dtype=dtype))
                else:
                    pieces.append((remap[col] if remap is not None else np.asarray(col)).astype(dtype))
            out.append((name, torch.from_numpy(np.concatenate(pieces)).to(self.device), None))
        return out

    def fill(self, batch: dict, seq: torch.Tensor, source: torch.Tensor | None) -> None:
        """Add each field to ``batch`` for windows (or crops) of sequences ``seq`` (of sources ``source``)."""
        if self.columns is None:
            self.columns = self._make()
        index = seq if source is None else seq + self.offsets.index_select(0, source)
        for name, col, freq in self.columns:
            value = col.index_select(0, index)
            if freq is not None:
                value = value + freq.index_select(0, index) * batch["start"]
            batch[name] = value
