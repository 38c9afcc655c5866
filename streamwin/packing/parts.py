"""Pack a dataset in parts, on many machines at once, then merge their indexes into one index.json.

``pack(..., part="i/n")`` packs the i-th of n disjoint parts of the input's units (a contiguous
run of them, or every n-th item of an iterable) and writes the merged fragment of its units
as a part index (``index.partIIIII-of-NNNNN.json``). Units keep their numbers, so a part
writes exactly the shards a pack in one piece would (``shard-gG-uU-K.tar``), and all parts
write one generation (`part_generation`: the one the other parts of the job write, else a
new one). A part holds its own lock (``lock.part_lock_name``) and gives way to a whole
pack, merge or index, which in turn run only while no part runs (see ``lock``): so no part
writes a name a pack writes, and no pack removes a part's files. `merge` (under the pack lock, like a pack)
checks that every part is there and agrees with the others, and that no two name one shard
(parts of different inputs), then commits the combined index: byte-identical to a pack in
one piece. The part indexes are removed once merged.
"""
from __future__ import annotations

import json
import re

from streamwin.arguments import check_keywords
from streamwin.errors import ManifestError, PackError
from streamwin.formats.manifest import Manifest
from streamwin.packing.dest import PART_INDEX, Survey, commit, generation, survey
from streamwin.packing.fragments import FragmentMerger
from streamwin.packing.inputs import Columns
from streamwin.packing.lock import PART_LOCK, PackLock, exclude_parts, read_lock, stale
from streamwin.storage.manifests import load_manifest, write_manifest
from streamwin.storage.urls import join, remove_if_exists, url_to_fs


