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

Parts of an append (``pack(..., part="i/n", mode="append" | "extend")``) write their new
sequences' index as the part index (with no rows when they wrote none), their continuation
members' index beside it (``index.partIIIII-of-NNNNN.cont.json``), and what they grow
(``.grow.json``: the mode and the digest of the manifest they were packed against); `merge`
then commits the dataset grown by all of them, if it is still the one they were packed against.
"""
from __future__ import annotations

import json
import re

import numpy as np

from streamwin.arguments import check_keywords
from streamwin.errors import ManifestError, PackError
from streamwin.formats.checks import Checks
from streamwin.formats.framed import NonFinite
from streamwin.formats.manifest import Manifest
from streamwin.packing.dest import PART_INDEX, Survey, commit, generation, survey
from streamwin.packing.fragments import FragmentMerger
from streamwin.packing.grow import grow
from streamwin.packing.inputs import Columns
from streamwin.packing.lock import PART_LOCK, PackLock, exclude_parts, read_lock, stale
from streamwin.storage.manifests import load_manifest, write_manifest
from streamwin.storage.urls import join, remove_if_exists, url_to_fs, write_atomic


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


def side_name(index: str, kind: str) -> str:
    """The file beside part index ``index`` of ``kind`` "cont" (its continuations' index) or "grow" (what it grows)."""
    return f"{index[: -len('.json')]}.{kind}.json"


def part_indexes(dest: str, *, storage_options: dict | None = None) -> list[str]:
    """Names of the part indexes (``index.partIIIII-of-NNNNN.json``) at ``dest``, sorted."""
    fs, root = url_to_fs(dest, storage_options)
    names = (p.rsplit("/", 1)[-1] for p in fs.glob(join(root, "index.part*-of-*.json")))
    return sorted(n for n in names if re.fullmatch(r"index\.part\d+-of-\d+\.json", n))


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
    for index in (name, side_name(name, "cont")):
        remove_if_exists(fs, join(root, index))
        remove_if_exists(fs, join(root, index[: -len(".json")] + ".columns"))
    remove_if_exists(fs, join(root, side_name(name, "grow")))


def write_part(fs, root: str, manifest: Manifest | None, part: tuple[int, int], *, grows: dict | None = None,
               continued: Manifest | None = None) -> None:
    """Write part i of n's index (the merged fragment of its units), last: part of an append, after its
    continuations' index and ``grows`` (its mode and the digest of the manifest it grows)."""
    name = part_index_name(*part)
    if continued is not None:
        write_manifest(fs, root, continued, side_name(name, "cont"))
    if grows is not None:
        write_atomic(fs, join(root, side_name(name, "grow")), json.dumps(grows).encode())
        manifest = manifest if manifest is not None else _no_rows(continued)
    write_manifest(fs, root, manifest, name)


def _no_rows(like: Manifest) -> Manifest:
    """An index of no sequence and no shard, of ``like``'s dtype (a part of an append that only extended)."""
    empty = np.zeros(0, dtype=np.int64)
    return Manifest(dtype=like.dtype, step_shape=like.step_shape, compression=like.compression, shards=(),
                    length=empty, offset=empty, size=empty, hlen=empty, key_blob=b"", key_ends=empty,
                    nonfinite=NonFinite(0, 0, ()), checks=Checks.of_shards([], []))


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
        grows = [_read_grows(fs, root, name) for name in expected]
        conts = [load_manifest(dest, storage_options, name=side_name(name, "cont")) if g and g["continued"] else None
                 for name, g in zip(expected, grows)]
        gen = _part_generation(dest, expected, [p.shards + (c.shards if c else ()) for p, c in zip(parts, conts)],
                               start.gen)
        _check_present(dest, [*parts, *(c for c in conts if c is not None)], set(start.names))
        merger, continued = FragmentMerger(), FragmentMerger()
        try:
            for name, m, c in zip(expected, parts, conts):
                columns = None if m.value_columns is None else Columns(m.value_columns,
                                                                         tuple((m.left_out_columns or {}).items()), name)
                merger.add(m, m.dropped_empty, columns, name)
                if c is not None:
                    continued.add(c, 0, None, side_name(name, "cont"))
            manifest = merger.finish() if not any(grows) else _grown(dest, storage_options, start, grows, merger,
                                                                     continued)
        except PackError as e:
            merger.discard()
            continued.discard()
            raise ManifestError(f"cannot merge {dest}: {e}") from e
        lock.check()
        commit(fs, root, dest, manifest, gen, start)
    return manifest


def _read_grows(fs, root: str, name: str) -> dict | None:
    """What part index ``name`` grows ({"mode", "base", "continued"}), or None for a part of a whole pack."""
    try:
        return json.loads(fs.cat_file(join(root, side_name(name, "grow"))))
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise ManifestError(f"{side_name(name, 'grow')} is damaged ({e}): re-pack that part") from None


def _grown(dest: str, storage_options: dict | None, start: Survey, grows: list, merger: FragmentMerger,
           continued: FragmentMerger) -> Manifest:
    """The dataset at ``dest`` grown by the parts of one append; ManifestError unless all of them append to the
    manifest that is live now."""
    if not all(grows) or len({(g.get("mode"), g.get("base")) for g in grows}) > 1:
        raise ManifestError(f"cannot merge {dest}: its parts were packed by different packs (some append, to other "
                            "versions of the dataset, some not); re-pack the parts")
    heads, base, mode = merger.finish(), grows[0].get("base"), grows[0].get("mode")
    now = load_manifest(dest, storage_options).digest if start.index is not None else None
    if base != now:
        raise ManifestError(f"cannot merge {dest}: its parts append to the dataset as it was ({base}), it is another "
                            f"now ({now}): re-pack the parts")
    if base is None:
        return heads
    return grow(load_manifest(dest, storage_options), heads if heads.num_sequences else None, continued.result(),
                extend=mode == "extend", dest=dest)


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


def _part_generation(dest: str, names: list[str], shards: list, live: int) -> int:
    """The one generation every part wrote (``shards``: each part's), newer than the live dataset's (else
    ManifestError)."""
    gens = {name: {generation(s.name) for s in listed} for name, listed in zip(names, shards)}
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
