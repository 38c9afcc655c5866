"""``.npy`` and ``.npz`` inputs: one sequence per ``.npy`` file, one per array of an ``.npz``.

Keys: an ``.npy`` file's relative path (``data/a/b.npy`` read from ``data/`` is ``a__b``); an
``.npz`` array's ``<relpath>__<array name>``, or the bare array name when the input is that
one file. No options.

Both are read without unpickling anything and fast where the files are plain (numeric,
little-endian, C order, format 1.0 headers): a ``.npy`` header is parsed once per distinct
header, and an ``.npz`` written by ``np.savez`` (stored, not compressed) is read whole and
cut into runs of one dtype and step shape, each a `Batch`, without a zipfile read per
member. Anything else (compressed members, big-endian or Fortran-ordered arrays, an archive
over NPZ_READ_WHOLE) goes through numpy's own reader, member by member, so errors read the
same either way.
"""
from __future__ import annotations

import functools
import io
import os
import posixpath
import zipfile
import zlib
from typing import Iterator

import numpy as np

from streamwin.errors import PackError
from streamwin.formats import npy as npyfmt
from streamwin.formats.keys import key_from_name
from streamwin.packing.inputs.base import Batch, InputFormat, InputUnit, Item, Report, check_array, open_unit, text_key
from streamwin.packing.inputs.zipdir import u16, zip_members

NPZ_READ_WHOLE = 256 << 20  # .npz archives up to this size are read whole and batched


def read_npy(unit: InputUnit, opts: dict, report: Report) -> Iterator[Item]:
    """The one array of a ``.npy`` file."""
    if "://" not in unit.path and os.path.isfile(unit.path):  # local: read the file in one go
        with open(unit.path, "rb") as f:
            data = f.read()
    else:
        with open_unit(unit) as f:
            data = f.read()
    arr = _plain_npy_array(data)
    if arr is None:  # anything but a plain little-endian C-order array: numpy's reader and errors
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    yield key_from_name(unit.name), check_array(arr, unit.path), None


def _plain_npy_array(data: bytes) -> np.ndarray | None:
    """The array of .npy bytes whose v1 header `plain_npy` takes (headers repeat: they are parsed
    once each), read-only over ``data``; None for any other."""
    if len(data) < 10 or data[6] != 1:
        return None
    hlen = 10 + int.from_bytes(data[8:10], "little")
    parsed = plain_npy_cached(data[:hlen])
    if parsed is None or len(data) != hlen + parsed[2]:
        return None
    dtype, shape, _ = parsed
    return np.frombuffer(data, dtype=dtype, offset=hlen).reshape(shape)


def _read_npz(unit: InputUnit) -> Iterator[Item]:
    """Every array of an ``.npz``, member by member through numpy's reader."""
    prefix = "" if unit.single else posixpath.splitext(unit.name)[0] + "__"
    with open_unit(unit) as f:
        npz = np.load(f, allow_pickle=False)
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise PackError(f"{unit.path}: not an .npz archive")
        with npz:
            for name in npz.files:  # archive order, which is the order they were saved in
                where = f"{unit.path}, array {name!r}"
                try:
                    arr = npz[name]
                except Exception as e:
                    raise PackError(f"{where}: {type(e).__name__}: {e}") from e
                yield text_key(prefix + name), check_array(arr, where), None


def read_npz(unit: InputUnit, opts: dict, report: Report) -> Iterator[Batch | Item]:
    """An .npz whose members are stored (np.savez) as plain little-endian C-order arrays, read as
    runs of one dtype and step shape without a zipfile read per member; else `_read_npz`."""
    with open_unit(unit) as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        data = f.read() if size <= NPZ_READ_WHOLE else b""
    runs = _stored_npz_runs(data) if data else None
    if runs is None:  # numpy's reader: member by member, so a huge archive is never held whole
        yield from _read_npz(unit)
        return
    prefix = "" if unit.single else posixpath.splitext(unit.name)[0] + "__"
    buf = memoryview(data)
    for dtype, step, names, starts, nbytes, bounds in runs:
        values = np.frombuffer(b"".join([buf[a : a + n] for a, n in zip(starts, nbytes)]), dtype=dtype)
        keys = [text_key(prefix + name) for name in names]
        yield Batch(keys, values.reshape((-1,) + step), np.asarray(bounds, dtype=np.int64))


NPY = InputFormat("npy", read_npy, suffixes=(".npy",), one_per_file=True)
NPZ = InputFormat("npz", read_npz, suffixes=(".npz",))