def parse_part(part: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """``"i/n"`` or ``(i, n)`` -> (i, n) with 0 <= i < n; None stays None."""
    if part is None:
        return None
    if isinstance(part, str):
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", part)
        if not m:
            raise PackError(f"part must look like 'i/n' (0 <= i < n), got {part!r}")
        part = (int(m.group(1)), int(m.group(2)))
    i, n = part
    if not 0 <= i < n:
        raise PackError(f"part {i}/{n}: need 0 <= i < n")
    return i, n


def part_index_name(i: int, n: int) -> str:
    """The name of part i of n's index: ``index.partIIIII-of-NNNNN.json``."""
    return f"index.part{i:05d}-of-{n:05d}.json"


def part_indexes(dest: str, *, storage_options: dict | None = None) -> list[str]:
    """Names of the part indexes (``index.partIIIII-of-NNNNN.json``) at ``dest``, sorted."""
    fs, root = url_to_fs(dest, storage_options)
    return sorted(p.rsplit("/", 1)[-1] for p in fs.glob(join(root, "index.part*-of-*.json")))


def part_range(count: int, part: tuple[int, int]) -> range:
    """The units of part i of n among ``count``: a contiguous run; PackError when it is empty."""
    i, n = part
    mine = range(i * count // n, (i + 1) * count // n)
    if not mine:
        raise PackError(f"part {i}/{n} is empty: the input has only {count} unit(s) (files); use at most that many parts")
    return mine


def unpublish_part(fs, root: str, part: tuple[int, int]) -> None:
    """Remove part i of n's index before the part is packed (again): until it is written anew, the part
    reads as not finished, whatever its shards hold meanwhile."""
    name = part_index_name(*part)
    remove_if_exists(fs, join(root, name))
    remove_if_exists(fs, join(root, name[: -len(".json")] + ".columns"))


def write_part(fs, root: str, manifest: Manifest, part: tuple[int, int]) -> None:
    """Write part i of n's index (the merged fragment of its units)."""
    write_manifest(fs, root, manifest, part_index_name(*part))


@check_keywords()
def merge(dest: str, *, storage_options: dict | None = None) -> Manifest:
    """Combine the part indexes written by ``pack(..., part="i/n")`` into one index.json, committed as a pack commits.

    Refuses (ManifestError) when a part index is missing, the parts disagree on n, dtype,
    step shape, compression or generation, a key is in two parts, or a shard a part names is missing.
    """
    fs, root = url_to_fs(dest, storage_options)
    _finished_parts(dest, storage_options)  # before the lock: a folder with no parts is not written to
    with PackLock(fs, root, dest, what="merge") as lock:
        exclude_parts(fs, root, dest, lock)
        start = survey(fs, root)
        expected = _finished_parts(dest, storage_options)
        parts = [load_manifest(dest, storage_options, name=name) for name in expected]
        gen = _part_generation(dest, expected, parts, start.gen)
        _check_present(dest, parts, set(start.names))
        merger = FragmentMerger()
        try:
            for name, m in zip(expected, parts):
                columns = None if m.value_columns is None else Columns(m.value_columns,
                                                                         tuple((m.left_out_columns or {}).items()), name)
                merger.add(m, m.dropped_empty, columns, name)
            manifest = merger.finish()
        except PackError as e:
            merger.discard()
            raise ManifestError(f"cannot merge {dest}: {e}") from e
        lock.check()
        commit(fs, root, dest, manifest, gen, start)
    return manifest


def _finished_parts(dest: str, storage_options: dict | None) -> list[str]:
    """The names of all n part indexes at ``dest`` (ManifestError when none, some, or two counts are there)."""
    names = part_indexes(dest, storage_options=storage_options)
    if not names:
        raise ManifestError(f"no part indexes (index.partIIIII-of-NNNNN.json) at {dest}: run pack with --part i/n first")
    counts = sorted({int(re.search(r"-of-(\d+)", name).group(1)) for name in names})
    if len(counts) > 1:
        raise ManifestError(f"part indexes at {dest} are for different part counts {counts}; remove the stale ones")
    n = counts[0]
    expected = [part_index_name(i, n) for i in range(n)]
    missing = [name for name in expected if name not in names]
    if missing:
        raise ManifestError(f"cannot merge {dest}: {len(missing)} of {n} parts are not finished: {', '.join(missing[:5])}")
    return expected


def _part_generation(dest: str, names: list[str], parts: list[Manifest], live: int) -> int:
    """The one generation every part wrote, newer than the live dataset's (else ManifestError)."""
    gens = {name: {generation(s.name) for s in m.shards} for name, m in zip(names, parts)}
    found = set().union(*gens.values())
    if len(found) != 1 or None in found:
        raise ManifestError(f"cannot merge {dest}: the parts wrote shards of different generations "
                            f"{sorted(g for g in found if g is not None)}; re-pack the stale parts")
    gen = found.pop()
    if gen <= live:
        raise ManifestError(f"cannot merge {dest}: the parts wrote generation {gen}, but the dataset there is "
                            f"generation {live} (it was re-packed after they started); re-pack the parts")
    return gen


def _check_present(dest: str, parts: list[Manifest], present: set[str]) -> None:
    seen: dict[str, int] = {}
    for i, m in enumerate(parts):
        for s in m.shards:
            if seen.setdefault(s.name, i) != i:
                raise ManifestError(f"cannot merge {dest}: parts {seen[s.name]} and {i} both name {s.name} (they were "
                                    "packed from different inputs, or with different part counts); re-pack the parts")
    absent = [s.name for m in parts for s in m.shards if s.name not in present]
    if absent:
        raise ManifestError(f"cannot merge {dest}: {len(absent)} shard(s) named by the part indexes are missing: "
                            f"{', '.join(absent[:5])}")


def part_generation(fs, root: str, dest: str, found: Survey, part: tuple[int, int], main: dict | None) -> int:
    """The generation part i of n writes: the one the other parts of its job write (their locks, their finished
    indexes), else one above every generation here (``main``: a dead pack's lock, whose generation counts). A
    PackError when parts of another part count are packing or finished here: their shards could have our names."""
    i, n = part
    newest = max(found.newest, int((main or {}).get("gen", 0) or 0))
    joined: list[int] = []
    for name in found.names:
        lock, index = PART_LOCK.fullmatch(name), PART_INDEX.fullmatch(name)
        if lock and int(lock.group(1)) != i:
            holder = read_lock(fs, join(root, name))
            if holder is None or stale(holder):
                continue
            gen = holder.get("gen") if isinstance(holder.get("gen"), int) else 0
            if int(lock.group(2)) != n:
                raise PackError(f"{dest} is being packed in {int(lock.group(2))} parts (part {int(lock.group(1))} is "
                                f"running: pid {holder.get('pid')} on {holder.get('host')}); this part is {i}/{n}. "
                                "Pack all parts of one job with the same n")
            newest = max(newest, gen)
            if gen > found.gen and not joined:
                joined.append(gen)
        elif index and name.endswith(".json") and name != part_index_name(i, n):
            if int(index.group(1)) != n:
                others = [p for p in found.part_indexes if f"-of-{n:05d}." not in p]
                raise PackError(f"{dest} holds finished parts of a job in {int(index.group(1))} parts ("
                                f"{', '.join(others[:3])}); this part is {i}/{n}. Merge them (streamwin merge {dest}) "
                                "or remove them before packing parts of another count")
            if not joined:
                gens = {generation(s) for s in _shard_names(fs, join(root, name))} - {None}
                if len(gens) == 1 and next(iter(gens)) > found.gen:
                    joined.append(gens.pop())
    return joined[0] if joined else newest + 1


def _shard_names(fs, path: str) -> list[str]:
    """The shard names a part index lists (none when it cannot be read)."""
    try:
        doc = json.loads(fs.cat_file(path))
        return [s["name"] for s in doc["shards"] if isinstance(s.get("name"), str)]
    except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError):
        return []
