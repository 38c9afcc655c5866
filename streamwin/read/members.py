"""The manifest's members as errors name them, and their ``.npy`` headers checked against it.

Every error of the read side names the shard (its URL), the member (``<key>.npy``, or
``<key>.npy.zst``) and the byte offset; a header a read covers must say what the manifest
says (dtype, shape, header length) before any window is cut from the member.
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

    def shard_url(self, k: int) -> str:
        """The URL of shard k, as errors name it."""
        return f"{self.url}/{self.manifest.shards[k].name}"

    def shard_of(self, i: int) -> int:
        """The shard that holds member i."""
        return int(np.searchsorted(self.manifest.shard_starts, i, side="right")) - 1

    def name(self, i: int) -> str:
        """Member i's name in its shard."""
        return f"{self.manifest.key(i)}.npy" + (".zst" if self.manifest.compression else "")

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
