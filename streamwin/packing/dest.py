"""The destination of a pack: what is there, which generation a pack writes, and the commit.

A re-pack never touches the dataset it replaces until it commits. Each pack writes a new
*generation* of shards, named so that they cannot collide with any other generation's::

    index.json                           the commit marker: names generation 7's shards
    shard-g000007-u000000-000000.tar     generation 7, unit 0, shard 0 (see `unit`)
    shard-g000007-u000000-c000000.tar    its continuation members, when generation 7 extended sequences
    shard-g000007-u000000-000000.tar.sums   its chunk checksums (formats/checks.py)
    index-g000007.columns                its per-sequence columns (from COLUMNAR_FROM sequences on)
    index-g000006.json                   the index it replaced, kept with generation 6's shards
    shard-g000006-u000000-000000.tar     ... so that readers of the old index finish their run

The commit, under the pack lock (`lock`): check that index.json is still the one the pack
started from (a generation check), keep it as ``index-gNNNNNN.json``, write the new columns
file, then index.json with one atomic replace (a rename on a local disk, one PUT on object
storage). Only then are older generations removed: every generation but the new one and the
one it replaced, and whatever a killed pack left (shards of a generation never committed,
temporary files). A pack killed at any moment thus leaves the old dataset readable and
unchanged, or the new one complete. Datasets of the layout without generations
(``shard-NNNNNN.tar``) count as generation 0. An append (``mode="append"`` or ``"extend"``)
commits an index that names the shards of every generation it grew through: nothing an index
here names is ever removed, whatever its generation.

Only a holder of the pack lock with no live part beside it (``lock.exclude_parts``) removes
anything, so what it removes was left by dead writers. Temporary files are
``<name>.streamwin-tmp-<32 hex digits>`` where ``<name>`` is one pack writes (`temp_final`).
Files that are not this dataset's (not named by its index, nor by the kept one, nor by a
name pack writes; an index.json that is not a streamwin manifest) make a pack refuse the
destination, naming them, unless ``overwrite``.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable

from streamwin.errors import PackError
from streamwin.formats.manifest import FORMAT, INDEX_NAME, Manifest
from streamwin.packing.lock import PackLock, abandoned_temp, is_lock_file
from streamwin.storage.manifests import write_manifest
from streamwin.storage.urls import TEMP_MARK, is_local, join, remove_if_exists, write_atomic

SHARD = re.compile(r"shard-g(\d+)-u\d+-c?\d+\.tar(?:\.sums)?")  # a generation's shard (and its sums file)
RETIRED = re.compile(r"index-g(\d+)\.json")  # the index a commit replaced
COLUMNS = re.compile(r"index-g(\d+)\.columns")  # a generation's columns file
TEMPORARY = re.compile(rf"(.+){re.escape(TEMP_MARK)}[0-9a-f]{{32}}")  # a write in progress (local disks)
LEGACY_TEMPORARY = re.compile(r"(.+)\.tmp-(?:\d+-)?[0-9a-f]{8}")  # an older streamwin's, of a generation's file only
PART_INDEX = re.compile(r"index\.part\d+-of-(\d+)\.(?:(?:cont|grow)\.)?(json|columns)")
OLD_LAYOUT = re.compile(r"(part\d{5}-)?shard-\d{6}\.tar(\.sums)?|index\.columns")  # generation 0, named by an index


@dataclass
class Survey:
    """What a destination holds when a pack starts."""

    names: list[str]  # every entry at the root (files and folders)
    index: bytes | None  # index.json as it is, None when there is none
    gen: int  # the live dataset's generation (0 for none, or packed before generations)
    kept: int | None  # the generation of the index the last commit replaced, if it is kept
    named: set[str] = field(default_factory=set)  # files the live or kept index names
    live: set[str] = field(default_factory=set)  # files the live index names
    foreign: list[str] = field(default_factory=list)
    ours_index: bool = True  # index.json, if there is one, is a streamwin manifest (else it is foreign)

    @property
    def part_indexes(self) -> list[str]:
        """The part indexes here (``pack --part i/n`` finished, not merged)."""
        return [n for n in self.names if PART_INDEX.fullmatch(n) and re.fullmatch(r"index\.part\d+-of-\d+\.json", n)]

    @property
    def newest(self) -> int:
        """The highest generation any file here belongs to."""
        found = [generation(n) for n in self.names]
        return max([self.gen, self.kept or 0, *[g for g in found if g is not None]])


def generation(name: str) -> int | None:
    """The generation a file name says it belongs to, or None."""
    m = SHARD.fullmatch(name) or RETIRED.fullmatch(name) or COLUMNS.fullmatch(name)
    return int(m.group(1)) if m else None


def shard_prefix(gen: int, unit: int) -> str:
    """The name prefix of the shards of one unit in one generation."""
    return f"shard-g{gen:06d}-u{unit:06d}-"


def retired_name(gen: int) -> str:
    return f"index-g{gen:06d}.json"


def columns_name(gen: int) -> str:
    return f"index-g{gen:06d}.columns"


def survey(fs, root: str) -> Survey:
    """List ``root`` (missing: empty) and read its live and kept indexes."""
    fs.invalidate_cache(root)  # another process may have written since this filesystem listed it
    try:
        names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    except FileNotFoundError:
        names = []
    index = _read(fs, join(root, INDEX_NAME)) if INDEX_NAME in names else None
    ours_index = index is None or _is_streamwin(index)
    live = _index_files(index) if ours_index else []
    gen = _index_generation(live)
    kept_names = sorted((int(RETIRED.fullmatch(n).group(1)), n) for n in names if RETIRED.fullmatch(n))
    kept = kept_names[-1][0] if kept_names else None
    named = set(live)
    for _, name in kept_names:
        named |= set(_index_files(_read(fs, join(root, name))))
    out = Survey(names, index, gen, kept, named, live=set(live), ours_index=ours_index)
    out.foreign = [n for n in names if not _ours(n, named) or (n == INDEX_NAME and not ours_index)]
    return out


def _is_streamwin(index: bytes) -> bool:
    """Whether index.json is a streamwin manifest (one of another tool's, or of a person's, is not ours to replace)."""
    try:
        doc = json.loads(index)
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("format") == FORMAT


def _read(fs, path: str) -> bytes | None:
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        return None


def _index_files(text: bytes | None) -> list[str]:
    """The files an index names (its shards and columns file); none when it cannot be read."""
    if text is None:
        return []
    try:
        doc = json.loads(text)
        names = [s["name"] for s in doc["shards"]]
        checks = doc.get("checks")
        if isinstance(checks, dict) and isinstance(checks.get("suffix"), str):  # each shard's sums file
            names += [n + checks["suffix"] for n in names if isinstance(n, str)]
        if isinstance(doc.get("columns_file"), dict):
            names.append(doc["columns_file"]["name"])
    except (ValueError, KeyError, TypeError):
        return []
    return [n for n in names if isinstance(n, str)]


def _index_generation(files: list[str]) -> int:
    gens = [generation(n) for n in files]
    return max([g for g in gens if g is not None], default=0)


def temp_final(name: str) -> str | None:
    """The name a temporary file of a write in progress will have (None: ``name`` is not one): one of ours only
    when that name is one pack writes, so no user's file (``notes.tmp-2024-05-01``) is taken for one."""
    m = TEMPORARY.fullmatch(name)
    if m:
        return m.group(1) if _ours(m.group(1), set(), temporary=False) else None
    m = LEGACY_TEMPORARY.fullmatch(name)
    return m.group(1) if m and generation(m.group(1)) is not None else None


