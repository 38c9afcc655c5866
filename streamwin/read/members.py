"""The manifest's members as errors name them, and their headers checked against it.

Every error of the read side names the shard (its URL), the member (``<key>.npy``, or
``<key>.npy.zst``) and the byte offset; the headers a read covers must say what the manifest
says before any window is cut from the member: the tar header its name and size, the
``.npy`` header its dtype, shape and header length.
"""
from __future__ import annotations

import numpy as np

from streamwin.errors import ShardError
from streamwin.formats import npy as npyfmt
from streamwin.formats import tar as tarfmt
from streamwin.formats.manifest import Manifest

PARSED_HEADERS = 4096  # distinct headers that differ from the template, parsed once each


class Members:
    """Names and header checks for the members of one dataset (at ``url``) that ``manifest`` describes."""

    def __init__(self, url: str, manifest: Manifest):
        self.url = url.rstrip("/")
        self.manifest = manifest
        self._parsed: dict[bytes, tuple] = {}  # header bytes -> (dtype, shape, header length)
        self.checked = np.zeros(manifest.num_members, dtype=bool)  # members whose tar header named them rightly
        self.bad = np.zeros(manifest.num_members, dtype=bool)  # members a header check failed (on_error="skip")

    def shard_url(self, k: int) -> str:
        """The URL of shard k, as errors name it."""
        return f"{self.url}/{self.manifest.shards[k].name}"

    def shard_of(self, i: int) -> int:
        """The shard that holds member i."""
        return self.manifest.shard_of(i)

    def name(self, i: int) -> str:
        """Member i's name in its shard."""
        return self.manifest.key(i) + self.suffix

    def error(self, reason: str, i: int, k: int, offset: int) -> ShardError:
        """A ShardError about member i of shard k at byte ``offset``."""
        return ShardError(reason, shard=self.shard_url(k), member=self.name(i), offset=offset)

    def check_header(self, header: bytes, i: int, k: int) -> int:
        """Member i's header length, once ``header`` (its bytes) is found to say what the manifest says."""
        m = self.manifest
        shape = (int(m.length[i]),) + m.step_shape
        hlen = int(m.hlen[i])
        if header == npyfmt.npy_header_for(m.dtype, shape):  # the common case, without a parse
            return hlen
        expected = (m.dtype, shape, hlen)
        got = self._parsed.get(header)
        if got is None:
            try:
                got = npyfmt.parse_npy_header(header)
            except ValueError as e:
                raise self.error(f"bad .npy header: {e}", i, k, int(m.offset[i])) from e
            if len(self._parsed) < PARSED_HEADERS:
                self._parsed[header] = got
        if got != expected:
            raise self.error(
                f"member disagrees with the manifest: dtype {got[0]}, shape {got[1]}, header {got[2]} bytes in the "
                f"shard; manifest says dtype {expected[0]}, shape {expected[1]}, header {expected[2]} bytes",
                i, k, int(m.offset[i]))
        return got[2]

    def unchecked(self, seq: np.ndarray, s_lo: np.ndarray) -> np.ndarray:
        """The sequences (sorted) of pieces ``seq``, ``s_lo`` whose member is not checked yet and that no piece reads
        from step 0 (where its headers are): each gets a read of its headers (pieces.with_headers)."""
        todo = np.unique(seq[~(self.checked[seq] | self.bad[seq])])
        return todo[~np.isin(todo, seq[s_lo == 0])] if len(todo) else todo

    def check_members(self, buf: np.ndarray, at: np.ndarray, seqs: np.ndarray, shards: np.ndarray
                      ) -> list[tuple[int, ShardError]]:
        """Check the tar headers in ``buf`` at ``at`` of members ``seqs`` (of ``shards``) as ``check_member`` does:
        their name and size fields compared at once with those pack writes, and one by one where they differ
        (a pax header, a tar written elsewhere); (row, ShardError) of each that does not name its member."""
        m = self.manifest
        first = np.where(seqs > 0, m.key_ends[np.maximum(seqs - 1, 0)], 0)
        klen = m.key_ends[seqs] - first
        sizes = m.size[seqs]
        plain = np.flatnonzero((klen + len(self.suffix) <= 100) & (sizes <= tarfmt.USTAR_MAX_SIZE))
        same = np.zeros(len(seqs), dtype=bool)
        if len(plain):
            f, n = first[plain], klen[plain]
            blob = np.frombuffer(m.key_blob, dtype=np.uint8)
            keys = blob[np.repeat(f - np.cumsum(n) + n, n) + np.arange(int(n.sum()))]
            want = tarfmt.name_size_fields(keys, np.cumsum(n), self.suffix, sizes[plain])
            got = _rows(buf, at[plain], tarfmt.FIELDS)
            name, size = tarfmt.NAME, tarfmt.SIZE
            same[plain] = (got[:, name] == want[:, name]).all(axis=1) & (got[:, size] == want[:, size]).all(axis=1)
        failed = []
        for row in np.flatnonzero(~same).tolist():
            a = int(at[row])
            try:
                self.check_member(buf[a : a + tarfmt.BLOCK].tobytes(), int(seqs[row]), int(shards[row]))
            except ShardError as e:
                failed.append((row, e))
        return failed

    @property
    def suffix(self) -> str:
        """What follows a key in its member's name."""
        return ".npy" + (".zst" if self.manifest.compression else "")

    def check_member(self, tar: bytes, i: int, k: int) -> None:
        """ShardError unless ``tar``, the 512-byte tar header before member i's content, names member i and gives
        its size as the manifest does: a manifest whose rows or keys were moved (and its seal made anew) would
        otherwise send reads to another member's bytes, which its checksums cannot tell."""
        m = self.manifest
        name, size = self.name(i), int(m.size[i])
        field, prefix = tar[:100].split(b"\0", 1)[0], tar[345:500].split(b"\0", 1)[0]
        got = (prefix + b"/" + field if prefix else field).decode("utf-8", "replace")
        try:
            got_size = int(tar[124:136].split(b"\0", 1)[0].strip() or b"-1", 8)
        except ValueError:
            got_size = -1
        # a name over 100 bytes is in a pax or GNU header before this one, which keeps its first 100 bytes
        named = got == name or (len(name.encode()) > 100 and field == name.encode()[:100])
        if not named or got_size != size:
            raise self.error(f"the shard's tar header here is of member {got!r} of {got_size} bytes; the manifest "
                             f"says {name!r} of {size} bytes: index.json does not describe this shard (edited, or "
                             "another dataset's)", i, k, int(m.offset[i]))

    def name_member(self, err: ShardError, seqs: np.ndarray) -> ShardError:
        """The same error, naming the member (of ``seqs``, sorted) whose bytes hold the failing offset."""
        if err.member is not None or err.offset is None or not len(seqs):
            return err
        starts = self.manifest.offset[seqs] - tarfmt.BLOCK  # each member's tar header
        i = int(seqs[max(int(np.searchsorted(starts, err.offset, side="right")) - 1, 0)])
        named = ShardError(err.reason, shard=err.shard, member=self.name(i), offset=err.offset)
        named.__cause__ = err.__cause__
        return named

    def from_byte(self, err: ShardError, lo: int) -> ShardError:
        """``err`` at byte ``lo`` at least: a read that starts at the checksum chunk before the bytes it needs
        names the first needed byte it could not get, not a byte of the chunk before it."""
        if err.offset is None or err.offset >= lo:
            return err
        moved = ShardError(err.reason, shard=err.shard, member=err.member, offset=int(lo))
        moved.__cause__ = err.__cause__
        return moved

    def byte_order_error(self, i: int) -> ShardError:
        """Why a manifest of big-endian dtype cannot be read (named at member i)."""
        m = self.manifest
        return self.error(f"the manifest declares big-endian dtype {m.dtype.str}: streamwin reads little-endian "
                          "arrays only (streamwin.pack converts big-endian input)", i, self.shard_of(i),
                          int(m.offset[i]))


def _rows(buf: np.ndarray, at: np.ndarray, width: int) -> np.ndarray:
    """[n, width] bytes of ``buf`` from each of ``at``: gathered 8 bytes at a time where all are 8-aligned."""
    if len(at) and not (at % 8).any() and buf.ctypes.data % 8 == 0 and int(at.max()) + width <= len(buf) // 8 * 8:
        words = buf[: len(buf) // 8 * 8].view(np.uint64)
        return words[(at // 8)[:, None] + np.arange(-(-width // 8))].view(np.uint8)[:, :width]
    return buf[at[:, None] + np.arange(width)]
