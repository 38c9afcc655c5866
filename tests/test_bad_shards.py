"""Bad shards: every corruption is a ShardError that names the shard, the member and the byte offset.

Corruptions are made on copies of a freshly packed dataset: a truncated shard, flipped bytes
in a member's .npy header (magic, shape text, dtype text), a manifest whose offset points
at another member or into array data ("member missing"), a manifest whose dtype differs,
and a zstd-compressed member that cannot be decompressed. Where the error must point is
computed independently, with the standard library's tarfile on the untouched shard.

With ``on_error="skip"`` the bad range is skipped with one RuntimeWarning and counted,
its windows come out as zeros with weight 0, every other window is exact (checked against
the original arrays) and every rank still yields ``len(loader)`` batches.

These are the checks that hold without the manifest's chunk checksums too (a dataset packed
before them): ``make_loader`` turns verification off, so each corruption meets the check it
is about. With checksums (the default) a changed byte fails its chunk first:
tests/test_integrity_checksums.py.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import shutil
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest

import streamwin as sw
from streamwin.formats.tar import tar_header
import streamwin.read.local as sw_local
import streamwin.read.plain as sw_plain
from conftest import make_sequences
from streamwin.formats.manifest import INDEX_NAME, parse_manifest

W, S, H, B = 16, 8, 4, 8

pytestmark = pytest.mark.timeout(120)


def make_loader(url, workers=0, *, rank=None, world_size=None, order=None, **read):
    """A loader of ``url`` reading with ``sw.Read(verify_checksums=False, **read)``."""
    ds = sw.WindowDataset(str(url), window=W, stride=S, horizon=H, batch_size=B, shuffle_buffer=200, seed=2, rank=rank,
                          world_size=world_size, order=order, read=sw.Read(**({"verify_checksums": False} | read)))
    return sw.WindowLoader(ds, num_workers=workers)


def epoch(loader):
    return [{"key": list(b["key"]), "start": b["start"].tolist(), "x": b["x"].numpy().copy(),
             "y": b["y"].numpy().copy(), "weight": b["weight"].numpy().copy() if "weight" in b else None}
            for b in loader]


def tar_members(path) -> dict[str, tuple[int, int]]:
    """{member name: (data offset, size)} read with the standard library, not with streamwin."""
    with tarfile.open(path) as tf:
        return {m.name: (m.offset_data, m.size) for m in tf.getmembers()}


@dataclasses.dataclass
class Packed:
    root: Path  # the pristine dataset (never modified)
    seqs: dict
    members: dict  # shard file name -> {member: (offset, size)}
    ref: list  # fault-free epoch, checked window by window against seqs

    def shard_of(self, member: str) -> str:
        return next(s for s, mem in self.members.items() if member in mem)

    def copy(self, dest: Path) -> Path:
        shutil.copytree(self.root, dest)
        return dest

    def starts_of(self, key: str) -> set[int]:
        return {s for b in self.ref for k, s in zip(b["key"], b["start"]) if k == key}

    def victims(self, n: int = 1, suffix: str = ".npy") -> list[str]:
        """Keys of long sequences whose window 0 the epoch yields, each from a different shard."""
        out, used = [], set()
        for key in sorted(self.seqs, key=lambda k: -len(self.seqs[k])):
            shard = self.shard_of(key + suffix)
            if shard not in used and 0 in self.starts_of(key):
                out.append(key)
                used.add(shard)
            if len(out) == n:
                return out
        raise AssertionError("no victim")


def check_window(seqs, key, start, x, y):
    assert np.array_equal(x, seqs[key][start : start + W]), (key, start)
    assert np.array_equal(y, seqs[key][start + W : start + W + H]), (key, start)


def pack_dataset(root: Path, compression=None) -> Packed:
    seqs = make_sequences(seed=5)
    sw.pack(list(seqs.items()), str(root), shard_bytes=40_000, progress=False, compression=compression)
    members = {p.name: tar_members(p) for p in sorted(root.glob("*.tar"))}
    assert len(members) >= 2
    loader = make_loader(root)
    ref = epoch(loader)
    assert len(ref) == len(loader) > 10
    for b in ref:
        for i, (k, s) in enumerate(zip(b["key"], b["start"])):
            check_window(seqs, k, s, b["x"][i], b["y"][i])
    return Packed(root, seqs, members, ref)


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Packed:
    return pack_dataset(tmp_path_factory.mktemp("bad") / "ds")


@pytest.fixture(scope="module")
def packed_zstd(tmp_path_factory) -> Packed:
    return pack_dataset(tmp_path_factory.mktemp("badz") / "ds", compression="zstd")


def flip(path: Path, at: int, new: bytes) -> None:
    data = bytearray(path.read_bytes())
    data[at : at + len(new)] = new
    path.write_bytes(bytes(data))


def header_edit(p: Packed, ds: Path, key: str, old: bytes, new: bytes) -> None:
    """Replace ``old`` by ``new`` (same length) inside the .npy header of member ``key``.npy."""
    assert len(old) == len(new)
    shard = ds / p.shard_of(key + ".npy")
    off, _ = p.members[shard.name][key + ".npy"]
    data = bytearray(shard.read_bytes())
    head = bytes(data[off : off + 128])
    at = head.index(old)
    data[off + at : off + at + len(old)] = new
    shard.write_bytes(bytes(data))


def edit_manifest(ds: Path, **changes) -> None:
    """Rewrite index.json with columns/fields changed (``offset={i: value}``, ``dtype=...``)."""
    m = parse_manifest((ds / INDEX_NAME).read_text())
    fields = {}
    for name, value in changes.items():
        if isinstance(value, dict):
            col = getattr(m, name).copy()
            for i, v in value.items():
                col[i] = v
            fields[name] = col
        else:
            fields[name] = value
    (ds / INDEX_NAME).write_text(dataclasses.replace(m, **fields).to_json())


def seq_index(ds: Path, key: str) -> int:
    m = sw.load_manifest(str(ds))
    return next(i for i in range(m.num_sequences) if m.key(i) == key)


def assert_names(err: sw.ShardError, ds: Path, p: Packed, member: str, offset: int | None = None) -> None:
    """The error names the shard URL, the member and the byte offset, in attributes and message."""
    shard = p.shard_of(member)
    assert err.shard == f"{ds}/{shard}"
    assert err.member == member
    if offset is None:
        offset = p.members[shard][member][0]
    assert err.offset == offset
    text = str(err)
    assert err.shard in text and member in text and f"byte offset {offset}" in text


# -- raise -------------------------------------------------------------------------------------

CORRUPT_HEADER = {
    "bad-magic": (b"\x93NUMPY", b"\x00NUMPY"),
    "bad-version": (b"NUMPY\x01", b"NUMPY\x07"),
    "dtype-text": (b"'<f4'", b"'<i4'"),
    "dtype-object": (b"'<f4'", b"'|O' "),
    "fortran-text": (b"False", b"True "),
    "shape-text": (b", 3), ", b",),   "),  # (T, 3) -> (T,): one dimension short
}


@pytest.mark.parametrize("kind", sorted(CORRUPT_HEADER))
def test_bad_npy_header(packed, tmp_path, kind):
    ds = packed.copy(tmp_path / "ds")
    key, = packed.victims()
    header_edit(packed, ds, key, *CORRUPT_HEADER[kind])
    with pytest.raises(sw.ShardError) as info:
        epoch(make_loader(ds))
    assert_names(info.value, ds, packed, key + ".npy")


def test_shape_length_differs(packed, tmp_path):
    ds = packed.copy(tmp_path / "ds")
    key, = packed.victims()
    n = len(packed.seqs[key])
    header_edit(packed, ds, key, f"({n},".encode(), f"({n - 1 if n % 10 else n + 1},".encode())
    with pytest.raises(sw.ShardError, match="shape") as info:
        epoch(make_loader(ds))
    assert_names(info.value, ds, packed, key + ".npy")


@pytest.mark.parametrize("workers", [0, 2])
def test_truncated_shard(packed, tmp_path, workers):
    ds = packed.copy(tmp_path / "ds")
    key, = packed.victims()
    shard = packed.shard_of(key + ".npy")
    off, size = packed.members[shard][key + ".npy"]
    cut = off + size // 2
    path = ds / shard
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(sw.ShardError) as info:
        epoch(make_loader(ds, workers))
    err = info.value
    assert err.shard == f"{ds}/{shard}"
    assert isinstance(err.offset, int) and err.offset >= cut  # nothing before the cut is missing
    # the member named is the one holding the byte that could not be read
    holder = [name for name, (o, n) in packed.members[shard].items() if o <= err.offset < o + n]
    assert holder and err.member == holder[0], (err.member, err.offset, holder)
    assert err.member in str(err) and f"byte offset {err.offset}" in str(err)


@pytest.mark.parametrize("where", ["other-member", "inside-data"])
def test_manifest_offset_points_elsewhere(packed, tmp_path, where):
    """The manifest's member is not where it says: the bytes there are another member or array data."""
    ds = packed.copy(tmp_path / "ds")
    key, = packed.victims()
    shard = packed.shard_of(key + ".npy")
    off, size = packed.members[shard][key + ".npy"]
    if where == "other-member":  # a member of another length, in the same shard
        other = next(n for n, (o, s) in packed.members[shard].items()
                     if n.endswith(".npy") and n != key + ".npy" and s != size)
        new = packed.members[shard][other][0]
    else:
        new = off + 512  # array bytes of the member itself
    edit_manifest(ds, offset={seq_index(ds, key): new})
    with pytest.raises(sw.ShardError) as info:
        epoch(make_loader(ds))
    assert_names(info.value, ds, packed, key + ".npy", offset=new)