def _ours(name: str, named: set[str], temporary: bool = True) -> bool:
    return (name in named or name == INDEX_NAME or is_lock_file(name) or generation(name) is not None
            or bool(PART_INDEX.fullmatch(name) or (temporary and temp_final(name) is not None)))


def refuse_foreign(found: Survey, dest: str, overwrite: bool) -> None:
    """PackError naming the files at ``dest`` that are not this dataset's, unless ``overwrite``."""
    if found.foreign and not overwrite:
        shown = ", ".join(n + (" (not a streamwin index)" if n == INDEX_NAME else "") for n in found.foreign[:5])
        shown += f" and {len(found.foreign) - 5} more" if len(found.foreign) > 5 else ""
        raise PackError(f"{dest} holds {len(found.foreign)} file(s) that are not this dataset's: {shown}. pack writes "
                        "only to an empty folder or a streamwin dataset; choose another destination, or pass "
                        "overwrite=True (--overwrite) to replace them (they are removed once the new dataset is "
                        "committed)")


def refuse_unmerged(found: Survey, dest: str, overwrite: bool) -> None:
    """PackError naming the finished parts of `pack --part i/n` at ``dest`` that a whole pack would discard, unless
    ``overwrite``."""
    parts = found.part_indexes
    if parts and not overwrite:
        raise PackError(f"{dest} holds {len(parts)} finished part(s) of `pack --part i/n` not merged yet: "
                        f"{', '.join(parts[:3])}{' ...' if len(parts) > 3 else ''}. Merge them (streamwin merge "
                        f"{dest}), or pass overwrite=True (--overwrite) to discard them with this pack")


