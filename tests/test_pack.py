"""pack: every sequence comes back bitwise (through the manifest and through plain webdataset),
on a local path and on S3; output is deterministic; a crash never leaves an index describing
missing shards; every bad input is a PackError naming the item.

Expectations are computed here, independently of streamwin's read side: members are read with
plain file reads at the manifest's offsets and np.load(allow_pickle=False), or by webdataset.
"""
from __future__ import annotations

import importlib
import io
import json
import os
import tarfile
import warnings
from pathlib import Path

import fsspec
import numpy as np
import pytest
import webdataset as wds
from webdataset.gopen import gopen_schemes
import zstandard

import streamwin as sw
from streamwin.formats import npy as npyfmt
from streamwin.formats import tar as tarfmt
from streamwin.errors import ManifestError, PackError
from streamwin.packing import columns, encode, nonfinite, parallel, records, tasks
from streamwin.packing.inputs import Batch, InputUnit
from streamwin.packing.scan import verify


packmod = importlib.import_module("streamwin.packing.pack")  # streamwin.pack is also the function


# ---- helpers -----------------------------------------------------------------------------------

def make_sequences(n: int, seed: int = 0, features: int = 3, dtype: str = "float32") -> list[tuple[str, np.ndarray, dict | None]]:
    """Varied lengths (1..400, some long), some with metadata."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(1, 400)) if i % 7 else int(rng.integers(2000, 5000))
        arr = rng.normal(size=(length, features)).astype(dtype)
        out.append((f"seq{i:04d}", arr, {"i": i, "tag": f"t{i % 3}"} if i % 4 == 0 else None))
    return out


def read_member(fs, root: str, name: str, offset: int, size: int, compressed: bool) -> np.ndarray:
    with fs.open(f"{root}/{name}", "rb") as f:
        f.seek(offset)
        data = f.read(size)
    assert len(data) == size
    if compressed:
        data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
    return np.load(io.BytesIO(data), allow_pickle=False)


def read_via_manifest(url: str, storage_options: dict | None = None) -> dict[str, np.ndarray]:
    """Every sequence, read at the manifest's offsets with plain reads; checks lengths and hlen too."""
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    doc = json.loads(fs.cat_file(f"{root}/index.json"))
    m = sw.load_manifest(url, storage_options)
    assert doc["num_sequences"] == m.num_sequences and doc["num_shards"] == len(m.shards)
    out = {}
    for k, shard in enumerate(m.shards):
        for i in range(int(m.shard_starts[k]), int(m.shard_starts[k + 1])):
            arr = read_member(fs, root, shard.name, int(m.offset[i]), int(m.size[i]), m.compression == "zstd")
            assert arr.shape == (int(m.length[i]),) + m.step_shape
            assert arr.dtype == m.dtype
            out[m.key(i)] = arr
    return out


def read_via_webdataset(urls: list[str]) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    arrays, metas = {}, {}
    for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode():
        key = sample["__key__"]
        assert key not in arrays
        arrays[key] = sample["npy"]
        if "json" in sample:
            metas[key] = sample["json"]
    return arrays, metas


def assert_same_arrays(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert list(got) == list(expected)  # same keys, same order
    for key, want in expected.items():
        arr = got[key]
        assert arr.dtype == want.dtype and arr.shape == want.shape, key
        assert arr.tobytes() == want.tobytes(), key  # bitwise


def shard_urls(root: Path | str) -> list[str]:
    return sorted(str(p) for p in Path(root).glob("*.tar"))


def generation_unit(name: str) -> tuple[int, int]:
    """(generation, unit) of a shard name shard-gGGGGGG-uUUUUUU-KKKKKK.tar."""
    _, g, u, _ = name.split("-")
    return int(g[1:]), int(u[1:])


def files_of(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def files_with_sums(m) -> list[str]:
    """The files a pack writes for manifest ``m``'s shards: each shard and its sums file (formats/checks.py)."""
    return [s.name for s in m.shards] + [s.name + ".sums" for s in m.shards]


@pytest.fixture
def npy_dir(tmp_path) -> tuple[Path, dict[str, np.ndarray]]:
    """40 .npy files in two folders (so there are many units to parallelize), plus one empty."""
    root = tmp_path / "npy"
    expected = {}
    for key, arr, _ in make_sequences(40, seed=1, features=2, dtype="int16"):
        sub = "a" if int(key[3:]) % 2 else "b"
        (root / sub).mkdir(parents=True, exist_ok=True)
        np.save(root / sub / f"{key}.npy", arr)
        expected[f"{sub}__{key}"] = arr
    np.save(root / "b" / "zz_empty.npy", np.zeros((0, 2), np.int16))
    return root, dict(sorted(expected.items()))  # files are packed in the order of their relative paths


# ---- round trips -------------------------------------------------------------------------------

def test_round_trip_iterable_local(tmp_path):
    seqs = make_sequences(60)
    seqs.insert(5, ("empty_one", np.zeros((0, 3), np.float32), None))
    dest = tmp_path / "ds"
    m = sw.pack(seqs, str(dest), shard_bytes=64 << 10, progress=False)
    expected = {k: a for k, a, _ in seqs if len(a)}
    assert m.num_sequences == 60 and m.dropped_empty == 1 and len(m.shards) > 5
    assert m.dtype == np.float32 and m.step_shape == (3,) and m.num_steps == sum(len(a) for a in expected.values())
    assert_same_arrays(read_via_manifest(str(dest)), expected)
    arrays, metas = read_via_webdataset(shard_urls(dest))
    assert_same_arrays(arrays, expected)
    assert metas == {k: meta for k, _, meta in seqs if meta is not None}
    # every shard but the last holds at least shard_bytes; shards are plain tars ending in zero blocks
    sizes = [s.bytes for s in m.shards]
    assert all(b >= 64 << 10 for b in sizes[:-1])
    assert sizes == [os.path.getsize(dest / s.name) for s in m.shards]
    assert sorted(os.listdir(dest)) == sorted(files_with_sums(m) + ["index.json"])


def test_round_trip_npy_directory_two_workers(npy_dir, tmp_path):
    root, expected = npy_dir
    dest = tmp_path / "ds"
    m = sw.pack(str(root), str(dest), shard_bytes=16 << 10, workers=2, progress=False)
    assert len({generation_unit(s.name) for s in m.shards}) > 3  # many units, packed by the two workers
    assert m.dropped_empty == 1 and m.dtype == np.int16 and m.step_shape == (2,)
    assert_same_arrays(read_via_manifest(str(dest)), expected)
    assert_same_arrays(read_via_webdataset(shard_urls(dest))[0], expected)


def test_round_trip_s3(s3_server, s3_bucket, tmp_path, monkeypatch):
    opts = s3_server.storage_options()
    url = f"{s3_bucket}/corpus"
    seqs = make_sequences(25, seed=3)
    m = sw.pack(seqs, url, shard_bytes=32 << 10, storage_options=opts, progress=False)
    expected = {k: a for k, a, _ in seqs}
    assert_same_arrays(read_via_manifest(url, opts), expected)
    fs = s3_server.filesystem()
    # plain webdataset, its s3 scheme served by s3fs (webdataset's documented extension point)
    monkeypatch.setitem(gopen_schemes, "s3", lambda u, mode="rb", bufsize=8192, **kw: fs.open(u, "rb"))
    arrays, metas = read_via_webdataset([f"{url}/{s.name}" for s in m.shards])
    assert_same_arrays(arrays, expected)
    assert metas == {k: meta for k, _, meta in seqs if meta is not None}
    # the object store holds exactly the shards and the index, and they verify
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url.removeprefix("s3://"))) == sorted(
        files_with_sums(m) + ["index.json"])
    assert verify(url, storage_options=opts, progress=False)["sequences"] == 25
    # a crash while re-packing: the old dataset stays as it was, the new shards are removed
    index = fs.cat_file(f"{url}/index.json")
    with pytest.raises(PackError, match="source died"):
        sw.pack(crashing(seqs, 15), url, shard_bytes=1 << 10, storage_options=opts, progress=False)
    fs.invalidate_cache()
    assert fs.cat_file(f"{url}/index.json") == index
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url.removeprefix("s3://"))) == sorted(
        files_with_sums(m) + ["index.json"])
    assert_same_arrays(read_via_manifest(url, opts), expected)
    # a directory of .npy files packed straight to S3 by two workers
    src = tmp_path / "src"
    src.mkdir()
    for key, arr in list(expected.items())[:6]:
        np.save(src / f"{key}.npy", arr)
    sw.pack(str(src), f"{s3_bucket}/fromdir", workers=2, storage_options=opts, progress=False)
    assert_same_arrays(read_via_manifest(f"{s3_bucket}/fromdir", opts), dict(list(expected.items())[:6]))


