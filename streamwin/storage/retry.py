"""Retries of transient storage errors with exponential backoff, and what retrying cannot help."""
from __future__ import annotations

import errno
import time
from typing import Callable, TypeVar

from streamwin.errors import StreamwinError

T = TypeVar("T")
# errors that no retry can cure, raised at once: nothing there, not allowed, a file where a directory goes (or back)
FINAL = (FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError, StreamwinError)


def permanent(error: BaseException) -> str | None:
    """Why retrying ``error`` cannot help ("connection refused", "no credentials", ...), or None.

    Looks through the chain of causes, where botocore, aiohttp and urllib3 keep the socket's
    error, without importing any of them.
    """
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ConnectionRefusedError) or getattr(e, "errno", None) == errno.ECONNREFUSED:
            return "connection refused"
        if isinstance(e, (NotADirectoryError, IsADirectoryError)):
            return "a file where a directory belongs" if isinstance(e, NotADirectoryError) else "a directory, not a file"
        if isinstance(e, ConnectionError) and str(e).startswith("cannot connect"):  # storage.manifests says so
            return "cannot connect"
        names = {c.__name__ for c in type(e).__mro__}
        if names & {"NoCredentialsError", "PartialCredentialsError"}:
            return "no credentials (give key/secret in storage_options, or configure AWS credentials)"
        todo += [e.__cause__, e.__context__]
    return None


def with_retries(call: Callable[[], T], *, retries: int, backoff: float) -> T:
    """``call()``, retried on transient errors with exponential backoff (``backoff``, 2x, 4x, ...).

    A missing or forbidden object (FileNotFoundError, PermissionError), a path through a file
    or to a directory (NotADirectoryError, IsADirectoryError), a StreamwinError (bad data) and
    an error that retrying cannot help (see ``permanent``) are raised at once; any other error
    is raised as is once ``retries`` retries have failed too.
    """
    for attempt in range(retries + 1):
        try:
            return call()
        except FINAL:
            raise
        except Exception as e:
            if attempt == retries or permanent(e):
                raise
            time.sleep(backoff * 2**attempt)
    raise AssertionError("unreachable")


def describe(error: BaseException, retries: int) -> str:
    """How a failed storage call ends in an error message: the permanent cause, or the retries spent."""
    why = permanent(error)
    if why is not None:
        return f"{why}: {type(error).__name__}: {error}"
    return f"failed after {retries} retries: {type(error).__name__}: {error}"
