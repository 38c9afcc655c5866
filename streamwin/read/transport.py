"""Bytes of a shard into the caller's buffer: a stream read until the buffer is full."""
from __future__ import annotations


def fill(src, out: memoryview) -> int:
    """Read from stream ``src`` into ``out`` until it is full or the stream ends; the bytes read."""
    got = 0
    while got < len(out):
        n = src.readinto(out[got:])
        if not n:
            break
        got += n
    return got


def read_file(f, offset: int, out: memoryview) -> int:
    """Read into ``out`` from open file ``f`` at ``offset``; returns the bytes read (short at EOF)."""
    f.seek(offset)
    return fill(f, out)
