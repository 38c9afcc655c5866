"""Local shard files read at an offset into the caller's buffer."""
from __future__ import annotations

from streamwin.read.transport import read_file


def read_local(path: str, offset: int, out: memoryview) -> int:
    """Read into ``out`` from a local file at ``offset``; returns the bytes read (short at EOF)."""
    with open(path, "rb", buffering=0) as f:
        return read_file(f, offset, out)