def test_zstd_round_trip(tmp_path):
    seqs = make_sequences(20, seed=4)
    dest = tmp_path / "z"
    m = sw.pack(seqs, str(dest), shard_bytes=32 << 10, compression="zstd", progress=False)
    assert m.compression == "zstd"
    assert_same_arrays(read_via_manifest(str(dest)), {k: a for k, a, _ in seqs})
    import tarfile

    with tarfile.open(dest / m.shards[0].name) as tf:
        names = [t.name for t in tf.getmembers()]
    assert names[0] == "seq0000.npy.zst" and "seq0000.json" in names
    # random normals barely compress; zeros do, and the sizes in the manifest are the compressed ones
    zeros = [(f"z{i}", np.zeros((1000, 4), np.float64)) for i in range(3)]
    mz = sw.pack(zeros, str(tmp_path / "zz"), compression="zstd", progress=False)
    assert (mz.size < 1000).all() and (mz.hlen == 128).all()
    verify(str(dest), progress=False)
    # a second pack: byte-identical
    sw.pack(seqs, str(tmp_path / "z2"), shard_bytes=32 << 10, compression="zstd", progress=False)
    assert files_of(dest) == files_of(tmp_path / "z2")


# ---- determinism -------------------------------------------------------------------------------

def test_pack_twice_is_byte_identical(tmp_path, npy_dir):
    seqs = make_sequences(30, seed=5)
    for name in ("a", "b"):
        sw.pack(seqs, str(tmp_path / name), shard_bytes=40 << 10, progress=False)
    assert files_of(tmp_path / "a") == files_of(tmp_path / "b")
    root, _ = npy_dir
    sw.pack(str(root), str(tmp_path / "w1"), shard_bytes=16 << 10, workers=1, progress=False)
    sw.pack(str(root), str(tmp_path / "w2"), shard_bytes=16 << 10, workers=2, progress=False)
    one, two = files_of(tmp_path / "w1"), files_of(tmp_path / "w2")
    assert len(one) > 3 and one == two


