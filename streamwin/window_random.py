"""Random draws of a transform, one stream per window: augmentation that is part of the order.

A loader's transform gets ``rng``, a ``WindowRandom``: every draw's first dimension is the
batch's rows, and row i comes from window i's own stream, keyed by (seed, epoch, the
window: its source, sequence index, start and length; a packed row: its first crop's). So
numpy code written for the whole batch::

    noisy = x + 0.1 * rng.standard_normal(x.shape, dtype=np.float32)
    tokens[rng.random(tokens.shape) < 0.15] = 0

gives a window the same values in any batch it lands in: on any number of ranks and
workers, after an exact or an elastic resume. Rows that are the same window (a repeat
of ``equalize="pad"``) draw the same values. Row i's n-th draw of a batch depends only on its key,
n, and the shape of a row (``size[1:]``):

- up to SMALL values a row: a counter hash (splitmix64 of the row's key for draw n plus j + 1,
  for value j), all rows at once;
- more: a numpy PCG64 generator whose state is a hash of the row's key for draw n, one call a
  row (its fixed cost is small beside that many values).

``rng.row(i)`` is a numpy Generator of row i's own (for what the methods here do not draw).
"""
from __future__ import annotations

import numpy as np
from numpy.random import PCG64, Generator  # at import: numpy imports it lazily, and a Ctrl-C in that import is lost

SMALL = 256  # values a row up to which a draw hashes (all rows at once) instead of a generator a row
GOLD, M1, M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
ROW_DRAW = 1 << 40  # the draw number of ``row(i)``'s generator (no batch draws that many times)
_MASK = (1 << 64) - 1


def mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer of uint64 ``z`` (a new array): a bijection whose outputs look random."""
    with np.errstate(over="ignore"):
        z = z ^ (z >> np.uint64(30))
        z *= M1
        z ^= z >> np.uint64(27)
        z *= M2
        z ^= z >> np.uint64(31)
    return z


def window_keys(seed: int, epoch: int, columns: list[np.ndarray]) -> np.ndarray:
    """[rows] uint64: a hash of (seed, epoch, and each row's values of ``columns``, in order)."""
    n = len(columns[0])
    with np.errstate(over="ignore"):
        h = mix(np.full(n, (int(seed) & _MASK), dtype=np.uint64) + GOLD)
        h = mix(h ^ np.uint64(int(epoch) & _MASK))
        for col in columns:
            h = mix((h + GOLD) ^ np.asarray(col, dtype=np.int64).view(np.uint64))
    return h


def batch_keys(seed: int, epoch: int, batch: dict[str, np.ndarray], rows: int) -> np.ndarray:
    """[rows] uint64 keys of a gathered batch's rows: each window's (source, sequence, start, length); a packed
    row's, its first crop's (a row with none: one key for all such rows)."""
    crops = int(batch["crops"][0]) if "crops" in batch else None
    n = len(batch["seq"]) if crops is None else crops
    zeros = np.zeros(n, dtype=np.int64)
    cols = [batch["source"][:n] if "source" in batch else zeros, batch["seq"][:n], batch["start"][:n],
            batch["length"][:n] if "length" in batch else zeros]
    keys = window_keys(seed, epoch, cols)
    if crops is None:
        return keys
    first = np.full(rows, n, dtype=np.int64)  # each row's first crop (n: it has none)
    np.minimum.at(first, batch["row"][:n], np.arange(n))
    out = np.full(rows, window_keys(seed, epoch, [np.full(1, -1, dtype=np.int64)])[0], dtype=np.uint64)
    has = first < n
    out[has] = keys[first[has]]
    return out


class WindowRandom:
    """Draws whose row i comes from row i's own stream (module docstring): numpy Generator methods, ``size``
    required, its first dimension the batch's rows."""

    def __init__(self, keys: np.ndarray):
        self.keys = np.asarray(keys, dtype=np.uint64)
        self.rows = len(self.keys)
        self._draws = 0
        self._bits = PCG64(0)
        self._gen = Generator(self._bits)
        self._row_gens: dict[int, Generator] = {}

    def __repr__(self) -> str:
        return f"WindowRandom({self.rows} rows, {self._draws} draws so far)"

    # -- the draws ---------------------------------------------------------------------------------------
    def random(self, size=None, dtype=np.float64) -> np.ndarray:
        """Uniform in [0, 1), float64 or float32."""
        return self._core("random", size, dtype)

    def standard_normal(self, size=None, dtype=np.float64) -> np.ndarray:
        """Standard normal, float64 or float32."""
        return self._core("standard_normal", size, dtype)

    def standard_exponential(self, size=None, dtype=np.float64) -> np.ndarray:
        """Exponential of scale 1, float64 or float32."""
        return self._core("standard_exponential", size, dtype)

    def normal(self, loc=0.0, scale=1.0, size=None) -> np.ndarray:
        """Normal of mean ``loc`` and deviation ``scale`` (each a number, or an array that broadcasts to size)."""
        return _affine(self._core("standard_normal", size, np.float64), scale, loc)

    def uniform(self, low=0.0, high=1.0, size=None) -> np.ndarray:
        """Uniform in [low, high) (each a number, or an array that broadcasts to size)."""
        low = np.asarray(low)
        return _affine(self._core("random", size, np.float64), np.asarray(high) - low, low)

    def exponential(self, scale=1.0, size=None) -> np.ndarray:
        """Exponential of scale ``scale``."""
        return _affine(self._core("standard_exponential", size, np.float64), scale, 0.0)

    def integers(self, low, high=None, size=None, dtype=np.int64, endpoint: bool = False) -> np.ndarray:
        """Integers uniform in [low, high) ([low, high] with ``endpoint``; [0, low) without ``high``): floor of a
        uniform draw times the range, whose bias (below range / 2**53) is nothing for ranges below 2**40."""
        if high is None:
            low, high = 0, low
        low, high = np.asarray(low, dtype=np.int64), np.asarray(high, dtype=np.int64) + (1 if endpoint else 0)
        span = high - low
        if (span <= 0).any() or (span > 1 << 40).any():
            raise ValueError(f"rng.integers needs low < high (high - low up to 2**40), got low={low.tolist()}, "
                             f"high={(high - (1 if endpoint else 0)).tolist()}")
        u = self._core("random", size, np.float64)
        out = np.minimum(np.floor(u * span).astype(np.int64), span - 1) + low
        return out.astype(dtype, copy=False)

    def row(self, i: int) -> Generator:
        """A numpy Generator of row ``i``'s own (the same object for the batch: its draws go on), for draws the
        methods here do not make (``choice``, ``permutation``, ...)."""
        i = int(i)
        if not 0 <= i < self.rows:
            raise IndexError(f"rng.row({i}): the batch has {self.rows} rows")
        gen = self._row_gens.get(i)
        if gen is None:
            bits = PCG64(0)
            bits.state = _pcg_states(self.keys[i : i + 1], ROW_DRAW)[0]
            gen = self._row_gens[i] = Generator(bits)
        return gen

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(
            f"rng.{name}: a transform's rng draws one row per window (random, standard_normal, normal, uniform, "
            "integers, exponential, standard_exponential); for other draws take row i's numpy Generator, "
            "rng.row(i)")

    # -- how --------------------------------------------------------------------------------------------
    def _core(self, method: str, size, dtype) -> np.ndarray:
        """Draw ``method`` (a numpy Generator method taking dtype and out) of ``size``, row i from row i's stream."""
        shape = self._shape(method, size)
        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise TypeError(f"rng.{method}: dtype must be float32 or float64, got {dtype}")
        draw, self._draws = self._draws, self._draws + 1
        per = int(np.prod(shape[1:], dtype=np.int64))
        out = np.empty(shape, dtype=dtype)
        if per == 0 or self.rows == 0:
            return out
        if per <= SMALL:
            out[...] = _hashed(method, _draw_keys(self.keys, draw), per, dtype).reshape(shape)
            return out
        bits, fn = self._bits, getattr(self._gen, method)
        rows = out.reshape(self.rows, per)
        for i, state in enumerate(_pcg_states(self.keys, draw)):
            bits.state = state
            fn(dtype=dtype, out=rows[i])
        return out

    def _shape(self, method: str, size) -> tuple[int, ...]:
        if size is None:
            shape = None
        else:
            try:
                shape = (int(size),) if np.ndim(size) == 0 else tuple(int(s) for s in size)
            except (TypeError, ValueError):
                raise TypeError(f"rng.{method}: size must be an int or a tuple of ints, got {size!r}") from None
        if not shape or shape[0] != self.rows:
            raise ValueError(
                f"rng.{method}(size={size!r}): a transform's rng draws one row per window, so size's first "
                f"dimension must be the batch's {self.rows} rows (e.g. size=x.shape); for draws of one window, "
                "rng.row(i) is a numpy Generator of row i's own")
        return shape


def _affine(z: np.ndarray, scale, shift) -> np.ndarray:
    """shift + scale * z: in place where both are numbers (one pass less over a large draw), else broadcast."""
    if np.ndim(scale) == 0 and np.ndim(shift) == 0:
        z *= scale
        z += shift
        return z
    return np.asarray(shift) + np.asarray(scale) * z


def _draw_keys(keys: np.ndarray, draw: int) -> np.ndarray:
    """[rows] uint64: each row's key for draw number ``draw``."""
    return mix(keys ^ mix(np.array([draw], dtype=np.uint64) + GOLD))


def _pcg_states(keys: np.ndarray, draw: int) -> list[dict]:
    """Per row, a PCG64 state (128-bit state and odd increment) hashed from its key for draw ``draw``."""
    a = _draw_keys(keys, draw)
    with np.errstate(over="ignore"):
        b = mix(a + GOLD)
        c = mix(b + GOLD)
        d = mix(c + GOLD)
    return [{"bit_generator": "PCG64", "state": {"state": (p << 64) | q, "inc": (r << 64) | s | 1},
             "has_uint32": 0, "uinteger": 0} for p, q, r, s in zip(a.tolist(), b.tolist(), c.tolist(), d.tolist())]


def _hashed(method: str, keys: np.ndarray, per: int, dtype: np.dtype) -> np.ndarray:
    """[rows, per] of ``method``'s distribution from splitmix64 counters (values j = 1..per after each key)."""
    with np.errstate(over="ignore"):
        bits = mix(keys[:, None] + np.arange(1, per + 1, dtype=np.uint64) * GOLD)
    if method == "random":  # as numpy: 53 bits for float64, 24 for float32 (never rounds up to 1)
        if dtype == np.float32:
            return ((bits >> np.uint64(40)) * (1.0 / (1 << 24))).astype(dtype)
        return (bits >> np.uint64(11)) * (1.0 / (1 << 53))
    if method == "standard_exponential":  # of u in (0, 1]: never log(0)
        return (-np.log(((bits >> np.uint64(11)) + np.uint64(1)) * (1.0 / (1 << 53)))).astype(dtype)
    # standard_normal, Box-Muller: the radius from the high 32 bits (u in (0, 1]), the angle from the low 32
    u = ((bits >> np.uint64(32)) + np.uint64(1)) * (1.0 / (1 << 32))
    angle = (bits & np.uint64(0xFFFFFFFF)) * (2 * np.pi / (1 << 32))
    return (np.sqrt(-2.0 * np.log(u)) * np.cos(angle)).astype(dtype)
