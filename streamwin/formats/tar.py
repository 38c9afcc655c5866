"""The ustar tar files shards are: deterministic member headers, padding and the end-of-archive marker.

Headers are written with fixed fields (mtime 0, uid/gid 0, mode 0644) so the same input
gives byte-identical shards. Pure functions, no I/O.
"""
from __future__ import annotations

import tarfile

BLOCK = 512


def tar_header(name: str, size: int) -> bytes:
    """A deterministic ustar header block for a regular file member."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info.tobuf(format=tarfile.USTAR_FORMAT, encoding="ascii", errors="strict")


def tar_padding(size: int) -> bytes:
    return b"\0" * (-size % BLOCK)


TAR_END = b"\0" * (2 * BLOCK)
