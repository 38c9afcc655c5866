"""The manifest's seal: ``content_sha256``, a checksum of index.json's own content, checked when it is loaded.

Every field of index.json is validated on load (formats/fields.py), but an edit that keeps
every field valid passes that: two members' offsets swapped (same size, same header) train
one sequence's values under the other's key. So index.json carries the sha256 of all its other
fields as canonical JSON (keys sorted, no spaces, ASCII): the columns (inline), or the columns
file's name, size, sha256 and xxh3_128 (its bytes are checked against the latter when they are
mapped, storage/manifests.py), the shard list, the chunk checks, every count. Every writer (pack, its workers and cluster units,
merge, index) writes index.json through ``Manifest.to_json``, which seals it; a manifest whose
content no longer matches its seal is refused, naming the file and the way to rebuild it. A
manifest without a seal (an older streamwin's) loads (``Manifest.sealed`` False), and the
dataset says so once (``streamwin index`` rewrites it, sealed).

Canonical JSON of the parsed content, not the file's bytes: a manifest re-indented or with
its keys reordered by a JSON tool says the same, and stays valid.
"""
from __future__ import annotations

import hashlib
import json

from streamwin.errors import ManifestError

CONTENT_FIELD = "content_sha256"


def content_checksum(doc: dict) -> str:
    """The sha256 of a manifest's content: every field of ``doc`` but CONTENT_FIELD, as canonical JSON."""
    body = {k: v for k, v in doc.items() if k != CONTENT_FIELD}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def check_seal(doc: dict, where: str) -> bool:
    """Whether ``doc`` is sealed (False: it has no seal, an older streamwin's); ManifestError naming ``where`` if its
    content no longer matches its seal (edited by hand, or damaged)."""
    seal = doc.get(CONTENT_FIELD)
    if seal is None:
        return False
    try:
        good = isinstance(seal, str) and seal == content_checksum(doc)
    except (RecursionError, ValueError) as e:
        raise ManifestError(f"{where} holds values no manifest holds ({type(e).__name__})") from None
    if not good:
        root = where.rsplit("/", 1)[0] if "/" in where else "<dataset>"
        raise ManifestError(f"{where} was changed after streamwin wrote it: its content no longer matches its "
                            f"{CONTENT_FIELD} (an edited offset or key would train one sequence's values under "
                            f"another's name). Rebuild it from the shards with `streamwin index {root}`, or repack")
    return True