def _stored_npz_runs(data: bytes) -> list[tuple] | None:
    """(dtype, step shape, names, data starts, data bytes, step bounds) per run of members with one
    dtype and step shape; None when any member needs the general reader (compressed,
    encrypted, not a plain .npy, a bad CRC, a header this fast path does not take)."""
    found = zip_members(data)
    if found is None or not found[0]:
        return None
    names, (flags, method, crc, size, csize, local) = found[0], found[1].T
    if (len(set(names)) != len(names) or (method != zipfile.ZIP_STORED).any() or (flags & 1).any()
            or (size != csize).any() or not all(name.endswith(".npy") for name in names)):
        return None
    raw = np.frombuffer(data, dtype=np.uint8)
    if local.max() + 30 > len(raw) or (raw[local] != 0x50).any() or (raw[local + 1] != 0x4B).any():
        return None
    at = local + 30 + u16(raw, local + 26) + u16(raw, local + 28)  # each member's data: its .npy bytes
    if (at + size > len(raw)).any() or (size < 10).any() or (raw[at + 6] != 1).any():
        return None  # truncated, or not a version 1.0 .npy header
    hlen = 10 + u16(raw, at + 8)
    view = memoryview(data)
    if [zlib.crc32(view[a : a + n]) for a, n in zip(at.tolist(), size.tolist())] != crc.tolist():
        return None
    parsed = _headers(raw, at, hlen)
    if parsed is None:
        return None
    kind, steps, nbytes, kinds = parsed
    if (hlen + nbytes != size).any():
        return None
    cuts = [0, *(np.flatnonzero(kind[1:] != kind[:-1]) + 1).tolist(), len(names)]
    runs = []
    for a, b in zip(cuts, cuts[1:]):
        bounds = np.zeros(b - a + 1, dtype=np.int64)
        np.cumsum(steps[a:b], out=bounds[1:])
        runs.append((*kinds[int(kind[a])], [n[:-4] for n in names[a:b]], (at + hlen)[a:b].tolist(),
                     nbytes[a:b].tolist(), bounds))
    return runs


def _headers(raw: np.ndarray, at: np.ndarray, hlen: np.ndarray, chunk: int = 1 << 14) -> tuple | None:
    """Per member: (kind, steps, data bytes) of its .npy header at ``raw[at:at + hlen]``, and the
    kinds as (dtype, step shape); each distinct header is parsed once. None if one is not plain.
    Members are grouped by header with numpy, ``chunk`` at a time (a [chunk, header] matrix)."""
    seen: dict[bytes, int] = {}  # header -> its number
    parsed: list[tuple] = []
    ids = np.empty(len(at), dtype=np.int64)
    for c in range(0, len(at), chunk):
        a, h = at[c : c + chunk], hlen[c : c + chunk]
        width = int(h.max())
        cols = np.arange(width)
        rows = np.where(cols < h[:, None], raw[np.minimum(a[:, None] + cols, len(raw) - 1)], 0).astype(np.uint8)
        first, inverse = np.unique(np.ascontiguousarray(rows).view(f"V{width}").ravel(), return_index=True,
                                   return_inverse=True)[1:]
        local = []
        for i in first.tolist():
            head = bytes(rows[i, : h[i]])
            if head not in seen:
                seen[head] = len(parsed)
                parsed.append(plain_npy_cached(head))
                if parsed[-1] is None:
                    return None
            local.append(seen[head])
        ids[c : c + chunk] = np.array(local, dtype=np.int64)[inverse.ravel()]
    kinds = list(dict.fromkeys((dtype, shape[1:]) for dtype, shape, _ in parsed))
    kind = np.array([kinds.index((dtype, shape[1:])) for dtype, shape, _ in parsed])[ids]
    steps = np.array([shape[0] for _, shape, _ in parsed], dtype=np.int64)[ids]
    return kind, steps, np.array([n for _, _, n in parsed], dtype=np.int64)[ids], kinds


@functools.lru_cache(maxsize=4096)
def plain_npy_cached(head: bytes) -> tuple | None:
    """`plain_npy`, each distinct header parsed once."""
    return plain_npy(head)


def plain_npy(head: bytes) -> tuple | None:
    """(dtype, shape, data bytes) of a v1 .npy header of a plain numeric little-endian array of
    at least one dimension in C order (`npyfmt.parse_npy_header` refuses the others); None for any other."""
    try:
        dtype, shape, _ = npyfmt.parse_npy_header(head)
    except ValueError:
        return None
    if not shape:
        return None
    return dtype, shape, dtype.itemsize * int(np.prod(shape, dtype=np.int64))