def tarfile_header(name: str, size: int) -> bytes:
    """The reference: the ustar header tarfile writes for a member with pack's fixed fields."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = size, 0, 0o644, 0, 0, "", ""
    return info.tobuf(format=tarfile.USTAR_FORMAT, encoding="ascii", errors="strict")


def test_fast_headers_match_numpy_and_tarfile():
    names = ("a.npy", "k" * 90 + ".npy.zst", "x.json", "K" * 100)
    sizes = (0, 1, 511, 512, 123_456, 8**11 - 1)
    for name in names:
        for size in sizes:
            assert tarfmt.tar_header(name, size) == tarfile_header(name, size), (name, size)
    keys = ["a", "k" * 90, "b~c", "z" * 96]  # every header at once: the same bytes, names up to 100 bytes
    batched = tarfmt.tar_headers(np.frombuffer("".join(keys).encode(), np.uint8), np.cumsum([len(k) for k in keys]),
                                 ".npy", np.array(sizes[2:], np.int64))
    assert [bytes(h) for h in batched] == [tarfile_header(k + ".npy", s) for k, s in zip(keys, sizes[2:])]
    for dtype in ("<f4", "<i8", "u1", "?", "<c16", "<f2"):
        for step in ((), (3,), (2, 5)):
            for length in (1, 9, 10, 99, 100, 12_345, 10**7):
                fake = np.empty((length,) + step, dtype) if length < 1000 else np.lib.stride_tricks.as_strided(
                    np.empty(1, dtype), (length,) + step, (0,) * (1 + len(step)))
                buf = io.BytesIO()
                np.lib.format.write_array_header_1_0(buf, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                           "fortran_order": False, "shape": fake.shape})
                assert npyfmt.npy_header_for(fake.dtype, fake.shape) == buf.getvalue(), (dtype, fake.shape)
    big = tarfmt.tar_header("huge.npy", 8**11)  # past ustar's size field: a pax header
    assert len(big) > 512 and len(big) % 512 == 0


@pytest.mark.parametrize("length", [1, 16383, 16384, 16385, 40_000])
def test_zstd_frames_decompress_one_by_one_to_the_npy_bytes(length):
    """A member of 16 bytes per step: one frame up to FRAME_BYTES of rows, else frames of that many
    rows, each decompressing on its own; frame 0 starts with the npy header."""
    from streamwin.formats import zstd as zstdfmt

    arr = np.arange(length * 4, dtype="<f4").reshape(length, 4)
    head = npyfmt.npy_header_for(arr.dtype, arr.shape)
    member, ends = zstdfmt.compress_member(head, arr.reshape(-1).view(np.uint8), length)
    rows = zstdfmt.FRAME_BYTES // 16
    assert zstdfmt.frame_rows(16) == rows
    bounds = [0] + list(ends or [len(member)])
    assert len(bounds) - 1 == -(-length // rows) and (ends is None) == (length <= rows)
    frames = [zstandard.ZstdDecompressor().decompress(member[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert frames[0][: len(head)] == head and b"".join(frames) == head + arr.tobytes()
    assert all(len(f) == rows * 16 for f in frames[1:-1])


def test_a_generator_may_reuse_its_buffer(tmp_path):
    """Shards are hashed on a thread; an array the source reuses must still be hashed as written."""
    buf = np.zeros((50_000, 4), np.float32)  # 800 kB: several hash batches per shard

    def reusing():
        for i in range(12):
            buf[:] = i
            yield f"k{i}", buf

    m = sw.pack(reusing(), str(tmp_path / "r"), shard_bytes=3 << 20, progress=False)
    assert verify(str(tmp_path / "r"), progress=False)["shards"] == len(m.shards) > 1
    got = read_via_manifest(str(tmp_path / "r"))
    assert all((got[f"k{i}"] == i).all() for i in range(12))


def test_big_endian_packs_with_little_endian(tmp_path):
    a = np.arange(10, dtype=">f4").reshape(5, 2)
    b = np.arange(6, dtype="<f4").reshape(3, 2)
    m = sw.pack([("a", a), ("b", b)], str(tmp_path / "e"), progress=False)
    assert m.dtype.str == "<f4"
    got = read_via_manifest(str(tmp_path / "e"))
    np.testing.assert_array_equal(got["a"], a)
    np.testing.assert_array_equal(got["b"], b)


# ---- interrupted packs -------------------------------------------------------------------------

class Crash(RuntimeError):
    pass


def crashing(seqs, after: int):
    for i, item in enumerate(seqs):
        if i == after:
            raise Crash(f"source died after {after} items")
        yield item


def test_interrupted_pack_leaves_nothing_and_rerun_completes(tmp_path):
    seqs = make_sequences(40, seed=6)
    clean = tmp_path / "clean"
    sw.pack(seqs, str(clean), shard_bytes=32 << 10, progress=False)
    dest = tmp_path / "dest"
    with pytest.raises(PackError, match="source died after"):
        sw.pack(crashing(seqs, 25), str(dest), shard_bytes=32 << 10, progress=False)
    assert os.listdir(dest) == []  # the shards it had finished are removed, and its lock
    with pytest.raises(ManifestError, match="index.json"):
        sw.load_manifest(str(dest))
    sw.pack(seqs, str(dest), shard_bytes=32 << 10, progress=False)
    assert files_of(dest) == files_of(clean)


def test_interrupted_repack_over_a_finished_dataset(tmp_path):
    old = make_sequences(80, seed=7)  # a bigger dataset is there first: more shards than the new one
    new = make_sequences(30, seed=8)
    clean = tmp_path / "clean"
    sw.pack(new, str(clean), shard_bytes=32 << 10, progress=False)
    dest = tmp_path / "dest"
    sw.pack(old, str(dest), shard_bytes=32 << 10, progress=False)
    before = files_of(dest)
    with pytest.raises(PackError, match="source died after"):
        sw.pack(crashing(new, 20), str(dest), shard_bytes=32 << 10, progress=False)
    assert files_of(dest) == before  # the old dataset, unchanged: nothing of the failed pack is left
    assert_same_arrays(read_via_manifest(str(dest)), {k: a for k, a, _ in old})
    # a stale temporary from a killed run (no exception handler ran) is cleaned up by the next run
    (dest / "shard-g000002-u000000-000001.tar.tmp-99999-0a1b2c3d").write_bytes(b"partial")
    m = sw.pack(new, str(dest), shard_bytes=32 << 10, progress=False)
    # the new dataset is the clean pack's bytes under generation 2's names; generation 1 stays for its readers
    assert [(dest / s.name).read_bytes() for s in m.shards] == [v for k, v in sorted(files_of(clean).items())
                                                                if k.endswith(".tar")]
    assert sorted(os.listdir(dest)) == sorted(files_with_sums(m) + ["index.json", "index-g000001.json"]
                                              + [k for k in before if k != "index.json"])
    assert_same_arrays(read_via_manifest(str(dest)), {k: a for k, a, _ in new})


def test_crash_in_a_worker_process(tmp_path, npy_dir):
    root, _ = npy_dir
    (root / "a" / "seq0013.npy").write_bytes(b"\x93NUMPY garbage")
    dest = tmp_path / "d"
    shm = lambda: sorted(p.name for p in Path("/dev/shm").glob("*streamwin*")) if Path("/dev/shm").is_dir() else []
    before = shm()
    with pytest.raises(PackError, match="seq0013.npy"):
        sw.pack(str(root), str(dest), shard_bytes=4 << 10, workers=2, progress=False)
    assert os.listdir(dest) == []  # no index, no shard of the failed pack, no temporary, no lock
    assert shm() == before  # workers write their own shards: nothing is spilled to /dev/shm


# ---- bad input ---------------------------------------------------------------------------------

def test_dtype_mismatch_and_cast(tmp_path):
    seqs = [("a", np.ones((4, 2), np.float32)), ("b", np.ones((3, 2), np.float64))]
    with pytest.raises(PackError, match=r"'b'.*<f8.*'a'.*<f4.*cast"):
        sw.pack(seqs, str(tmp_path / "x"), progress=False)
    assert not (tmp_path / "x" / "index.json").exists()
    m = sw.pack(seqs, str(tmp_path / "y"), cast="float32", progress=False)
    assert m.dtype == np.float32
    got = read_via_manifest(str(tmp_path / "y"))
    assert got["b"].dtype == np.float32 and got["b"].tobytes() == seqs[1][1].astype(np.float32).tobytes()
    with pytest.raises(PackError, match="cast="):
        sw.pack(seqs, str(tmp_path / "z"), cast="object", progress=False)


def test_feature_shape_mismatch(tmp_path):
    seqs = [("a", np.ones((4, 2), np.float32)), ("b", np.ones((4, 2), np.float32)), ("c", np.ones((4, 3), np.float32))]
    with pytest.raises(PackError, match=r"'c'.*step shape \(3,\).*\(2,\)"):
        sw.pack(seqs, str(tmp_path / "x"), progress=False)
    with pytest.raises(PackError, match=r"'b'.*step shape \(\)"):
        sw.pack([("a", np.ones((4, 2))), ("b", np.ones(4))], str(tmp_path / "x"), progress=False)


def test_zero_length_sequences_skipped_and_counted_or_refused(tmp_path):
    seqs = [("a", np.ones(3, np.int32)), ("e1", np.zeros(0, np.int32)), ("b", np.ones(2, np.int32)),
            ("e2", np.zeros((0,), np.int32))]
    m = sw.pack(seqs, str(tmp_path / "x"), progress=False)
    assert m.num_sequences == 2 and m.dropped_empty == 2
    assert json.loads((tmp_path / "x" / "index.json").read_text())["dropped_empty"] == 2
    with pytest.raises(PackError, match="'e1'.*zero length"):
        sw.pack(seqs, str(tmp_path / "y"), empty="error", progress=False)
    with pytest.raises(PackError, match="no non-empty"):
        sw.pack([("e", np.zeros(0))], str(tmp_path / "z"), progress=False)


def test_object_and_pickled_arrays_refused(tmp_path):
    with pytest.raises(PackError, match="'o'.*object"):
        sw.pack([("a", np.ones(2)), ("o", np.array([{"x": 1}, None], dtype=object))], str(tmp_path / "x"),
                progress=False)
    with pytest.raises(PackError, match="'s'"):
        sw.pack([("s", np.array(["ab", "cd"]))], str(tmp_path / "x"), progress=False)
    src = tmp_path / "src"
    src.mkdir()
    np.save(src / "good.npy", np.ones(3))
    np.save(src / "pickled.npy", np.array([{"evil": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(PackError, match="pickled.npy"):
        sw.pack(str(src), str(tmp_path / "y"), progress=False)


def test_duplicate_keys(tmp_path):
    seqs = [("a", np.ones(2)), ("b", np.ones(2)), ("a", np.ones(3))]
    with pytest.raises(PackError, match="duplicate sequence key 'a'.*shard-g000001-u000000-000000.tar"):
        sw.pack(seqs, str(tmp_path / "x"), progress=False)
    src = tmp_path / "src"
    src.mkdir()
    np.save(src / "a_b.npy", np.ones(2))
    np.save(src / "a.b.npy", np.ones(2))  # both become key "a_b"
    with pytest.raises(PackError, match="duplicate sequence key 'a_b'"):
        sw.pack(str(src), str(tmp_path / "y"), workers=2, progress=False)


@pytest.mark.parametrize("key", ["a.b", "a/b", "", "has space", "k" * 91, "..", "x\\y", "é"])
def test_invalid_keys(tmp_path, key):
    with pytest.raises(PackError, match="key"):
        sw.pack([("ok", np.ones(2)), (key, np.ones(2))], str(tmp_path / "x"), progress=False)


def test_unreadable_file_in_a_directory(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    np.save(src / "a.npy", np.ones(3))
    (src / "b.npy").write_bytes(b"this is not an npy file")
    np.save(src / "c.npy", np.ones(3))
    for workers in (1, 2):
        with pytest.raises(PackError, match="b.npy") as info:
            sw.pack(str(src), str(tmp_path / f"x{workers}"), workers=workers, progress=False)
        assert info.value.__cause__ is not None or "cannot read" in str(info.value)


def test_bad_options(tmp_path):
    seqs = [("a", np.ones(2))]
    for kw, pattern in [({"shard_bytes": 0}, "shard_bytes"), ({"compression": "gzip"}, "compression"),
                        ({"empty": "pad"}, "empty"), ({"workers": 0}, "workers"), ({"part": "3/3"}, "part"),
                        ({"part": "x"}, "i/n"), ({"nan": "drop"}, "nan must be 'count' or 'raise'"),
                        ({"cast": "nonsense"}, "cast='nonsense' is not a numpy dtype"),
                        ({"cast": "object"}, "only numeric dtypes")]:
        with pytest.raises(PackError, match=pattern):
            sw.pack(seqs, str(tmp_path / "x"), progress=False, **kw)


def test_inputs_is_the_first_parameter_and_source_still_works_with_a_warning(tmp_path):
    """pack(inputs, dest): inputs= by keyword packs the same files; the old keyword source= too, with one
    DeprecationWarning; both at once is a TypeError."""
    seqs = make_sequences(5, seed=2)
    sw.pack(seqs, str(tmp_path / "positional"), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", packmod.MissingValuesWarning)  # some of these sequences have meta, some none
        sw.pack(inputs=seqs, dest=str(tmp_path / "keyword"), progress=False)
    with pytest.warns(DeprecationWarning, match="called inputs") as caught:
        sw.pack(source=seqs, dest=str(tmp_path / "old"), progress=False)
    said = [w for w in caught if not issubclass(w.category, packmod.MissingValuesWarning)]
    assert len(said) == 1 and all(w.filename == __file__ for w in caught)  # each points at the caller
    assert files_of(tmp_path / "positional") == files_of(tmp_path / "keyword") == files_of(tmp_path / "old")
    with pytest.raises(TypeError, match="both inputs and source="):
        sw.pack(seqs, str(tmp_path / "both"), source=seqs, progress=False)
    with pytest.raises(PackError, match="input of type NoneType"):
        sw.pack(None, str(tmp_path / "none"), progress=False)


# ---- parts and merge ---------------------------------------------------------------------------

def test_parts_then_merge_equals_single_pack(tmp_path, npy_dir):
    root, expected = npy_dir
    single = tmp_path / "single"
    sw.pack(str(root), str(single), shard_bytes=16 << 10, progress=False)
    dest = tmp_path / "parts"
    for i in (2, 0, 1):  # any order, as SLURM array tasks finish
        sw.pack(str(root), str(dest), shard_bytes=16 << 10, part=f"{i}/3", progress=False)
    assert not (dest / "index.json").exists()
    m = sw.merge(str(dest))
    assert m.dropped_empty == 1
    merged = read_via_manifest(str(dest))
    assert_same_arrays(merged, expected)  # same sequences, same order as one pack
    assert_same_arrays(merged, read_via_manifest(str(single)))
    assert_same_arrays(read_via_webdataset(shard_urls(dest))[0], expected)
    verify(str(dest), progress=False)
    # parts of an in-memory iterable: every third item each
    seqs = make_sequences(10, seed=9)
    for i in range(3):
        sw.pack(seqs, str(tmp_path / "it"), part=(i, 3), progress=False)
    sw.merge(str(tmp_path / "it"))
    assert sorted(read_via_manifest(str(tmp_path / "it"))) == sorted(k for k, _, _ in seqs)


def test_merge_refuses_missing_parts_and_shards_and_a_failed_part_leaves_no_part_index(tmp_path, npy_dir):
    root, expected = npy_dir
    dest = tmp_path / "parts"
    for i in (0, 2):
        sw.pack(str(root), str(dest), part=f"{i}/3", shard_bytes=16 << 10, progress=False)
    with pytest.raises(ManifestError, match=r"1 of 3 parts.*index.part00001-of-00003.json"):
        sw.merge(str(dest))
    assert not (dest / "index.json").exists()
    sw.pack(str(root), str(dest), part="1/3", shard_bytes=16 << 10, progress=False)
    # re-packing a part removes its part index first: a part that fails leaves none to merge
    with pytest.raises(PackError, match="source died after"):
        sw.pack(crashing(make_sequences(3), 1), str(dest), part="1/3", progress=False)
    assert not (dest / "index.part00001-of-00003.json").exists()
    sw.pack(str(root), str(dest), part="1/3", shard_bytes=16 << 10, progress=False)
    # a part index whose shard went missing
    victim = sorted(dest.glob("shard-g000001-*.tar"))[-1]
    data = victim.read_bytes()
    victim.unlink()
    with pytest.raises(ManifestError, match=f"missing.*{victim.name}"):
        sw.merge(str(dest))
    victim.write_bytes(data)
    m = sw.merge(str(dest))
    assert not list(dest.glob("index.part*"))  # merged parts are gone; the dataset is an ordinary one
    assert_same_arrays(read_via_manifest(str(dest)), expected)
    assert sorted(os.listdir(dest)) == sorted(files_with_sums(m) + ["index.json"])
    with pytest.raises(ManifestError, match="no part indexes"):
        sw.merge(str(tmp_path / "nothing"))


def test_too_many_parts_for_the_files(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    np.save(src / "a.npy", np.ones(3))
    with pytest.raises(PackError, match="part 0/2 is empty"):
        sw.pack(str(src), str(tmp_path / "x"), part="0/2", progress=False)


# ---- value columns of tables (names recorded, choice reported) -----------------------------------

# what pandas' df.to_csv() writes: the index first, under an empty name
PANDAS_CSV = (",sensor,t,year,temp,humidity,site\n"
              "0,a,1,2020,1.5,30,x\n1,a,0,2020,1.0,31,x\n2,b,0,2021,7.0,40,y\n")


@pytest.mark.parametrize("backend", ["pyarrow", "stdlib"])
def test_table_value_columns_are_recorded_and_the_left_out_ones_named(tmp_path, monkeypatch, backend):
    if backend == "stdlib":
        monkeypatch.setitem(__import__("sys").modules, "pyarrow.csv", None)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "d.csv").write_text(PANDAS_CSV)
    # a CSV says nothing of which columns are values: pack asks rather than take the year as a feature
    with pytest.raises(PackError, match=r"d\.csv: id_column='sensor' leaves 4 numeric columns, 't', 'year', 'temp', "
                                        r"'humidity'.*order_column=.*value_columns=\[\.\.\.\].*value_columns='\*'"):
        sw.pack(str(tmp_path / "src"), str(tmp_path / "ds"), id_column="sensor", progress=False)
    # the time column named, the year still holds one value per sensor: asked too
    with pytest.raises(PackError, match=r"d\.csv: 'year' holds one value per sensor .* value_columns=\['temp', "
                                        r"'humidity'\], or pass value_columns='\*'"):
        sw.pack(str(tmp_path / "src"), str(tmp_path / "ds"), id_column="sensor", order_column="t", progress=False)
    assert not (tmp_path / "ds" / "index.json").exists()
    m = sw.pack(str(tmp_path / "src"), str(tmp_path / "ds"), id_column="sensor", order_column="t", value_columns="*",
                progress=False)
    assert m.value_columns == ("year", "temp", "humidity")  # every numeric column but the id, order and index
    assert m.left_out_columns == {"": "pandas index", "sensor": "id column", "t": "order column", "site": "not numeric"}
    assert m.step_shape == (3,)
    got = read_via_manifest(str(tmp_path / "ds"))
    np.testing.assert_array_equal(got["a"], [[2020, 1.0, 31], [2020, 1.5, 30]])
    again = sw.load_manifest(str(tmp_path / "ds"))
    assert (again.value_columns, again.left_out_columns) == (m.value_columns, m.left_out_columns)
    assert sw.WindowDataset(str(tmp_path / "ds"), window=1).columns == ("year", "temp", "humidity")
    # chosen by the user: those, in the user's order; one name as a string is one column
    m = sw.pack(str(tmp_path / "src"), str(tmp_path / "ds2"), id_column="sensor", order_column="t",
                value_columns="humidity", progress=False)
    assert m.value_columns == ("humidity",) and m.step_shape == ()
    assert m.left_out_columns == {"": "not in value_columns", "sensor": "id column", "t": "order column",
                                  "year": "not in value_columns", "temp": "not in value_columns",
                                  "site": "not in value_columns"}


def test_parquet_pandas_index_is_left_out_and_row_layout_names_its_list_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    (tmp_path / "long").mkdir()
    pq.write_table(pa.table({"__index_level_0__": [0, 1], "Unnamed: 0": [5, 6], "id": ["s", "s"], "v": [1.0, 2.0]}),
                   tmp_path / "long" / "a.parquet")
    m = sw.pack(str(tmp_path / "long"), str(tmp_path / "ds"), id_column="id", progress=False)
    assert m.value_columns == ("v",)
    assert m.left_out_columns == {"__index_level_0__": "pandas index", "Unnamed: 0": "pandas index", "id": "id column"}
    (tmp_path / "rows").mkdir()
    pq.write_table(pa.table({"doc": ["a", "b"], "x": [[1.0, 2.0], [3.0]], "y": [[5.0, 6.0], [7.0]]}),
                   tmp_path / "rows" / "r.parquet")
    m = sw.pack(str(tmp_path / "rows"), str(tmp_path / "ds2"), id_column="doc", progress=False)
    assert m.value_columns == ("x", "y") and m.step_shape == (2,)


def test_files_with_other_value_columns_are_refused_naming_both(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.csv").write_text("id,u,v\ns,1.0,2.0\n")
    (tmp_path / "src" / "b.csv").write_text("id,u,w\nr,1.0,2.0\n")
    with pytest.raises(PackError, match=r"b\.csv.*\['u', 'w'\].*a\.csv.*\['u', 'v'\].*value_columns"):
        sw.pack(str(tmp_path / "src"), str(tmp_path / "ds"), id_column="id", value_columns="*", progress=False)
    m = sw.pack(str(tmp_path / "src"), str(tmp_path / "ds"), id_column="id", value_columns=["u"], workers=2,
                progress=False)
    assert m.value_columns == ("u",)
    assert m.left_out_columns == {"id": "id column", "v": "not in value_columns", "w": "not in value_columns"}


def test_value_columns_survive_parts_and_merge(tmp_path):
    (tmp_path / "src").mkdir()
    for name in "abc":
        (tmp_path / "src" / f"{name}.csv").write_text(f"id,t,v,w\n{name},0,1.0,2.0\n{name},1,3.0,4.0\n")
    for i in range(3):
        sw.pack(str(tmp_path / "src"), str(tmp_path / "ds"), id_column="id", order_column="t", part=f"{i}/3",
                value_columns="*", progress=False)
    m = sw.merge(str(tmp_path / "ds"))
    assert m.value_columns == ("v", "w") and m.left_out_columns == {"id": "id column", "t": "order column"}


def test_sources_without_column_names_record_none(tmp_path):
    m = sw.pack(make_sequences(3), str(tmp_path / "ds"), progress=False)
    assert m.value_columns is None and m.left_out_columns is None
    assert sw.WindowDataset(str(tmp_path / "ds"), window=1).columns is None
    assert "value_columns" not in json.loads((tmp_path / "ds" / "index.json").read_text())


def test_old_manifests_load_and_new_ones_keep_the_old_fields(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "d.csv").write_text(PANDAS_CSV)
    sw.pack(str(tmp_path / "src"), str(tmp_path / "ds"), id_column="sensor", value_columns="*", progress=False)
    doc = json.loads((tmp_path / "ds" / "index.json").read_text())
    # what older streamwin reads: version 1, shard entries with exactly these fields (ShardEntry(**entry))
    assert doc["version"] == 1
    assert all(set(s) == {"name", "bytes", "sha256", "num_sequences", "num_steps"} for s in doc["shards"])
    for new_field in ("value_columns", "left_out_columns", "nonfinite", "checks", "content_sha256"):
        doc.pop(new_field)
    old = sw.formats.manifest.parse_manifest(json.dumps(doc))
    assert old.value_columns is None and old.left_out_columns is None and old.nonfinite is None


# ---- NaN and inf: counted per dataset and shard, or refused ---------------------------------------

def sequences_with_nonfinite() -> tuple[list[tuple[str, np.ndarray]], dict[str, tuple[int, int]]]:
    """Float sequences, some with NaN and ±inf at known places; (NaN, inf) per key counted here."""
    rng = np.random.default_rng(3)
    seqs, counts = [], {}
    for i in range(30):
        arr = rng.normal(size=(int(rng.integers(20, 200)), 2)).astype(np.float32)
        if i % 4 == 1:
            arr[rng.integers(0, len(arr), 3), rng.integers(0, 2, 3)] = np.nan
        if i % 6 == 5:
            arr[-1, 0], arr[0, 1] = np.inf, -np.inf
        seqs.append((f"s{i:02d}", arr))
        counts[f"s{i:02d}"] = (sum(1 for v in arr.ravel().tolist() if v != v),
                               sum(1 for v in arr.ravel().tolist() if v in (float("inf"), float("-inf"))))
    return seqs, counts


@pytest.mark.parametrize("workers", [1, 2])
def test_nan_and_inf_are_counted_per_dataset_and_per_shard(tmp_path, workers):
    seqs, counts = sequences_with_nonfinite()
    src = tmp_path / "src"
    src.mkdir()
    for key, arr in seqs:
        np.save(src / f"{key}.npy", arr)
    nan, inf = sum(c[0] for c in counts.values()), sum(c[1] for c in counts.values())
    with pytest.warns(packmod.NonFiniteWarning, match=f"packed {nan} NaN and {inf} inf values"):
        m = sw.pack(str(src), str(tmp_path / "ds"), shard_bytes=4 << 10, workers=workers, progress=False)
    assert nan > 0 and inf > 0
    assert (m.nonfinite.nan, m.nonfinite.inf) == (nan, inf)
    per_shard = [sum(sum(counts[m.key(i)]) for i in range(int(m.shard_starts[k]), int(m.shard_starts[k + 1])))
                 for k in range(len(m.shards))]
    assert list(m.nonfinite.per_shard) == per_shard and len(m.shards) > 3
    assert sw.load_manifest(str(tmp_path / "ds")).nonfinite == m.nonfinite


def test_integer_data_has_no_nonfinite_values_to_count(tmp_path):
    m = sw.pack([("a", np.arange(5)), ("b", np.arange(3))], str(tmp_path / "ds"), progress=False)
    assert (m.nonfinite.nan, m.nonfinite.inf, tuple(m.nonfinite.per_shard)) == (0, 0, (0,))


def test_nan_raise_refuses_naming_the_key_and_step(tmp_path):
    seqs, counts = sequences_with_nonfinite()
    first = next(key for key, _ in seqs if sum(counts[key]))
    arr = dict(seqs)[first]
    step = next(t for t in range(len(arr)) if not np.isfinite(arr[t]).all())
    with pytest.raises(PackError, match=rf"sequence '{first}'.*step {step}\b.*nan="):
        sw.pack(seqs, str(tmp_path / "ds"), nan="raise", progress=False)
    assert not (tmp_path / "ds" / "index.json").exists()
    with pytest.raises(PackError, match="nan must be 'count' or 'raise'"):
        sw.pack(seqs, str(tmp_path / "ds"), nan="drop", progress=False)
    clean = [(k, a) for k, a in seqs if not sum(counts[k])]
    assert sw.pack(clean, str(tmp_path / "ok"), nan="raise", progress=False).nonfinite.nan == 0


def test_casting_nan_to_integers_is_refused(tmp_path):
    with pytest.raises(PackError, match=r"sequence 'a'.*NaN or inf.*int16"):
        sw.pack([("a", np.array([1.0, np.nan]))], str(tmp_path / "ds"), cast="int16", progress=False)


def test_progress_bar_prints_whole_numbers(tmp_path, capsys):
    sw.pack(((f"k{i:05d}", np.zeros(2, np.uint8)) for i in range(10_000)), str(tmp_path / "ds"), progress=True)
    err = capsys.readouterr().err
    assert "sequences=10,000" in err and "e+" not in err, err[-400:]


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_index_counts_nan_and_inf_as_pack_does(tmp_path, compression):
    seqs, counts = sequences_with_nonfinite()
    root = tmp_path / "ds"
    with pytest.warns(packmod.NonFiniteWarning):
        m = sw.pack(seqs, str(root), shard_bytes=4 << 10, compression=compression, progress=False)
    (root / "index.json").unlink()
    again = sw.index_shards(str(root), progress=False)
    assert again.nonfinite == m.nonfinite
    assert (again.nonfinite.nan, again.nonfinite.inf) == tuple(map(sum, zip(*counts.values())))


@pytest.mark.parametrize("arr", [
    np.full(10, 3e38, np.float32),  # the sum overflows: finite values must not be counted
    np.full(100_000, 60_000, np.float16),
    np.array([np.inf, -np.inf, 1.0]),
    np.array([1 + 1j, complex(np.nan, 0), complex(0, np.inf)]),
    np.array([[-np.inf, 1.0], [2.0, np.nan]]),
    np.array([np.finfo(np.float64).max] * 3),
    np.arange(5),
], ids=["f32-overflow", "f16-overflow", "inf-minus-inf", "complex", "2d", "f64-max", "int"])
def test_count_nonfinite_matches_a_value_by_value_count(arr):
    values = arr.ravel().tolist()
    nan = sum(1 for v in values if v != v)
    inf = sum(1 for v in values if v == v and abs(v) == float("inf"))
    assert nonfinite.count_nonfinite(arr) == (nan, inf)


# ---- many short sequences: batched encoding, workers, memory ---------------------------------

def short_npz_dir(root: Path, files: int = 6, per_file: int = 700, seed: int = 11) -> dict[str, np.ndarray]:
    """``files`` .npz files of short float32 sequences (0..60 steps, some NaN/inf); the arrays by key."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True)
    expected = {}
    for f in range(files):
        arrays = {}
        for i in range(per_file):
            arr = rng.normal(size=int(rng.integers(0, 61))).astype(np.float32)
            if i % 97 == 5 and len(arr) > 2:
                arr[1], arr[-1] = np.nan, np.inf
            arrays[f"s{f}_{i:04d}"] = arr
        np.savez(root / f"f{f}.npz", **arrays)
        expected |= {f"f{f}__{k}": a for k, a in arrays.items() if len(a)}
    return expected