def test_manifest_dtype_differs(packed, tmp_path):
    ds = packed.copy(tmp_path / "ds")
    edit_manifest(ds, dtype=np.dtype("<i4"))
    with pytest.raises(sw.ShardError, match="dtype") as info:
        epoch(make_loader(ds))
    err = info.value
    shard = err.shard.rsplit("/", 1)[-1]
    assert err.shard == f"{ds}/{shard}" and err.member in packed.members[shard]
    assert_names(err, ds, packed, err.member)


def test_zstd_corrupt_member(packed_zstd, tmp_path):
    p = packed_zstd
    ds = p.copy(tmp_path / "ds")
    key, = p.victims(suffix=".npy.zst")
    member = key + ".npy.zst"
    shard = p.shard_of(member)
    off, _ = p.members[shard][member]
    flip(ds / shard, off, b"\x00\x00\x00\x00")  # the zstd frame magic
    with pytest.raises(sw.ShardError) as info:
        epoch(make_loader(ds))
    assert_names(info.value, ds, p, member)


def test_zstd_member_cut_short(packed_zstd, tmp_path):
    """The manifest's compressed size is a few bytes short: the frame cannot be decompressed."""
    p = packed_zstd
    ds = p.copy(tmp_path / "ds")
    key, = p.victims(suffix=".npy.zst")
    member = key + ".npy.zst"
    i = seq_index(ds, key)
    edit_manifest(ds, size={i: int(sw.load_manifest(str(ds)).size[i]) - 7})
    with pytest.raises(sw.ShardError) as info:
        epoch(make_loader(ds))
    assert_names(info.value, ds, p, member)


