"""The ustar tar files shards are: deterministic member headers, padding and the end-of-archive marker.

Headers are written with fixed fields (mtime 0, uid/gid 0, mode 0644, no user or group name)
so the same input gives byte-identical shards. A header is a 512-byte block; only the
member's name, its size and the checksum differ from one member to the next, so headers are
made from one template that ``tarfile`` writes once, with those three fields patched in:
``tar_header`` for one member, ``tar_headers`` for many at once with numpy. A name longer than
100 bytes or a member of 8 GiB or more gets the pax header ``tarfile`` writes. Pure functions,
no I/O.
"""
from __future__ import annotations

import tarfile

import numpy as np

BLOCK = 512
TAR_END = b"\0" * (2 * BLOCK)
USTAR_MAX_SIZE = 8**11 - 1  # the 11 octal digits of a ustar size field


def _tarfile_header(name: str, size: int) -> bytes:
    """The ustar header ``tarfile`` writes for a regular file member with the fixed fields."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info.tobuf(format=tarfile.USTAR_FORMAT, encoding="ascii", errors="strict")


def _template() -> bytes:
    """A header with name, size and checksum fields blank (the checksum field as 8 spaces, as summed)."""
    buf = bytearray(_tarfile_header("_", 0))
    buf[0:100] = bytes(100)
    buf[124:136] = bytes(12)
    buf[148:156] = b" " * 8
    return bytes(buf)


_TEMPLATE = _template()
_TEMPLATE_SUM = sum(_TEMPLATE)


def tar_header(name: str, size: int) -> bytes:
    """The header of member ``name`` of ``size`` bytes: the template with name, size and checksum
    patched in (much faster than ``tarfile``, byte for byte the same); a pax header past ustar."""
    raw = name.encode("ascii")
    if len(raw) > 100 or size > USTAR_MAX_SIZE:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = size, 0o644, 0
        return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8")
    size_field = b"%011o\0" % size
    buf = bytearray(_TEMPLATE)
    buf[0 : len(raw)] = raw
    buf[124:136] = size_field
    buf[148:155] = b"%06o\0" % (_TEMPLATE_SUM + sum(raw) + sum(size_field))
    return bytes(buf)


def tar_headers(keys: np.ndarray, key_ends: np.ndarray, suffix: str, sizes: np.ndarray) -> np.ndarray:
    """[n, 512] headers of members ``<key><suffix>`` of these sizes, made for all at once with numpy:
    `tar_header` of each, byte for byte (names up to 100 bytes, sizes up to USTAR_MAX_SIZE).

    ``keys`` holds every key's ASCII bytes end to end (uint8), key i ending at ``key_ends[i]``.
    """
    hdr = np.tile(np.frombuffer(_TEMPLATE, dtype=np.uint8), (len(sizes), 1))
    fields = name_size_fields(keys, key_ends, suffix, sizes)
    hdr[:, NAME], hdr[:, SIZE] = fields[:, NAME], fields[:, SIZE]
    checksum = hdr.sum(axis=1, dtype=np.int64)  # with the checksum field as 8 spaces
    for k in range(6):  # "%06o\0", the eighth byte stays a space
        hdr[:, 148 + k] = ord("0") + ((checksum >> (3 * (5 - k))) & 7)
    hdr[:, 154] = 0
    return hdr


def tar_padding(size: int) -> bytes:
    """The zero bytes that pad a member of ``size`` bytes to a whole block."""
    return b"\0" * (-size % BLOCK)


def record_size(size: int) -> int:
    """Bytes a member of ``size`` bytes takes in the archive: its header, content and padding."""
    return BLOCK + size + (-size % BLOCK)


NAME, SIZE = slice(0, 100), slice(124, 136)  # a ustar header's name and size fields
FIELDS = 136  # bytes of a header that hold them


def name_size_fields(keys: np.ndarray, key_ends: np.ndarray, suffix: str, sizes: np.ndarray) -> np.ndarray:
    """[n, FIELDS] bytes of the headers of members ``<key><suffix>`` of these sizes as pack writes them, in their
    name and size fields (the rest zero): `tar_header` of each there, made for all at once (names up to 100
    bytes, sizes up to USTAR_MAX_SIZE); ``keys`` and ``key_ends`` as for `tar_headers`."""
    n = len(sizes)
    out = np.zeros((n, FIELDS), dtype=np.uint8)
    klen = np.diff(key_ends, prepend=0)
    rows = np.repeat(np.arange(n), klen)
    out[rows, np.arange(len(keys)) - np.repeat(key_ends - klen, klen)] = keys
    for k, ch in enumerate(suffix.encode("ascii")):
        out[np.arange(n), klen + k] = ch
    for k in range(11):  # size: 11 octal digits and a NUL
        out[:, 124 + k] = ord("0") + ((sizes >> (3 * (10 - k))) & 7)
    return out