def test_workers_write_the_same_shards_and_manifest_as_one_process(tmp_path):
    """Many short sequences (the batched path) packed by 1 and by 2 processes: every file is
    byte-identical, index.json included, and the arrays are numpy's own."""
    expected = short_npz_dir(tmp_path / "src")
    with pytest.warns(packmod.NonFiniteWarning):
        one = sw.pack(str(tmp_path / "src"), str(tmp_path / "w1"), shard_bytes=256 << 10, workers=1, progress=False)
    with pytest.warns(packmod.NonFiniteWarning):
        two = sw.pack(str(tmp_path / "src"), str(tmp_path / "w2"), shard_bytes=256 << 10, workers=2, progress=False)
    assert files_of(tmp_path / "w1") == files_of(tmp_path / "w2") and len(one.shards) > 5
    got = read_via_manifest(str(tmp_path / "w2"))
    assert_same_arrays(got, expected)
    assert two.dropped_empty == sum(1 for f in (tmp_path / "src").glob("*.npz")
                                    for a in np.load(f).values() if not len(a))
    nonfinite = {k: int((~np.isfinite(a)).sum()) for k, a in expected.items()}
    assert list(two.nonfinite.per_shard) == [
        sum(nonfinite[two.key(i)] for i in range(int(two.shard_starts[k]), int(two.shard_starts[k + 1])))
        for k in range(len(two.shards))]
    assert verify(str(tmp_path / "w1"), progress=False)["sequences"] == len(expected)


