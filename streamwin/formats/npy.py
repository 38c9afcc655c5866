"""The ``.npy`` members a shard holds: their headers, written and parsed.

Pure functions, no I/O. Headers are parsed with numpy's own safe parser
(``allow_pickle`` never enters: object dtypes are refused before any data is read).
"""
from __future__ import annotations

import io
import sys
import threading
from types import SimpleNamespace

import numpy as np

_MAGIC = b"\x93NUMPY"


def npy_header(arr: np.ndarray) -> bytes:
    """The .npy header (format 1.0, or 2.0 when needed) for a C-ordered copy of ``arr``."""
    buf = io.BytesIO()
    d = {"descr": np.lib.format.dtype_to_descr(arr.dtype), "fortran_order": False, "shape": arr.shape}
    try:
        np.lib.format.write_array_header_1_0(buf, d)
    except ValueError:  # header longer than 65535 bytes
        buf = io.BytesIO()
        np.lib.format.write_array_header_2_0(buf, d)
    return buf.getvalue()


_PARSE = threading.Lock()


def parse_npy_header(data: bytes | memoryview) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, shape, header length) of .npy bytes; ValueError if they are not a plain numeric array."""
    head = bytes(data[:10])
    if len(head) < 10 or head[:6] != _MAGIC:
        raise ValueError("not a .npy member (bad magic bytes)")
    major = head[6]
    if major == 1:
        hlen = 10 + int.from_bytes(head[8:10], "little")
    elif major == 2:
        head = bytes(data[:12])
        hlen = 12 + int.from_bytes(head[8:12], "little")
    else:
        raise ValueError(f"unsupported .npy format version {major}")
    if len(data) < hlen or hlen > 1 << 20:
        raise ValueError(f"truncated .npy header ({len(data)} bytes, header says {hlen})")
    fp = io.BytesIO(bytes(data[:hlen]))
    version = np.lib.format.read_magic(fp)
    reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    try:
        with _PARSE:  # numpy parses with ast.literal_eval, which CPython 3.11 breaks when threads race in it
            shape, fortran, dtype = reader(fp, max_header_size=1 << 20)
    except Exception as e:  # numpy's parser raises ValueError, SyntaxError, tokenize.TokenError, ...
        raise ValueError(f"bad .npy header: {_why(e)}; the header reads {_shown(data[10 if major == 1 else 12:hlen])}") \
            from None
    if dtype.hasobject or dtype.kind not in "biufc":
        raise ValueError(f".npy member has dtype {dtype}: only numeric arrays are read (object arrays would need unpickling)")
    if is_big_endian(dtype):
        raise ValueError(f".npy member has big-endian dtype {dtype.str}: streamwin reads little-endian arrays only "
                         "(streamwin.pack converts big-endian input)")
    if fortran and len(shape) > 1:
        raise ValueError(".npy member is Fortran-ordered; streamwin writes and reads C order only")
    return dtype, tuple(shape), hlen


def _why(error: Exception) -> str:
    """What numpy's header parser found wrong, in a user's words: its own message where it is about the
    header's values, never the internals of the Python tokenizer it parses with."""
    text = str(error)
    if isinstance(error, ValueError) and not text.startswith("Cannot parse header"):
        return text  # e.g. "descr is not a valid dtype descriptor: '<q9'"
    return "not a dictionary of descr, fortran_order and shape"


def _shown(raw) -> str:
    """Header text as an error shows it: printable, at most 100 characters."""
    text = bytes(raw).decode("latin-1").rstrip(" \n")
    return repr(text[:100] + ("..." if len(text) > 100 else ""))


def is_big_endian(dtype: np.dtype) -> bool:
    """Whether ``dtype``'s bytes are big-endian (torch, and streamwin's gather, read native little-endian)."""
    return dtype.byteorder == ">" or (dtype.byteorder == "=" and sys.byteorder == "big")


def npy_header_for(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """``npy_header`` of an array of this dtype and shape, from a cached template instead of
    numpy's formatting on every call. Headers of arrays that differ only in their length, with
    as many digits, differ only in those digits. The writer uses it for every member and the
    reader compares each member's header with it before falling back to a full parse.
    """
    digits = str(int(shape[0]))
    key = (dtype.str, tuple(shape[1:]), len(digits))
    parts = _NPY_TEMPLATES.get(key)
    if parts is None:
        probe = npy_header(SimpleNamespace(dtype=dtype, shape=(10 ** (len(digits) - 1),) + tuple(shape[1:])))
        at = probe.index(b"'shape': (") + len(b"'shape': (")
        parts = _NPY_TEMPLATES[key] = (probe[:at], probe[at + len(digits) :])
    return parts[0] + digits.encode() + parts[1]


_NPY_TEMPLATES: dict[tuple, tuple[bytes, bytes]] = {}