def test_zstd_header_disagrees(packed_zstd, tmp_path):
    """A well-formed frame whose .npy header says another shape: refused after decompression."""
    import zstandard

    p = packed_zstd
    ds = p.copy(tmp_path / "ds")
    key, = p.victims(suffix=".npy.zst")
    member = key + ".npy.zst"
    shard = p.shard_of(member)
    off, size = p.members[shard][member]
    path = ds / shard
    data = bytearray(path.read_bytes())
    raw = zstandard.ZstdDecompressor().decompress(bytes(data[off : off + size]), max_output_size=1 << 24)
    raw = raw.replace(b"'<f4'", b"'<u4'", 1)
    frame = zstandard.ZstdCompressor(level=19).compress(raw)
    assert len(frame) <= size
    data[off : off + len(frame)] = frame
    data[off - 512 : off] = tar_header(member, len(frame))  # the member's tar header says its new size, as the manifest
    path.write_bytes(bytes(data))
    edit_manifest(ds, size={seq_index(ds, key): len(frame)})
    with pytest.raises(sw.ShardError, match="dtype") as info:
        epoch(make_loader(ds))
    assert_names(info.value, ds, p, member)


# -- skip --------------------------------------------------------------------------------------

def run_skipping(ds, **kw):
    """(batches, stats, RuntimeWarnings) of one epoch with on_error="skip"."""
    loader = make_loader(ds, on_error="skip", **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = epoch(loader)
    runtime = [w for w in caught if issubclass(w.category, RuntimeWarning) and "streamwin" in str(w.message)]
    assert len(batches) == len(loader)
    return batches, loader.stats(), runtime


def check_skipped_epoch(batches, ref, seqs, stats):
    """Same windows in the same order as the fault-free epoch; weight-0 ones are zeros, the rest exact."""
    assert len(batches) == len(ref)
    lost = []
    for b, r in zip(batches, ref):
        assert b["key"] == r["key"] and b["start"] == r["start"]
        for i, (k, s, w) in enumerate(zip(b["key"], b["start"], b["weight"])):
            if w == 1.0:
                check_window(seqs, k, s, b["x"][i], b["y"][i])
            else:
                assert w == 0.0
                assert not b["x"][i].any() and not b["y"][i].any()
                lost.append((k, s))
    assert len(lost) == stats["skipped_windows"] > 0
    return lost


def test_skip_bad_headers_in_two_shards_warns_once(packed, tmp_path):
    ds = packed.copy(tmp_path / "ds")
    keys = packed.victims(2)
    for key in keys:
        header_edit(packed, ds, key, b"\x93NUMPY", b"\x00NUMPY")
    batches, stats, runtime = run_skipping(ds)
    assert len(runtime) == 1, [str(w.message) for w in runtime]
    assert keys[0] + ".npy" in str(runtime[0].message) or keys[1] + ".npy" in str(runtime[0].message)
    assert stats["skipped_ranges"] == 2
    lost = check_skipped_epoch(batches, packed.ref, packed.seqs, stats)
    for key in keys:
        assert (key, 0) in lost


def test_skip_truncated_shard(packed, tmp_path):
    ds = packed.copy(tmp_path / "ds")
    key, = packed.victims()
    shard = packed.shard_of(key + ".npy")
    off, size = packed.members[shard][key + ".npy"]
    path = ds / shard
    path.write_bytes(path.read_bytes()[: off + size // 2])
    batches, stats, runtime = run_skipping(ds)
    assert len(runtime) == 1
    assert stats["skipped_ranges"] >= 1
    lost = check_skipped_epoch(batches, packed.ref, packed.seqs, stats)
    # every window of the truncated tail is lost; windows of other shards are all intact
    for k, s in lost:
        assert packed.shard_of(k + ".npy") == shard
    step = packed.seqs[key][0].nbytes
    with open(packed.root / shard, "rb") as f:  # the member's header length, read with numpy
        f.seek(off)
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        hlen = f.tell() - off
    readable_steps = (size // 2 - hlen) // step
    tail = [(k, s) for b in packed.ref for k, s in zip(b["key"], b["start"])
            if k == key and s + W + H > readable_steps]
    assert tail
    assert set(tail) <= set(lost)


def test_skip_with_two_ranks_keeps_equal_steps(packed, tmp_path):
    ds = packed.copy(tmp_path / "ds")
    keys = packed.victims(2)
    for key in keys:
        header_edit(packed, ds, key, b"'<f4'", b"'<i4'")
    lengths, skipped, expected = [], 0, 0
    for rank in range(2):
        ref = epoch(make_loader(packed.root, rank=rank, world_size=2))
        # a bad header is seen by each rank that reads a window of its member: every reader checks the headers of
        # the members it reads (from step 0, or read for that alone), once
        expected += len(set(keys) & {k for b in ref for k in b["key"]})
        batches, stats, runtime = run_skipping(ds, rank=rank, world_size=2)
        assert len(runtime) == (1 if stats["skipped_ranges"] else 0)
        assert len(batches) == len(ref)
        lengths.append(len(ref))
        if stats["skipped_windows"]:
            check_skipped_epoch(batches, ref, packed.seqs, stats)
            skipped += stats["skipped_ranges"]
        else:
            assert all(b["key"] == r["key"] and np.array_equal(b["x"], r["x"]) for b, r in zip(batches, ref))
    assert lengths[0] == lengths[1]  # lockstep
    assert expected >= 1 and skipped == expected


def test_skip_zstd_corrupt_member(packed_zstd, tmp_path):
    p = packed_zstd
    ds = p.copy(tmp_path / "ds")
    key, = p.victims(suffix=".npy.zst")
    member = key + ".npy.zst"
    shard = p.shard_of(member)
    flip(ds / shard, p.members[shard][member][0], b"\x00\x00\x00\x00")
    batches, stats, runtime = run_skipping(ds)
    assert len(runtime) == 1 and member in str(runtime[0].message)
    assert stats["skipped_ranges"] >= 1
    lost = check_skipped_epoch(batches, p.ref, p.seqs, stats)
    assert {k for k, _ in lost} == {key}  # compressed members are read one by one: only it is lost
    assert {s for k, s in lost} == p.starts_of(key)


@pytest.mark.parametrize("name", ["../outside.tar", "/etc/passwd", "a/../../b.tar", "s3://other-bucket/x.tar", "a\\b.tar"])
def test_manifest_with_escaping_shard_name_is_refused(tmp_path, name):
    """A manifest can only name shards below its own root: nothing is read from elsewhere."""
    import json as _json

    seqs = {f"k{i}": np.arange(50, dtype=np.float32) for i in range(3)}
    url = str(tmp_path / "ds")
    sw.pack(list(seqs.items()), url, progress=False)
    index = tmp_path / "ds" / "index.json"
    doc = _json.loads(index.read_text())
    doc["shards"][0]["name"] = name
    index.write_text(_json.dumps(doc))
    with pytest.raises(sw.ManifestError, match="relative paths inside the dataset"):
        sw.load_manifest(url)


# -- zstd members that cannot be read, and byte order ------------------------------------------

@pytest.mark.parametrize("workers", [0, 2])
def test_zstd_truncated_shard_names_the_member(packed_zstd, tmp_path, workers):
    """A shard cut inside a compressed member: the error names the shard, that member and the offset."""
    p = packed_zstd
    ds = p.copy(tmp_path / "ds")
    key, = p.victims(suffix=".npy.zst")
    member = key + ".npy.zst"
    shard = p.shard_of(member)
    off, size = p.members[shard][member]
    cut = off + size // 2
    (ds / shard).write_bytes((ds / shard).read_bytes()[:cut])
    with pytest.raises(sw.ShardError) as info:
        epoch(make_loader(ds, workers))
    err = info.value
    assert err.shard == f"{ds}/{shard}" and isinstance(err.offset, int) and err.offset >= cut
    holder = [name for name, (o, n) in p.members[shard].items() if o <= err.offset < o + n]
    assert holder and err.member == holder[0], (err.member, err.offset, holder)
    assert err.member in str(err) and f"byte offset {err.offset}" in str(err)


def big_endian_tar(path: Path, seqs: dict) -> dict[str, int]:
    """A tar shard made elsewhere: ``<key>.npy`` members of big-endian float32; {member: data offset}."""
    import io

    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for key, arr in seqs.items():
            buf = io.BytesIO()
            np.save(buf, arr.astype(">f4"))
            info = tarfile.TarInfo(key + ".npy")
            info.size = len(buf.getvalue())
            buf.seek(0)
            tf.addfile(info, buf)
    return {name: off for name, (off, _) in tar_members(path).items()}


def test_big_endian_members_are_refused_when_indexed(tmp_path):
    ds = tmp_path / "ds"
    ds.mkdir()
    seqs = {f"k{i}": np.arange(40 * 3, dtype=np.float32).reshape(40, 3) + i for i in range(3)}
    offsets = big_endian_tar(ds / "foreign-000.tar", seqs)
    with pytest.raises(sw.ShardError, match="big-endian") as info:
        sw.index_shards(str(ds), progress=False)
    err = info.value
    assert err.shard == f"{ds}/foreign-000.tar" and err.member == "k0.npy" and err.offset == offsets["k0.npy"]
    assert not (ds / INDEX_NAME).exists()


@pytest.mark.parametrize("cached", [False, True])
def test_big_endian_dataset_is_refused_on_read(packed, tmp_path, cached):
    """Every member and the manifest say '>f4' (an index written elsewhere): a ShardError, not a torch error."""
    ds = packed.copy(tmp_path / "ds")
    for shard, members in packed.members.items():
        data = bytearray((ds / shard).read_bytes())
        for name, (off, _) in members.items():
            if name.endswith(".npy"):
                at = off + bytes(data[off : off + 128]).index(b"'<f4'")
                data[at : at + 5] = b"'>f4'"
        (ds / shard).write_bytes(bytes(data))
    m = sw.load_manifest(str(ds))
    shards = tuple(dataclasses.replace(e, sha256=hashlib.sha256((ds / e.name).read_bytes()).hexdigest())
                   for e in m.shards)
    edit_manifest(ds, dtype=np.dtype(">f4"), shards=shards)
    kw = {"cache_dir": str(tmp_path / "cache")} if cached else {}
    with pytest.raises(sw.ShardError, match="big-endian") as info:
        epoch(make_loader(ds, order=sw.Order(shuffle=False), **kw))
    err = info.value
    shard = err.shard.rsplit("/", 1)[-1]
    assert err.shard == f"{ds}/{shard}" and err.member in packed.members[shard]
    assert_names(err, ds, packed, err.member)


def test_tampered_big_endian_member_is_refused_on_read(packed, tmp_path):
    ds = packed.copy(tmp_path / "ds")
    key, = packed.victims()
    header_edit(packed, ds, key, b"'<f4'", b"'>f4'")
    with pytest.raises(sw.ShardError, match="big-endian") as info:
        epoch(make_loader(ds))
    assert_names(info.value, ds, packed, key + ".npy")


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_big_endian_arrays_are_packed_little_endian_by_value(tmp_path, compression):
    seqs = {"a": (np.arange(60).reshape(20, 3) / 7).astype(">f4"),
            "b": ((np.arange(90).reshape(30, 3) - 45) / 3).astype("<f4"),
            "c": np.array([[np.inf, -0.0, np.nan]] * 25, dtype=">f4")}
    assert seqs["a"].dtype.byteorder == ">" and seqs["c"].dtype.byteorder == ">"
    url = str(tmp_path / "ds")
    sw.pack(list(seqs.items()), url, progress=False, compression=compression)
    assert sw.load_manifest(url).dtype == np.dtype("<f4")
    loader = sw.WindowLoader(sw.WindowDataset(url, window=20, batch_size=1, order=sw.Order(shuffle=False)))
    got = {b["key"][0]: b["x"][0].numpy() for b in loader}
    assert set(got) == set(seqs)
    for k, arr in seqs.items():  # bit-exact by value: same float32 bit patterns, NaN and -0.0 included
        assert got[k].dtype == np.dtype("<f4")
        assert np.array_equal(got[k].view("<u4"), arr[:20].astype("<f4").view("<u4")), k


# -- skip: only the unreadable windows are lost ----------------------------------------------------

def windows_of(ref, key) -> set[tuple[str, int]]:
    return {(k, s) for b in ref for k, s in zip(b["key"], b["start"]) if k == key}


def npy_data_offset(path: Path, member_offset: int) -> int:
    """Where a plain member's array data starts, read with numpy's own header parser."""
    with open(path, "rb") as f:
        f.seek(member_offset)
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        return f.tell()


def test_skip_bad_header_loses_only_that_members_windows(packed, tmp_path):
    """A bad header loses its own member's windows; its neighbours, read in the same run, stay exact."""
    ds = packed.copy(tmp_path / "ds")
    key = next(k for k in sorted(packed.seqs, key=lambda k: len(packed.seqs[k]))  # a short one: many neighbours
               if 0 in packed.starts_of(k))
    header_edit(packed, ds, key, b"\x93NUMPY", b"\x00NUMPY")
    batches, stats, runtime = run_skipping(ds)
    lost = check_skipped_epoch(batches, packed.ref, packed.seqs, stats)
    assert set(lost) == windows_of(packed.ref, key)  # a short sequence: all its windows are in one block
    assert len(runtime) == 1 and stats["skipped_ranges"] == 1


@pytest.mark.parametrize("how", ["mapped", "read", "http"])
def test_skip_truncated_shard_delivers_every_readable_window(packed, tmp_path, http_server, monkeypatch, how):
    """Cut a shard inside a member: the windows before the cut are delivered exact, weight 1; only the rest is lost."""
    root = tmp_path / "srv"
    ds = packed.copy(root / "ds")
    key = next(k for k in sorted(packed.seqs, key=lambda k: -len(packed.seqs[k]))  # a long one, not a shard's first
               if list(packed.members[packed.shard_of(k + ".npy")]).index(k + ".npy") > 4)
    shard = packed.shard_of(key + ".npy")
    off, size = packed.members[shard][key + ".npy"]
    data0 = npy_data_offset(packed.root / shard, off)
    step = packed.seqs[key][0].nbytes
    readable = len(packed.seqs[key]) // 2  # steps of the victim before the cut
    cut = data0 + readable * step + step // 2
    (ds / shard).write_bytes((ds / shard).read_bytes()[:cut])
    # the independent reference: what the cut leaves readable, from the stdlib's view of the tar
    after = [n[: -len(".npy")] for n, (o, _) in packed.members[shard].items() if n.endswith(".npy") and o > off]
    expected = {(key, s) for key_, s in windows_of(packed.ref, key) if s + W + H > readable}
    for k in after:
        expected |= windows_of(packed.ref, k)
    assert expected and windows_of(packed.ref, key) - expected  # some of the victim's windows are readable
    if how == "read":
        monkeypatch.setattr(sw_plain, "MAX_MAPPED_RUNS", 0)  # read into memory instead of mapping
    url = http_server(root).url_for("ds") if how == "http" else ds
    batches, stats, runtime = run_skipping(url)
    lost = check_skipped_epoch(batches, packed.ref, packed.seqs, stats)
    assert set(lost) == expected
    assert len(runtime) == 1


def test_skip_unreadable_bytes_mid_run_keep_the_members_after_them(packed, tmp_path, monkeypatch):
    """A bad sector inside one member: the members after it, read in the same run, are delivered too.

    The local file read raises EIO for one byte (after delivering the bytes before it), as a
    disk does; reads are not mapped here, so they go through that read. The victim is short,
    so one read covers all its windows: those that end before the bad byte are delivered.
    """
    ds = packed.copy(tmp_path / "ds")
    def inside(k):  # neither the first nor the last member of its shard: neighbours on both sides
        names = [n for n in packed.members[packed.shard_of(k + ".npy")] if n.endswith(".npy")]
        return 0 < names.index(k + ".npy") < len(names) - 1
    key = next(k for k in sorted(packed.seqs) if 3 <= len(windows_of(packed.ref, k)) <= 10 and inside(k))
    shard = packed.shard_of(key + ".npy")
    off, _ = packed.members[shard][key + ".npy"]
    data0 = npy_data_offset(packed.root / shard, off)
    step = packed.seqs[key][0].nbytes
    bad_step = len(packed.seqs[key]) // 3
    bad = data0 + bad_step * step + 5  # one unreadable byte, inside step bad_step
    real_read = sw_local.read_local

    def disk(path, offset, out):
        if path.endswith(shard) and offset <= bad < offset + len(out):
            if offset == bad:
                raise OSError(errno.EIO, "Input/output error")
            return real_read(path, offset, out[: bad - offset])  # what lies before the bad byte
        return real_read(path, offset, out)

    monkeypatch.setattr(sw_local, "read_local", disk)
    monkeypatch.setattr(sw_plain, "MAX_MAPPED_RUNS", 0)
    expected = {(key, s) for key_, s in windows_of(packed.ref, key) if s + W + H > bad_step}
    assert expected and windows_of(packed.ref, key) - expected
    batches, stats, runtime = run_skipping(ds, retries=0)
    lost = check_skipped_epoch(batches, packed.ref, packed.seqs, stats)
    assert set(lost) == expected
    assert stats["skipped_ranges"] >= 1 and len(runtime) == 1  # reads through the gap may meet it too