@pytest.mark.parametrize("dtype,step,cast", [("<f4", (), None), (">f8", (3,), None), ("<i2", (2, 2), None),
                                             ("<f8", (), "float32"), ("u1", (5,), "int64")])
def test_encode_batch_is_byte_for_byte_the_one_by_one_encoding(dtype, step, cast):
    """A batch of sequences (lengths of 1 to 6 digits, keys of 1 to 90 characters, empty ones) encodes
    to the bytes of `encode_sequence` one by one, and a tar reader finds numpy's arrays in them."""
    rng = np.random.default_rng(len(step))
    lengths = [3, 0, 1, 12, 99, 100, 0, 1234, 7, 100_000 if not step else 20_000]
    keys = ["k", "e", "K" * 90, "a-b_c~1", "x" * 45, "y9", "e2", "z" * 89, "q!", "long"]
    arrays = [rng.integers(0, 100, size=(t,) + step).astype(dtype) for t in lengths]
    batch = Batch(keys, np.concatenate(arrays), np.cumsum([0] + lengths))
    rec, skipped = records.encode_batch(batch, cast=cast)
    one_by_one = [encode.encode_sequence(k, a, cast=cast) for k, a in zip(keys, arrays)]
    ref = records.records_of([e for e in one_by_one if e is not None], ".npy")
    assert skipped == 2 and bytes(rec.data) == bytes(ref.data)
    for name in ("ends", "content", "key_ends", "length", "size", "hlen", "nan", "inf", "keys"):
        np.testing.assert_array_equal(getattr(rec, name), getattr(ref, name), err_msg=name)
    import tarfile
    with tarfile.open(fileobj=io.BytesIO(bytes(rec.data) + tarfmt.TAR_END)) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    want = {f"{k}.npy": a.astype(cast or a.dtype.newbyteorder("<")) for k, a in zip(keys, arrays) if len(a)}
    assert list(members) == list(want)
    for name, arr in want.items():
        got = np.load(io.BytesIO(members[name]), allow_pickle=False)
        assert got.dtype == arr.dtype and got.shape == arr.shape and got.tobytes() == arr.tobytes(), name