def remove_generations(fs, root: str, found: Survey, keep: set[int], *, parts: bool = True,
                       protect: set[str] | None = None) -> None:
    """Remove every file of a generation not in ``keep``, temporaries, part indexes (``parts``), and old-layout
    files a retired index names; never a file of ``protect`` (default: what any index here names; an appended
    dataset's index names shards of many generations)."""
    protect = found.named if protect is None else protect
    for name in found.names:
        final = temp_final(name)
        if final is not None:  # only lock holders write data here: a temporary file now is a dead writer's
            if not is_lock_file(final) or abandoned_temp(fs, join(root, name)):  # (locks are written by anyone)
                remove_if_exists(fs, join(root, name))
            continue
        gen = generation(name)
        old = OLD_LAYOUT.fullmatch(name) and 0 not in keep and name in found.named and name not in protect
        if (gen is not None and gen not in keep and name not in protect) or old or \
                (parts and PART_INDEX.fullmatch(name)):
            remove_if_exists(fs, join(root, name))


def write_index(fs, root: str, manifest: Manifest, gen: int) -> None:
    """index.json (atomic), after its columns file ``index-gNNNNNN.columns`` when there are COLUMNAR_FROM sequences
    (named by generation: a re-pack never overwrites the columns file the live index names)."""
    write_manifest(fs, root, manifest, columns=columns_name(gen))


def commit(fs, root: str, dest: str, manifest: Manifest, gen: int, start: Survey, overwrite: bool = False) -> None:
    """Replace the dataset at ``root`` by ``manifest`` (generation ``gen``), atomically for readers; then clean."""
    now = _read(fs, join(root, INDEX_NAME))
    if now != start.index:
        raise PackError(f"{dest} was committed by another pack while this one ran (its index.json changed): this pack "
                        "does not commit, and the dataset there is the other pack's")
    if start.index is not None and start.ours_index:  # keep the index being replaced: its shards stay for the
        write_atomic(fs, join(root, retired_name(start.gen)), start.index)
    write_index(fs, root, manifest, gen)
    after = survey(fs, root)  # what the new index and the one it replaced name stays, the rest goes
    remove_generations(fs, root, after, {gen, start.gen}, protect=after.live | set(_index_files(start.index)))
    for name in after.names:
        if RETIRED.fullmatch(name) and int(RETIRED.fullmatch(name).group(1)) != start.gen:
            remove_if_exists(fs, join(root, name))
    if overwrite:
        for name in start.foreign:
            if name != INDEX_NAME:  # (a foreign index.json is replaced by ours, not kept)
                _remove_tree(fs, join(root, name))


def _remove_tree(fs, path: str) -> None:
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass


def prepare(fs, root: str) -> None:
    """Make ``root`` ready to write: a local folder is created (object stores need no folders; their
    bucket is checked, and created only when asked, by ``sources.open_dest``)."""
    if is_local(fs):
        fs.makedirs(root, exist_ok=True)


def committed(fs, root: str, dest: str, build: Callable[[], Manifest], gen: int, start: Survey, lock: PackLock,
              overwrite: bool) -> Manifest:
    """``build()`` the new generation (under ``lock``) and commit it; on any failure remove what it wrote and
    re-raise."""
    try:
        manifest = build()
        lock.check()
        commit(fs, root, dest, manifest, gen, start, overwrite)
        return manifest
    except BaseException as e:
        if not lock.holds():  # taken over: what is here is the other pack's now; it removes what this one wrote
            if isinstance(e, Exception) and not isinstance(e, PackError):
                lock.check()  # say that, not the symptom
            raise
        try:
            after = survey(fs, root)
            mine = [n for n in after.names if generation(temp_final(n) or n) == gen and n not in after.named]
            remove_generations(fs, root, Survey(mine, None, 0, None), {g for g in (after.gen, after.kept)}, parts=False)
        except Exception:  # the next pack removes what is left
            pass
        raise
