"""Checks of user arguments, shared by every option object: each names the argument as the user typed it.

A bad value is one ValueError or TypeError whose message names the argument, says what would
be valid and shows what was given (``got ...``), never an internal name.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np


def is_real(value: Any) -> bool:
    """An int or float (numpy ones too) but not a bool; NaN passes here and fails every bound check."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


# Bounds of counts no data can need: past them, sizes computed from them would overflow 64-bit integers.
MAX_STEPS = 1 << 50  # window, stride, horizon, pack_length...: steps (a sequence of 1-byte steps holds fewer)
MAX_WINDOWS = (1 << 40) - 1  # shuffle_buffer, slice_windows: windows (what a loader state allows)
MAX_BATCH = (1 << 31) - 1  # batch_size (what a loader state allows)


def check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    """An integer (numpy ones too, bool not) of at least ``low`` (and at most ``high``), else an error naming
    ``name``."""
    want = f"an integer >= {low}" if high is None else f"an integer in {low}..{high:,}"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be {want}, got {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be {want}, got {value!r}")


def check_bool(name: str, value: Any) -> None:
    """True or False (numpy's too), else a TypeError naming ``name``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """One of ``choices`` (strings), else a ValueError naming ``name`` and listing them."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be {' or '.join(map(repr, choices))}, got {value!r}")


def memory_bytes() -> int | None:
    """This machine's physical memory in bytes (None where the system does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(need: int, what: str) -> None:
    """A ValueError when ``need`` bytes (what ``what`` asks for) exceed this machine's memory, with both sizes."""
    total = memory_bytes()
    if total is not None and need > total:
        raise ValueError(f"{what} would need {need / 1e9:,.1f} GB of memory, more than this machine's "
                         f"{total / 1e9:,.1f} GB: make it smaller")