def test_duplicate_keys_are_found_through_hash_collisions(monkeypatch):
    keys = ["ab", "b", "abc", "c", "ab0", "b"]
    blob = np.frombuffer("".join(keys).encode(), dtype=np.uint8)
    ends = np.cumsum([len(k) for k in keys])
    assert columns.duplicate_key(blob, ends) == (1, 5)
    assert columns.duplicate_key(blob[:-1], ends[:-1]) is None
    monkeypatch.setattr(columns, "key_hashes", lambda k, e, a, b: np.zeros(b - a, np.uint64))  # every hash collides
    assert columns.duplicate_key(blob, ends, chunk=2) == (1, 5)
    assert columns.duplicate_key(blob[:-1], ends[:-1], chunk=2) is None


MEMORY_PROBE = """
import sys
import numpy as np
import streamwin as sw
arr = np.ones(4, np.float32)
sw.pack(((f"k{i:08d}", arr) for i in range(int(sys.argv[1]))), sys.argv[2], progress=False, shard_bytes=1 << 30)
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""  # VmHWM: this process's peak RSS (ru_maxrss would start from the RSS of the parent that forked it)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")
def test_pack_memory_does_not_grow_with_the_number_of_sequences(tmp_path):
    """The per-sequence index goes to files as it grows: pack's peak RSS grows by the manifest's
    ~45 mapped bytes per sequence (page cache, while it is written), not by ~300 (Python lists)."""
    import subprocess
    import sys

    peak = {}
    for n in (20_000, 140_000):
        out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(n), str(tmp_path / f"d{n}")], check=True,
                             capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(Path(sw.__file__).parent.parent)})
        peak[n] = int(out.stdout.split()[-1]) * 1024
    per_sequence = (peak[140_000] - peak[20_000]) / 120_000
    assert per_sequence < 80, f"peak RSS grows by {per_sequence:.0f} bytes per sequence"


def test_framed_zstd_members_in_records_are_written_as_one_by_one(tmp_path):
    """zstd members of several frames, encoded into a file's Records, give the bytes and the frames
    field of the same sequences packed one by one from an iterable."""
    rng = np.random.default_rng(5)
    src = tmp_path / "src"
    src.mkdir()
    arrays = {f"a{i}": rng.integers(0, 4, size=(100_000 + 30_000 * i, 2)).astype(np.float32) for i in range(3)}
    for key, arr in arrays.items():
        np.save(src / f"{key}.npy", arr)
    # one shard each (a unit of the directory is its three files, as the iterable is one unit)
    m = sw.pack(str(src), str(tmp_path / "dir"), compression="zstd", shard_bytes=16 << 20, progress=False)
    sw.pack(list(arrays.items()), str(tmp_path / "it"), compression="zstd", shard_bytes=16 << 20, progress=False)
    assert m.frames is not None and len(m.frames.seq) == 3 and all(m.size < records.RECORD_MAX)
    assert files_of(tmp_path / "dir") == files_of(tmp_path / "it")
    for i, (key, arr) in enumerate(arrays.items()):  # every frame, decompressed in turn, gives numpy's array
        data = (tmp_path / "dir" / m.shards[m.shard_of(i)].name).read_bytes()[int(m.offset[i]) : int(m.offset[i] + m.size[i])]
        ends = [0] + m.frames.ends[m.frames.first[i] : m.frames.first[i + 1]].tolist()
        whole = b"".join(zstandard.ZstdDecompressor().decompress(data[a:b]) for a, b in zip(ends, ends[1:]))
        assert m.key(i) == key and np.load(io.BytesIO(whole), allow_pickle=False).tobytes() == arr.tobytes()


def test_one_sequence_files_are_encoded_many_per_task():
    """.npy and text files (one sequence each) go to workers TASK_FILES at a time; other files alone."""
    npy = [InputUnit("npy", f"/d/{i}.npy", f"{i}.npy") for i in range(600)]
    npz = [InputUnit("npz", f"/d/{i}.npz", f"{i}.npz") for i in range(3)]
    assert [len(t) for t in tasks.tasks_of(npy)] == [256, 256, 88]
    assert [len(t) for t in tasks.tasks_of(npz)] == [1, 1, 1]
    assert [u for t in tasks.tasks_of(npy) for u in t] == npy


@pytest.mark.parametrize("options", [{"cast": "int32"}, {"nan": "raise"}, {"empty": "error"}])
def test_batched_sequences_are_refused_as_one_by_one(tmp_path, options):
    """A NaN that cast= cannot take, nan='raise', empty='error': the same PackError (naming the
    sequence and the step) from an .npz (batched) as from an iterable (one by one)."""
    arrays = {"a": np.arange(5, dtype=np.float32), "b": np.array([1, 2, np.nan, 4], np.float32),
              "c": np.zeros(0, np.float32), "d": np.array([np.inf], np.float32)}
    np.savez(tmp_path / "x.npz", **arrays)
    with pytest.raises(PackError) as batched:
        sw.pack(str(tmp_path / "x.npz"), str(tmp_path / "p"), progress=False, **options)
    with pytest.raises(PackError) as single:
        sw.pack(list(arrays.items()), str(tmp_path / "q"), progress=False, **options)
    assert str(batched.value) == str(single.value) and ("'b'" in str(single.value) or "'c'" in str(single.value))
