"""Byte ranges of local files mapped side by side into one read-only address range.

A block's windows are cut straight from the page cache: each byte range is mapped (mmap,
MAP_FIXED) at its place in one reserved range, so the block needs no read copy and the
batch gather is the only copy a window's bytes ever make. The tail of the reservation stays
anonymous zero pages, which padded windows may read.

The mapping is unmapped when the last numpy view of it is gone (``MappedBuffer.__del__``),
so no view can outlive it. Linux and macOS; elsewhere ``available()`` is False and callers
read into ordinary memory.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys

import numpy as np

PAGE = mmap.PAGESIZE
_PROT_READ = 0x1
_PROT_WRITE = 0x2
_MAP_PRIVATE = 0x02
_MAP_FIXED = 0x10
_MAP_ANONYMOUS = 0x20 if sys.platform.startswith("linux") else 0x1000
# fill the page tables up front, on the reading thread (it releases the GIL), not on first touch
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_MAP_NORESERVE = 0x4000 if sys.platform.startswith("linux") else 0x40
_FAILED = ctypes.c_void_p(-1).value

_libc = None


def available() -> bool:
    """True where mmap with MAP_FIXED can be called (Linux, macOS)."""
    global _libc
    if _libc is None:
        if not (sys.platform.startswith("linux") or sys.platform == "darwin"):
            _libc = False
        else:
            try:
                lib = ctypes.CDLL(None, use_errno=True)
                lib.mmap.restype = ctypes.c_void_p
                lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_int64]
                lib.munmap.restype = ctypes.c_int
                lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
                _libc = lib
            except (OSError, AttributeError):
                _libc = False
    return _libc is not False


def anonymous(nbytes: int) -> np.ndarray:
    """``nbytes`` of zeroed private memory, a mapping of its own: given back to the system when the last view goes.

    Not malloc'd, so a freed buffer raises no glibc threshold and leaves no heap behind; huge
    pages are asked for where the system offers them (a fresh 20 MB buffer is then filled
    about as fast as a reused one).
    """
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    mem = mmap.mmap(-1, max(nbytes, 1), flags=flags) if flags else mmap.mmap(-1, max(nbytes, 1))
    if nbytes >= 2 << 20 and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mem.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return np.frombuffer(mem, dtype=np.uint8)[:nbytes]


def page_floor(offset: int | np.ndarray) -> int | np.ndarray:
    """The page boundary at or before ``offset`` (elementwise for arrays)."""
    return offset - offset % PAGE


def page_ceil(nbytes: int | np.ndarray) -> int | np.ndarray:
    """``nbytes`` rounded up to whole pages (elementwise for arrays)."""
    return -(-nbytes // PAGE) * PAGE


class MappedBuffer:
    """``nbytes`` of reserved address space, read-only, zero until file ranges are mapped in.

    A range's page tables are filled when it is mapped (MAP_POPULATE), so the reading thread, not
    the gather, pays for them, in a call that holds no GIL.
    """

    def __init__(self, nbytes: int):
        if not available():
            raise OSError("mmap with MAP_FIXED is not available on this platform")
        self.nbytes = page_ceil(max(nbytes, 1))
        addr = _libc.mmap(None, self.nbytes, _PROT_READ, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if addr in (None, _FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"cannot reserve {self.nbytes} bytes of address space: {os.strerror(err)}")
        self.addr = addr
        self.__array_interface__ = {"data": (addr, True), "shape": (self.nbytes,), "typestr": "|u1", "version": 3}

    def map_file(self, at: int, fd: int, file_offset: int, nbytes: int) -> None:
        """Map ``nbytes`` of open file ``fd`` from ``file_offset`` (both page-aligned) at byte ``at``.

        The caller guarantees the file holds at least one byte of every page mapped (else a
        read of that page would raise SIGBUS).
        """
        if at % PAGE or file_offset % PAGE or at + nbytes > self.nbytes:
            raise ValueError("unaligned or out-of-range mapping")
        size = page_ceil(nbytes)
        flags = _MAP_PRIVATE | _MAP_FIXED | _MAP_POPULATE
        got = _libc.mmap(self.addr + at, size, _PROT_READ, flags, fd, file_offset)
        if got != self.addr + at:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {size} bytes at file offset {file_offset} failed: {os.strerror(err)}")

    def array(self) -> np.ndarray:
        """A read-only uint8 view; the mapping lives as long as any view of it."""
        return np.asarray(self)

    def scratch(self, at: int, nbytes: int) -> np.ndarray:
        """Bytes [at, at + nbytes) (``at`` page-aligned, no file mapped there) made zeroed private memory one can
        write: a writable view of them, valid while a view of the buffer lives (an extended sequence's windows
        are copied together there: read/segments.py)."""
        if at % PAGE or at + nbytes > self.nbytes:
            raise ValueError("unaligned or out-of-range scratch")
        size = page_ceil(max(nbytes, 1))
        got = _libc.mmap(self.addr + at, size, _PROT_READ | _PROT_WRITE, _MAP_PRIVATE | _MAP_FIXED | _MAP_ANONYMOUS,
                         -1, 0)
        if got != self.addr + at:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {size} bytes of scratch failed: {os.strerror(err)}")
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.addr + at))

    def __del__(self) -> None:
        """Unmap the range once no view of it is left."""
        if getattr(self, "addr", None) and _libc:
            _libc.munmap(self.addr, self.nbytes)
            self.addr = None


def writable(buf: np.ndarray, at: int, nbytes: int) -> np.ndarray:
    """A writable view of bytes [at, at + nbytes) of a block buffer: the buffer's own, or, in a mapped one, scratch
    memory mapped there (``at`` page-aligned, past its files' ranges)."""
    if buf.flags.writeable:
        return buf[at : at + nbytes]
    base = buf.base
    while base is not None and not isinstance(base, MappedBuffer):
        base = getattr(base, "base", None)
    if base is None:
        raise ValueError("not a block buffer: read-only and not mapped")
    return base.scratch(at, nbytes)
