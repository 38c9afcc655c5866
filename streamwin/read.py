"""Read the sequences a block of windows needs into one contiguous byte buffer.

For each sequence a block touches, only the steps its windows cover are read; the byte
ranges of neighbouring sequences in a shard are merged, so a slice of many short
sequences is one read and a window range of one giant sequence is one read too. Every
``.npy`` header that a read covers is checked against the manifest (dtype, shape, header
length) before any window is cut from it. Reads retry with exponential backoff; what still
fails is a ShardError naming the shard, the member and the byte offset.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import npyfmt
from .errors import ShardError
from .manifest import Manifest
from .plan import Plan
from .storage import is_local, join, url_to_fs

MERGE_GAP = 64 << 10  # read through gaps (tar and npy headers, json members) up to this size
CHUNK = 8 << 20  # a remote range is fetched in chunks; a retry resumes at the chunk that broke


@dataclass
class Block:
    """The windows of one block and the bytes they are cut from.

    ``offs[i]`` is the byte offset in ``buf`` where window i's step 0 begins; ``valid[i]`` the
    steps of window + horizon that lie inside the sequence (less than the span only for a
    padded window of a short sequence). ``buf`` has a zero tail one span long, so a padded
    window never reads past it.
    """

    buf: np.ndarray
    offs: np.ndarray
    seq: np.ndarray
    start: np.ndarray
    real: np.ndarray
    valid: np.ndarray
    keys: list[str]  # keys of the block's distinct sequences
    key_index: np.ndarray  # window i belongs to keys[key_index[i]]

    def batch_keys(self, lo: int, hi: int) -> list[str]:
        keys = self.keys
        return [keys[i] for i in self.key_index[lo:hi].tolist()]

    def __len__(self) -> int:
        return len(self.offs)

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes


@dataclass
class ReadStats:
    bytes_read: int = 0
    reads: int = 0
    retries: int = 0


class ShardSource:
    """Reads byte ranges of a dataset's shards (any fsspec URL) and assembles blocks."""

    def __init__(self, url: str, manifest: Manifest, *, storage_options: dict[str, Any] | None = None,
                 retries: int = 5, backoff: float = 0.2):
        self.url = url.rstrip("/")
        self.manifest = manifest
        self.fs, self.root = url_to_fs(url, storage_options)
        self.local = is_local(self.fs)
        self.retries, self.backoff = retries, backoff
        self.stats = ReadStats()
        self._header_cache: dict[bytes, tuple] = {}
        self._descr = np.lib.format.dtype_to_descr(manifest.dtype)
        self._lock = threading.Lock()

    def shard_url(self, k: int) -> str:
        return f"{self.url}/{self.manifest.shards[k].name}"

    def read_block(self, plan: Plan, stream: int, block: int) -> Block:
        """Read what block ``block`` of ``stream`` needs; windows in yield order."""
        g, real = plan.block(stream, block)
        seq, start = plan.locate(g)
        m = self.manifest
        span = plan.config.spec.span
        sb = m.step_bytes
        # group the windows by sequence: the step range each sequence must provide
        order = np.argsort(seq, kind="stable")
        sorted_seq = seq[order]
        new = np.ones(len(seq), dtype=bool)
        new[1:] = sorted_seq[1:] != sorted_seq[:-1]
        first = np.flatnonzero(new)
        uniq = sorted_seq[first]
        inv = np.empty(len(seq), dtype=np.int64)
        inv[order] = np.cumsum(new) - 1
        smin = np.minimum.reduceat(start[order], first)
        smax = np.maximum.reduceat(start[order], first)
        length = m.length[uniq]
        valid = np.minimum(length[inv] - start, span)
        if m.compression:
            buf, base = self._read_compressed(uniq)
        else:
            buf, base = self._read_plain(uniq, smin, np.minimum(length, smax + span), span * sb)
        offs = base[inv] + start * sb
        return Block(buf, offs, seq, start, real, valid, m.keys(uniq), inv)

    # -- uncompressed: byte ranges straight into the block buffer ------------------------------
    def _read_plain(self, uniq: np.ndarray, s_lo: np.ndarray, s_hi: np.ndarray, tail: int) -> tuple[np.ndarray, np.ndarray]:
        m = self.manifest
        sb = m.step_bytes
        shard = np.searchsorted(m.shard_starts, uniq, side="right") - 1
        data0 = m.offset[uniq] + m.hlen[uniq]
        r_lo = np.where(s_lo == 0, m.offset[uniq], data0 + s_lo * sb)  # from step 0: include the npy header
        r_hi = data0 + s_hi * sb
        new = np.ones(len(uniq), dtype=bool)
        new[1:] = (shard[1:] != shard[:-1]) | (r_lo[1:] - r_hi[:-1] > MERGE_GAP)
        first = np.flatnonzero(new)
        run = np.cumsum(new) - 1
        run_lo = r_lo[first]
        run_hi = np.maximum.reduceat(r_hi, first)
        sizes = run_hi - run_lo
        pos = np.zeros(len(first) + 1, dtype=np.int64)
        np.cumsum(sizes, out=pos[1:])
        buf = np.empty(int(pos[-1]) + tail, dtype=np.uint8)  # np.empty: numpy asks for huge pages
        buf[len(buf) - tail :] = 0
        for j in range(len(first)):
            k = int(shard[first[j]])
            self._read_into(k, int(run_lo[j]), memoryview(buf)[pos[j] : pos[j + 1]])
        base = pos[run] + (data0 - run_lo[run])
        covered = s_lo == 0
        at = pos[run] + (m.offset[uniq] - run_lo[run])
        for i, k, p, h in zip(uniq[covered].tolist(), shard[covered].tolist(), at[covered].tolist(),
                              m.hlen[uniq[covered]].tolist()):
            self._check_header(buf[p : p + h].tobytes(), i, k)
        return buf, base

    def _check_header(self, header: bytes, i: int, k: int) -> int:
        m = self.manifest
        shape = (int(m.length[i]),) + m.step_shape
        hlen = int(m.hlen[i])
        if header == npyfmt.expected_npy_header(self._descr, shape, hlen):
            return hlen
        expected = (m.dtype, shape, hlen)
        got = self._header_cache.get(header)
        if got is None:
            try:
                got = npyfmt.parse_npy_header(header)
            except ValueError as e:
                raise ShardError(f"bad .npy header: {e}", shard=self.shard_url(k), member=self._member(i),
                                 offset=int(m.offset[i])) from e
            if len(self._header_cache) < 4096:
                self._header_cache[header] = got
        if got != expected:
            raise ShardError(
                f"member disagrees with the manifest: dtype {got[0]}, shape {got[1]}, header {got[2]} bytes in the shard; "
                f"manifest says dtype {expected[0]}, shape {expected[1]}, header {expected[2]} bytes",
                shard=self.shard_url(k), member=self._member(i), offset=int(m.offset[i]))
        return got[2]

    def _member(self, i: int) -> str:
        return f"{self.manifest.key(i)}.npy" + (".zst" if self.manifest.compression else "")

    # -- compressed members: read whole, decompress, lay out the array data ---------------------
    def _read_compressed(self, uniq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        import zstandard

        m = self.manifest
        sb = m.step_bytes
        shard = np.searchsorted(m.shard_starts, uniq, side="right") - 1
        nbytes = m.length[uniq] * sb
        base = np.zeros(len(uniq) + 1, dtype=np.int64)
        np.cumsum(nbytes, out=base[1:])
        tail = int(nbytes.max()) if len(uniq) else 0
        buf = np.zeros(int(base[-1]) + tail, dtype=np.uint8)
        dctx = zstandard.ZstdDecompressor()
        for j, i in enumerate(uniq.tolist()):
            k, off, size = int(shard[j]), int(m.offset[i]), int(m.size[i])
            raw = bytearray(size)
            self._read_into(k, off, memoryview(raw))
            try:
                data = dctx.decompress(bytes(raw), max_output_size=int(m.hlen[i]) + int(nbytes[j]))
            except zstandard.ZstdError as e:
                raise ShardError(f"cannot decompress member: {e}", shard=self.shard_url(k), member=self._member(i), offset=off) from e
            hlen = self._check_header(data[: int(m.hlen[i])], i, k)
            if len(data) != hlen + nbytes[j]:
                raise ShardError(f"member holds {len(data) - hlen} data bytes, manifest says {nbytes[j]}",
                                 shard=self.shard_url(k), member=self._member(i), offset=off)
            buf[base[j] : base[j + 1]] = np.frombuffer(data, dtype=np.uint8, offset=hlen)
        return buf, base[:-1]

    # -- raw reads with retries -----------------------------------------------------------------
    def _read_into(self, k: int, offset: int, out: memoryview) -> None:
        path = join(self.root, self.manifest.shards[k].name)
        done = 0
        attempt = 0
        while done < len(out):
            try:
                n = self._read_chunk(path, offset + done, out[done : done + (len(out) - done if self.local else CHUNK)])
            except (FileNotFoundError, PermissionError) as e:
                raise ShardError(f"cannot open shard: {e}", shard=self.shard_url(k), offset=offset + done) from e
            except Exception as e:  # transient storage errors: retry from the byte where it broke
                attempt += 1
                if attempt > self.retries:
                    raise ShardError(f"read failed after {self.retries} retries: {type(e).__name__}: {e}",
                                     shard=self.shard_url(k), offset=offset + done) from e
                with self._lock:
                    self.stats.retries += 1
                time.sleep(self.backoff * 2 ** (attempt - 1))
                continue
            if n == 0:
                raise ShardError(f"shard ends early: wanted {len(out)} bytes at offset {offset}, got {done}",
                                 shard=self.shard_url(k), offset=offset + done)
            done += n
        with self._lock:
            self.stats.bytes_read += len(out)
            self.stats.reads += 1

    def _read_chunk(self, path: str, offset: int, out: memoryview) -> int:
        if self.local:
            with open(path, "rb", buffering=0) as f:
                f.seek(offset)
                got = 0
                while got < len(out):
                    n = f.readinto(out[got:])
                    if not n:
                        break
                    got += n
                return got
        data = self.fs.cat_file(path, start=offset, end=offset + len(out))
        out[: len(data)] = data
        return len(data)
