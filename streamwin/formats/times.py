"""Timestamps and durations as int64 nanoseconds (timestamps since 1970, UTC): exactly, or not at all.

A per-sequence field stores both as int64 ns, which holds 1677-09-21 to 2262-04-11 and
durations of up to about 292 years. numpy's ``astype("datetime64[ns]")`` wraps silently
outside that range (``3000-01-01`` becomes a day of 1830) and Python's int conversion
overflows with a bare OverflowError, so every conversion goes through here: a value in any
numpy unit (``ns`` to ``W``; ``Y``/``M`` timestamps too) or a ``datetime``/``date``/
``timedelta`` comes back as its exact ns, or as the reason it has none: out of range, a
fraction of a ns, or a duration in months or years (calendar units of no fixed length).
"""
from __future__ import annotations

import datetime as dt
from fractions import Fraction
from typing import Any

import numpy as np

LOW, HIGH = -(1 << 63) + 1, (1 << 63) - 1  # int64 ns; -(1 << 63) is NaT
SPAN = "1677-09-21 to 2262-04-11"
_NS = {"W": 604_800 * 10**9, "D": 86_400 * 10**9, "h": 3_600 * 10**9, "m": 60 * 10**9, "s": 10**9, "ms": 10**6,
       "us": 10**3, "ns": 1, "ps": Fraction(1, 10**3), "fs": Fraction(1, 10**6), "as": Fraction(1, 10**9)}
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


def column_ns(values: np.ndarray) -> tuple[np.ndarray, int, str]:
    """A datetime64 or timedelta64 array as int64 ns (NaT stays NaT: int64 min), or, when a value has no exact int64
    ns, the first such value's index and why (else -1 and "")."""
    unit, count = np.datetime_data(values.dtype)
    duration = values.dtype.kind == "m"
    raw = values.view(np.int64)
    nat = raw == np.iinfo(np.int64).min
    if unit in ("Y", "M"):
        if duration:
            return raw, int(np.argmin(nat)), f"a duration in {'years' if unit == 'Y' else 'months'}: a calendar unit " \
                "of no fixed length"
        months = raw * count * (12 if unit == "Y" else 1)
        far = np.flatnonzero(~nat & (np.abs(months) > 12 * 400))  # 400 years from 1970: past 2262 whatever the day
        if len(far):
            return raw, int(far[0]), _outside(values[far[0]], duration)
        raw, unit, count = np.where(nat, raw, values.astype("datetime64[D]").view(np.int64)), "D", 1
    if unit == "generic":
        return raw, int(np.argmin(nat)), "a value of no unit"
    per = Fraction(_NS[unit]) * count
    q, r = np.divmod(raw, per.denominator)
    low, high = -(-LOW // per.numerator), HIGH // per.numerator
    bad = np.flatnonzero(~nat & ((r != 0) | (q < low) | (q > high)))
    if len(bad):
        i = int(bad[0])
        return raw, i, f"{values[i]} is not a whole number of ns" if r[i] else _outside(values[i], duration)
    return np.where(nat, raw, q * min(per.numerator, HIGH)).astype(np.int64, copy=False), -1, ""


def scalar_ns(value: Any) -> tuple[str, int] | tuple[None, str]:
    """("time" or "duration", ns) of a timestamp or duration of numpy, Python or pandas, or (None, why not)."""
    if isinstance(value, (np.datetime64, np.timedelta64)):
        got, _, why = column_ns(np.array([value]))
        return (None, why) if why else ("time" if value.dtype.kind == "M" else "duration", int(got[0]))
    ns = getattr(value, "value", None)  # pandas Timestamp and Timedelta: their ns, already in range
    if isinstance(value, dt.datetime):
        if isinstance(ns, int):
            return "time", ns
        aware = value if value.tzinfo is not None else value.replace(tzinfo=dt.timezone.utc)
        return _checked("time", _delta_ns(aware - _EPOCH), value)
    if isinstance(value, dt.date):
        return _checked("time", _delta_ns(dt.datetime(value.year, value.month, value.day, tzinfo=dt.timezone.utc)
                                          - _EPOCH), value)
    if isinstance(value, dt.timedelta):
        return ("duration", ns) if isinstance(ns, int) else _checked("duration", _delta_ns(value), value)
    raise TypeError(f"not a timestamp or duration: {value!r}")


def _checked(kind: str, ns: int, value: Any) -> tuple[str, int] | tuple[None, str]:
    return (kind, ns) if LOW <= ns <= HIGH else (None, _outside(value, kind == "duration"))


def _outside(value: Any, duration: bool) -> str:
    held = "durations of up to about 292 years" if duration else SPAN
    return f"{value} is outside what int64 ns hold ({held})"


def _delta_ns(delta: dt.timedelta) -> int:
    return (delta.days * 86_400 + delta.seconds) * 10**9 + delta.microseconds * 1000
