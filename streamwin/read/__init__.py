"""Reading: a block of the plan's windows -> one buffer holding the steps they cover.

In: one source's plan (a block's global window indices, via ``locate`` and ``ends``), the
dataset's URL and manifest, and ReadOptions (storage options, retries, on_error, node
cache). Out: a Block (the bytes, and where each window's step 0 lies in them) and
ReadStats. ``ShardReader`` assembles a block; what to fetch is worked out without I/O
(``pieces``, ``runs`` for plain members, ``frames`` for zstd ones), and fetched through a
transport per kind of storage (``local`` files, mapped; ``remote`` ranged GETs; the node
``cached`` copies), zstd members decompressed in ``inflate``. Headers are checked against
the manifest and failures name the shard, member and byte offset (``members``).
"""
from streamwin.read.ahead import LIMIT_BYTES as READAHEAD_BYTES
from streamwin.read.block import READABLE, Block, ReadStats
from streamwin.read.frames import zstd_slice_windows
from streamwin.read.options import ReadOptions
from streamwin.read.reader import ShardReader

__all__ = ["Block", "READABLE", "READAHEAD_BYTES", "ReadOptions", "ReadStats", "ShardReader", "zstd_slice_windows"]
