"""Device mode's crops: drawn lengths and packed rows cut on the device, bit for bit the CPU gather's.

The CPU gather (batch.py, with crop_stage.py's numpy tables) and this module compute the same
integers with the same runs, the one in numpy, the other in torch on the block's device
tables (uploaded once per block), so a batch costs a few kernel launches and no upload.
Sizes that torch would otherwise read back from the device (how many patches a part has)
come from the block table's CPU copy, so nothing here waits for the device.
"""
from __future__ import annotations

from typing import Any

import torch


def _spread(values: torch.Tensor, counts: torch.Tensor, total: int) -> torch.Tensor:
    """``values[i]`` repeated ``counts[i]`` times (``total`` = their sum, known on the CPU: no device sync)."""
    return torch.repeat_interleave(values, counts, output_size=total)


def crop_rows(row_ptr: torch.Tensor, lo: int, hi: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row within the block, rank within its row) of the ``n`` crops of rows [lo, hi), row-major."""
    ptr = row_ptr[lo : hi + 1]
    counts = ptr[1:] - ptr[:-1]
    row = _spread(torch.arange(lo, hi, device=row_ptr.device), counts, n)
    return row, torch.arange(n, device=row_ptr.device) + ptr[0] - _spread(ptr[:-1], counts, n)


def patch_index(offs: torch.Tensor, first: torch.Tensor, size: torch.Tensor, patches: int, patch_bytes: int,
                total: int, zero: int) -> torch.Tensor:
    """Byte offset of each of ``total`` patches of some rows (crop_stage.patch_index, on the device); ``patches``:
    the crops' patches, summed."""
    out = torch.full((total,), zero, dtype=torch.int64, device=offs.device)
    within = torch.arange(patches, device=offs.device) - _spread(torch.cumsum(size, 0) - size, size, patches)
    out[_spread(first, size, patches) + within] = _spread(offs, size, patches) + within * patch_bytes
    return out


def segments(first: torch.Tensor, length: torch.Tensor, rank: torch.Tensor, total: int) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
    """(segment_ids, positions), int32 [total], of crops at steps [first, first + length) (crop_stage.segments)."""
    dev, n = first.device, len(first)
    if not n:
        zeros = torch.zeros(total, dtype=torch.int32, device=dev)
        return zeros, zeros.clone()
    end = first + length
    runs = torch.empty(2 * n + 1, dtype=torch.int64, device=dev)
    runs[0], runs[-1] = first[0], total - end[-1]
    runs[2:-1:2] = first[1:] - end[:-1]
    runs[1::2] = length
    ids = torch.zeros(2 * n + 1, dtype=torch.int32, device=dev)
    ids[1::2] = (rank + 1).to(torch.int32)
    seg = _spread(ids, runs, total)
    base = torch.zeros(2 * n + 1, dtype=torch.int64, device=dev)
    base[1::2], base[2::2] = first, end
    pos = (torch.arange(total, device=dev) - _spread(base, runs, total)).to(torch.int32)
    return seg, pos.masked_fill_(seg == 0, 0)


def observe(x: torch.Tensor, inside: torch.Tensor | None) -> torch.Tensor:
    """``observed`` (bool, like x): finite (and not padding where ``inside`` says so); NaN and inf in x set to 0."""
    if x.is_floating_point():
        observed = torch.isfinite(x)
        x.masked_fill_(~observed, 0)
    else:
        observed = torch.ones_like(x, dtype=torch.bool)
    if inside is not None:
        observed &= inside.view(inside.shape + (1,) * (x.dim() - inside.dim()))
    return observed


def byte_rows(b: Any, shift: int, nbytes: int) -> torch.Tensor:
    """Row i = the ``nbytes`` bytes of a DeviceBlock from byte ``shift + i`` (a view, made once per block)."""
    key = (shift, nbytes)
    rows = b.rows.get(key)
    if rows is None:
        buf = b.buf[shift:]
        rows = b.rows[key] = buf.as_strided((max(len(buf) - nbytes + 1, 0), nbytes), (1, 1))
    return rows


def expand(mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A [B, steps] mask broadcast over x's feature dimensions."""
    return mask.view(mask.shape + (1,) * (x.dim() - 2)).expand_as(x)


def cat(parts: list[Any], name: str, crops: bool = False) -> torch.Tensor:
    """Field ``name`` of the parts' windows (or, ``crops``, of the crops of their rows), on the device."""
    pieces = []
    for b, lo, hi in parts:
        c0, c1 = b.crops(lo, hi) if crops else (lo, hi)
        pieces.append(getattr(b, name)[c0:c1])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
