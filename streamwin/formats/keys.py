"""Sequence keys: the rules a key obeys, and how keys are derived from file names.

A key becomes a tar member name ``<key>.npy``. webdataset splits a member name into key and
extension at the first dot, and the member must fit a plain ustar header (100 bytes), so a
key is 1..90 printable ASCII characters without ``.``, ``/``, ``\\`` or white space.
"""
from __future__ import annotations

import re

from streamwin.errors import PackError

MAX_KEY_LENGTH = 90
_VALID = re.compile(r"^[!-~]{1,90}$")  # printable ASCII, no space
_FORBIDDEN = set("./\\")


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid sequence key, else raise PackError saying why."""
    if not isinstance(key, str):
        raise PackError(f"sequence key must be a str, got {type(key).__name__}: {key!r}")
    if not _VALID.match(key) or _FORBIDDEN & set(key):
        raise PackError(
            f"invalid sequence key {key!r}: keys are 1..{MAX_KEY_LENGTH} printable ASCII characters "
            "without '.', '/', '\\' or spaces (webdataset splits member names at the first dot); "
            "use streamwin.formats.keys.key_from_name() to derive one from a file name"
        )
    return key


def key_from_name(name: str) -> str:
    """Derive a valid key from a relative path or free text, deterministically.

    ``"a/b/c.part1.npy"`` -> ``"a__b__c_part1"``: the final extension is stripped, path
    separators become ``__``, other forbidden characters ``_``. Too long a name keeps its tail.
    """
    stem = name.replace("\\", "/")
    base = stem.rsplit("/", 1)[-1]
    if "." in base:
        stem = stem[: len(stem) - len(base)] + base.rsplit(".", 1)[0]
    stem = stem.strip("/").replace("/", "__")
    out = "".join(c if ("!" <= c <= "~" and c not in _FORBIDDEN) else "_" for c in stem)
    if len(out) > MAX_KEY_LENGTH:
        out = out[-MAX_KEY_LENGTH:]
    return check_key(out or "_")
