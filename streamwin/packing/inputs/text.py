"""Text inputs: each file is one uint8 sequence of its bytes (source code, documents).

Option: ``suffixes`` (default: every file of the directory). The key keeps the file's suffix
(``src/x.c`` -> ``src__x_c``) so that ``x.c`` and ``x.h`` stay apart. An empty file gives a
zero-length array.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from streamwin.packing.inputs.base import InputFormat, InputUnit, Item, Report, open_unit, text_key


def read_text(unit: InputUnit, opts: dict, report: Report) -> Iterator[Item]:
    """The bytes of one file."""
    with open_unit(unit) as f:
        data = f.read()
    yield text_key(unit.name), np.frombuffer(data, dtype=np.uint8), None


# any file can be text: ".txt" selects text only where no other format's suffix is found
TEXT = InputFormat("text", read_text, suffixes=(".txt",), options=("suffixes",), one_per_file=True)
