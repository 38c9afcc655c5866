"""Progress bars that suit where they are written: redrawn in place on a terminal, plain lines in a log.

tqdm redraws its bar with carriage returns. On a terminal that is one line kept current; written
to a file or a pipe (a SLURM log, a CI job, ``2> pack.log``) every redraw stays, as kilobytes
of one ever-growing line. `progress_bar` is tqdm where the output is a terminal (or a notebook,
whose bars are widgets), and elsewhere prints the same bar as a plain line at most every
PLAIN_EVERY seconds, and once more when it closes.
"""
from __future__ import annotations

import sys
from typing import Any, TextIO

from tqdm.auto import tqdm

PLAIN_EVERY = 30.0  # seconds between two plain lines in a log


def progress_bar(iterable: Any = None, *, disable: bool = False, file: TextIO | None = None, **kw: Any) -> tqdm:
    """A tqdm bar on ``file`` (default stderr): redrawn on a terminal, a plain line every PLAIN_EVERY s elsewhere."""
    out = sys.stderr if file is None else file
    if disable or _terminal(out) or _notebook():
        return tqdm(iterable, disable=disable, file=out, dynamic_ncols=True, **kw)
    return tqdm(iterable, file=_Lines(out), mininterval=PLAIN_EVERY, **kw)


def _terminal(out: TextIO) -> bool:
    try:
        return bool(out.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _notebook() -> bool:
    """Whether tqdm.auto chose Jupyter's widget bars (they write no carriage returns anywhere)."""
    return any(c.__module__ == "tqdm.notebook" for c in tqdm.__mro__)


class _Lines:
    """A stream that writes each of tqdm's redraws as one plain line."""

    def __init__(self, out: TextIO):
        self.out = out
        self.encoding = getattr(out, "encoding", None) or "utf-8"

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip()
        if line:
            self.out.write(line + "\n")

    def flush(self) -> None:
        self.out.flush()
