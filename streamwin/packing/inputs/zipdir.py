"""The central directory of a zip archive (an ``.npz``), read with numpy.

An ``.npz`` of many small arrays is a zip of many small ``.npy`` members. ``zipfile`` reads
its directory one Python object per member; `zip_members` reads the same fields for all
members at once: it finds every central-directory entry signature, checks that the entries
chain from the directory's start to its end, and gathers the fields as columns. An archive
this reader does not take (zip64, or a name that holds the signature bytes) is read entry by
entry, or by ``zipfile`` itself.
"""
from __future__ import annotations

import io
import struct
import zipfile

import numpy as np

_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record
_CDIR = struct.Struct("<4s4xHH4xLLLHHH8xL")  # central directory file header, the fields read here


def u16(raw: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The little-endian 16-bit integers at byte offsets ``at`` of ``raw`` (uint8), as int64."""
    return raw[at].astype(np.int64) | raw[at + 1].astype(np.int64) << 8


def zip_members(data: bytes) -> tuple[list[str], np.ndarray] | None:
    """(member names, [n, 6] int64: flags, method, crc32, size, compressed size, local header
    offset) of a zip archive, from its central directory; zip64 through zipfile; None if not a zip."""
    end = data.rfind(b"PK\x05\x06", max(0, len(data) - (1 << 16) - _EOCD.size))
    if end < 0 or end + _EOCD.size > len(data):
        return None
    _, _, _, _, count, _, start, _ = _EOCD.unpack_from(data, end)
    if count == 0xFFFF or start == 0xFFFFFFFF or data[end - 20 : end - 16] == b"PK\x06\x07":
        return _zipfile_members(data)
    return read_directory(data, start, end, count) or _directory_entries(data, start, count)


def read_directory(data: bytes, start: int, end: int, count: int) -> tuple[list[str], np.ndarray] | None:
    """`zip_members` with numpy: every "PK\\1\\2" in the directory, kept if they chain from its
    start to its end entry by entry (a name could hold those bytes too: then None)."""
    raw = np.frombuffer(data, dtype=np.uint8)[start:end]
    if len(raw) < _CDIR.size:
        return None
    sig = np.flatnonzero((raw[:-3] == 0x50) & (raw[1:-2] == 0x4B) & (raw[2:-1] == 1) & (raw[3:] == 2))
    sig = sig[sig + _CDIR.size <= len(raw)]
    lens = [u16(raw, sig + k) for k in (28, 30, 32)]
    after = sig + _CDIR.size + lens[0] + lens[1] + lens[2]
    if len(sig) != count or not count or sig[0] != 0 or (after[:-1] != sig[1:]).any() or after[-1] != len(raw):
        return None
    u32 = lambda k: u16(raw, sig + k) | u16(raw, sig + k + 2) << 16  # noqa: E731
    cols = np.stack([u16(raw, sig + 8), u16(raw, sig + 10), u32(16), u32(24), u32(20), u32(42)], axis=1)
    if (cols[:, 3:] == 0xFFFFFFFF).any():
        return None
    names = [data[start + a : start + a + n].decode("utf-8" if f & 0x800 else "cp437")
             for a, n, f in zip((sig + _CDIR.size).tolist(), lens[0].tolist(), cols[:, 0].tolist())]
    return names, cols


def _directory_entries(data: bytes, start: int, count: int) -> tuple[list[str], np.ndarray] | None:
    """`zip_members` entry by entry."""
    names, rows, at = [], [], start
    for _ in range(count):
        if at + _CDIR.size > len(data):
            return None
        sig, flags, method, crc, csize, size, nlen, elen, clen, local = _CDIR.unpack_from(data, at)
        if sig != b"PK\x01\x02" or 0xFFFFFFFF in (csize, size, local):
            return _zipfile_members(data)
        names.append(data[at + _CDIR.size : at + _CDIR.size + nlen].decode("utf-8" if flags & 0x800 else "cp437"))
        rows.append((flags, method, crc, size, csize, local))
        at += _CDIR.size + nlen + elen + clen
    return names, np.array(rows, dtype=np.int64).reshape(-1, 6)


def _zipfile_members(data: bytes) -> tuple[list[str], np.ndarray] | None:
    try:
        infos = zipfile.ZipFile(io.BytesIO(data)).infolist()
    except zipfile.BadZipFile:
        return None
    rows = [(i.flag_bits, i.compress_type, i.CRC, i.file_size, i.compress_size, i.header_offset) for i in infos]
    return [i.filename for i in infos], np.array(rows, dtype=np.int64).reshape(-1, 6)
