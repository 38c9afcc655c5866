"""Checks of user arguments, shared by every option object: each names the argument as the user typed it.

A bad value is one ValueError or TypeError whose message names the argument, says what would
be valid and shows what was given (``got ...``), never an internal name. A mistyped keyword of a
public function or class (`check_keywords`) names the parameter it was probably meant as.
"""
from __future__ import annotations

import difflib
import functools
import inspect
import os
from collections.abc import Mapping
from typing import Any, Callable, Iterable, TypeVar

import numpy as np

T = TypeVar("T")


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


def did_you_mean(name: str, known: Iterable[str], cutoff: float = 0.75) -> str:
    """``"; did you mean 'shard_bytes'?"`` when one of ``known`` is close to the mistyped ``name``, else ""."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=cutoff)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_keywords(error: type[Exception] = TypeError, moved: Mapping[str, str] | None = None) -> Callable[[T], T]:
    """Decorator for a public function or class: a keyword argument it does not take is an ``error``
    that names it and the parameter it was probably meant as (``shard_byte=`` -> ``shard_bytes``).

    Where the callable also takes ``**kwargs`` (options it checks itself), only a name close to
    one of its parameters is refused here; any other is left to its own check. ``moved`` maps
    keywords it no longer takes to their new spelling (``cache_dir`` -> ``read=sw.Read(cache_dir=...)``):
    an old one is an ``error`` that names the new.
    """
    def decorate(obj: T) -> T:
        if isinstance(obj, type):  # a class (a dataclass too): its constructor
            obj.__init__ = _checked(obj.__init__, obj.__name__, error, moved or {})  # type: ignore[misc]
            return obj
        return _checked(obj, obj.__name__, error, moved or {})  # type: ignore[return-value]
    return decorate


def _checked(func: Callable, name: str, error: type[Exception], moved: Mapping[str, str]) -> Callable:
    params = inspect.signature(func).parameters.values()
    named = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    open_ended = any(p.kind is p.VAR_KEYWORD for p in params)

    @functools.wraps(func)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not named.issuperset(kwargs):
            for key in sorted(kwargs.keys() - named):
                if key in moved:
                    raise error(f"{name}({key}=...) is now {name}({moved[key]})")
                hint = did_you_mean(key, named, 0.8 if open_ended else 0.6)
                if hint or not open_ended:
                    raise error(f"{name}() got an unexpected keyword argument {key!r}{hint}")
        return func(*args, **kwargs)
    return call
