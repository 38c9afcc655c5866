"""Every error streamwin raises on purpose derives from StreamwinError.

Errors about data name where the problem is: the shard, the member and the byte offset,
so a user with a corrupt 256 MB shard out of ten thousand can find it.
"""
from __future__ import annotations

import re


class StreamwinError(Exception):
    """Base class of all streamwin errors."""


class PackError(StreamwinError, ValueError):
    """Input to `pack` that cannot become a dataset (bad key, dtype mismatch, unreadable item)."""


class ManifestError(StreamwinError, ValueError):
    """A missing, unfinished or malformed index.json."""


_WHERE = re.compile(r"\(shard (.+?)(?:, member (.+?))?(?:, byte offset (\d+))?\)\s*$", re.MULTILINE)


class ShardError(StreamwinError):
    """A shard whose bytes disagree with its manifest, or that cannot be read.

    Attributes name the place: ``shard`` (URL), ``member`` (tar member name or None) and
    ``offset`` (byte offset in the shard, or None).
    """

    def __init__(self, message: str, *, shard: str | None = None, member: str | None = None, offset: int | None = None):
        if shard is None:  # re-raised by a DataLoader as ShardError(message=<worker traceback>): recover the place
            found = _WHERE.findall(message)
            if found:
                shard, member, off = found[-1]
                member, offset = member or None, int(off) if off else None
            super().__init__(message)
            self.reason, self.shard, self.member, self.offset = message, shard, member, offset
            return
        where = f"shard {shard}"
        if member is not None:
            where += f", member {member}"
        if offset is not None:
            where += f", byte offset {offset}"
        super().__init__(f"{message} ({where})")
        self.reason = message
        self.shard = shard
        self.member = member
        self.offset = offset

    def __reduce__(self):  # keep the attributes when the error crosses a worker process boundary
        return (_rebuild_shard_error, (self.args[0], self.shard, self.member, self.offset))


def _rebuild_shard_error(text: str, shard: str, member: str | None, offset: int | None) -> ShardError:
    err = ShardError.__new__(ShardError)
    Exception.__init__(err, text)
    err.reason = text.rsplit(" (shard ", 1)[0]
    err.shard, err.member, err.offset = shard, member, offset
    return err


class StateMismatchError(StreamwinError, ValueError):
    """A loader state that was taken under other plan inputs than the loader it is loaded into."""


class WorkerError(StreamwinError, RuntimeError):
    """A loader worker process that died, hung at start or broke its pipe; names the worker and its pid."""
