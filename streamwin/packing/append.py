"""Append to a packed dataset: new sequences, and new steps of the sequences it holds, in a new generation.

``pack(inputs, dest, mode="append")`` packs the inputs as a new generation of shards beside
the dataset's, under the same lock as any pack, and commits one manifest for the old and
the new (`grow.grow`): nothing already there is rewritten, so an append writes its own
bytes and a manifest. ``mode="extend"`` also takes keys the dataset holds: their steps are
written as continuation members of those sequences (formats/growth.py). The commit is the
same as a pack's (`dest.commit`): index.json replaced in one atomic write after the index
it replaces is kept, checked to be the one the append started from; a killed or failed
append leaves the dataset as it was. Readers of the dataset keep the generation they
loaded: its shards are all named by the new index too, and its sequences and lengths are a
view of the new manifest (``Growth.lengths_at``).
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Callable, Iterator

from streamwin.errors import PackError
from streamwin.formats.manifest import Manifest
from streamwin.packing.dest import Survey, committed, refuse_foreign, refuse_unmerged, remove_generations, survey
from streamwin.packing.grow import ExistingKeys, grow
from streamwin.packing.lock import PackLock, exclude_parts
from streamwin.storage.manifests import load_manifest

GROW_MODES = ("append", "extend")


@contextlib.contextmanager
def new_generation(fs, root: str, dest: str, overwrite: bool, what: str = "pack"
                   ) -> Iterator[tuple[PackLock, Survey, int]]:
    """Under the pack lock, with no live part beside it: (the lock, what ``dest`` holds, the generation to write),
    once foreign files and unmerged parts are refused and what killed packs left is removed."""
    with PackLock(fs, root, dest, what=what) as lock:
        exclude_parts(fs, root, dest, lock)
        start = survey(fs, root)
        refuse_foreign(start, dest, overwrite)
        refuse_unmerged(start, dest, overwrite)
        remove_generations(fs, root, start, {start.gen, start.kept})  # what killed packs left
        gen = max(start.newest, lock.stale_gen) + 1
        lock.set_generation(gen)
        yield lock, start, gen


def append(fs, root: str, dest: str, storage_options: dict | None, run: Callable[..., object], *, mode: str,
           gaps: str, overwrite: bool) -> tuple[Manifest, list[Manifest]]:
    """Pack ``run``'s units as a new generation and commit the dataset grown by them: (its manifest, the manifests
    of what this append wrote). An empty destination is packed as a new dataset."""
    with new_generation(fs, root, dest, overwrite, what=f"pack --{mode}") as (lock, start, gen):
        if start.index is None:  # nothing to append to: this is the dataset's first pack
            manifest = committed(fs, root, dest, lambda: run(gen), gen, start, lock, overwrite)
            return manifest, [manifest]
        old = load_manifest(dest, storage_options)
        if start.ours_index and old.digest != _digest(start.index):
            raise PackError(f"{dest} was committed by another pack while this append started: run it again")
        existing = ExistingKeys.of(old, gen, gaps) if mode == "extend" else None
        written: list[Manifest] = []

        def build() -> Manifest:
            heads, conts = run(gen, existing, growing=True)
            written.extend(m for m in (heads, conts) if m is not None)
            return grow(old, heads, conts, extend=mode == "extend", dest=dest)
        return committed(fs, root, dest, build, gen, start, lock, overwrite), written


def growing_part(dest: str, storage_options: dict | None, run: Callable[..., object], gen: int, mode: str, gaps: str,
                 start: Survey) -> tuple[tuple[Manifest | None, Manifest | None], dict]:
    """Pack a part of an append as generation ``gen``: ((its new sequences' index, its continuations' index), what
    it grows: {"mode", "base": the digest of the manifest live when it started, "continued"}); `parts.merge` grows
    that manifest by every part."""
    old = load_manifest(dest, storage_options) if start.index is not None else None
    if old is not None and start.ours_index and old.digest != _digest(start.index):
        raise PackError(f"{dest} was committed by another pack while this part started: run it again")
    existing = ExistingKeys.of(old, gen, gaps) if mode == "extend" and old is not None else None
    heads, conts = run(gen, existing, growing=True)
    if heads is None and conts is None:
        raise PackError("the input yielded no non-empty sequence: nothing to pack")
    return (heads, conts), {"mode": mode, "base": old.digest if old is not None else None, "continued": conts is not None}


def _digest(index: bytes) -> str:
    """The digest a manifest loaded from these index.json bytes has (Manifest.digest)."""
    return hashlib.sha256(index).hexdigest()[:16]
