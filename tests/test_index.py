"""verify and index_shards: a good dataset verifies; every kind of damage is a ShardError naming
the shard, the member and the byte offset; tar shards written by webdataset get an index.json
whose offsets read back correctly (pax headers included)."""
from __future__ import annotations

import base64
import io
import json
import re
import tarfile
import zlib
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

import streamwin as sw
from conftest import flip_byte
from streamwin.errors import ManifestError, ShardError
from streamwin.formats.manifest import content_checksum
from streamwin.packing.scan import index_shards, verify


def make_dataset(root: Path, n: int = 30, seed: int = 0, **kw) -> sw.Manifest:
    rng = np.random.default_rng(seed)
    seqs = [(f"s{i:03d}", rng.normal(size=(int(rng.integers(5, 300)), 2)).astype(np.float32),
             {"i": i} if i % 5 == 0 else None) for i in range(n)]
    return sw.pack(seqs, str(root), shard_bytes=8 << 10, progress=False, **kw)


flip = partial(flip_byte, mask=0x01)


def edit_index(root: Path, edit) -> None:
    """Edit index.json and seal it again (as a tool would that rewrites it): what verify finds is tested here;
    that an edit left unsealed is refused on load, in test_hardening.py."""
    doc = json.loads((root / "index.json").read_text())
    edit(doc)
    doc["content_sha256"] = content_checksum(doc)
    (root / "index.json").write_text(json.dumps(doc))


def edit_column(doc: dict, name: str, i: int, delta: int) -> None:
    dt = "<i4" if name == "hlen" else "<i8"
    col = np.frombuffer(zlib.decompress(base64.b64decode(doc["columns"][name])), dtype=dt).copy()
    col[i] += delta
    doc["columns"][name] = base64.b64encode(zlib.compress(col.tobytes())).decode()


def test_verify_passes_on_a_good_dataset(tmp_path):
    m = make_dataset(tmp_path / "d")
    r = verify(str(tmp_path / "d"), progress=False)
    assert (r["shards"], r["sequences"], r["steps"]) == (len(m.shards), 30, m.num_steps)
    assert r["bytes"] == sum(p.stat().st_size for p in (tmp_path / "d").glob("*.tar"))
    make_dataset(tmp_path / "z", compression="zstd")
    assert verify(str(tmp_path / "z"), progress=False)["sequences"] == 30


def test_flipped_byte_in_an_npy_header(tmp_path):
    root = tmp_path / "d"
    m = make_dataset(root)
    k, i = 2, int(m.shard_starts[2]) + 1  # the second sequence of the third shard
    shard = root / m.shards[k].name
    header = shard.read_bytes()[int(m.offset[i]) : int(m.offset[i]) + int(m.hlen[i])]
    at = int(m.offset[i]) + header.index(b"'shape': (") + len("'shape': (")  # first digit of the length
    flip(shard, at)
    with pytest.raises(ShardError) as info:
        verify(str(root), progress=False)
    e = info.value
    assert e.shard == f"{root}/{m.shards[k].name}" and e.member == f"{m.key(i)}.npy" and e.offset == int(m.offset[i])
    assert m.shards[k].name in str(e) and f"byte offset {int(m.offset[i])}" in str(e)


def test_flipped_byte_in_array_data_is_a_checksum_mismatch(tmp_path):
    root = tmp_path / "d"
    m = make_dataset(root)
    i = int(m.shard_starts[1])
    at = int(m.offset[i] + m.hlen[i]) + 5
    flip(root / m.shards[1].name, at)
    with pytest.raises(ShardError, match="checksum mismatch") as info:  # the chunk checksums say where
        verify(str(root), progress=False)
    e = info.value
    assert e.shard.endswith(m.shards[1].name) and e.member == f"{m.key(i)}.npy"
    assert e.offset <= at < e.offset + m.checks.chunk
    old = json.loads((root / "index.json").read_text())
    del old["checks"], old["content_sha256"]  # a manifest of old, without chunk checksums: the shard's sha256 finds it
    (root / "index.json").write_text(json.dumps(old))
    with pytest.raises(ShardError, match="sha256 mismatch") as info:
        verify(str(root), progress=False)
    assert info.value.shard.endswith(m.shards[1].name)


def test_flipped_byte_in_a_tar_header(tmp_path):
    root = tmp_path / "d"
    m = make_dataset(root)
    i = int(m.shard_starts[1]) + 1
    flip(root / m.shards[1].name, int(m.offset[i]) - 512 + 2)  # in the member name
    with pytest.raises(ShardError) as info:
        verify(str(root), progress=False)
    assert info.value.shard.endswith(m.shards[1].name) and info.value.offset is not None


def test_corrupt_compressed_member(tmp_path):
    root = tmp_path / "z"
    m = make_dataset(root, compression="zstd")
    i = int(m.shard_starts[1]) + 1
    flip(root / m.shards[1].name, int(m.offset[i]))  # the zstd frame's magic number
    with pytest.raises(ShardError, match="cannot decompress") as info:
        verify(str(root), progress=False)
    assert info.value.member == f"{m.key(i)}.npy.zst" and info.value.offset == int(m.offset[i])


def test_truncated_shard(tmp_path):
    root = tmp_path / "d"
    m = make_dataset(root)
    for k, cut in ((0, None), (3, 700)):  # mid-member content, and inside the first header
        i = int(m.shard_starts[k]) + 1
        shard = root / m.shards[k].name
        keep = int(m.offset[i]) + 100 if cut is None else cut
        shard.write_bytes(shard.read_bytes()[:keep])
    with pytest.raises(ShardError) as info:
        verify(str(root), progress=False)
    e = info.value
    assert e.shard.endswith(m.shards[0].name)
    assert e.member == f"{m.key(1)}.npy" and e.offset == int(m.offset[1])
    assert len(e.failures) == 2 and e.failures[1].shard.endswith(m.shards[3].name)
    assert "2 of" in str(e)


@pytest.mark.parametrize("what", ["length", "offset", "size", "hlen", "sha256", "bytes", "num_steps", "shard"])
def test_edited_manifest(tmp_path, what):
    root = tmp_path / "d"
    m = make_dataset(root)
    i = int(m.shard_starts[2]) + 1
    if what in ("length", "offset", "size", "hlen"):
        edit_index(root, lambda doc: edit_column(doc, what, i, 1))
    elif what == "shard":
        (root / m.shards[2].name).unlink()
    else:
        def bump(doc):
            s = doc["shards"][2]
            s[what] = ("0" + s[what][1:]) if what == "sha256" else s[what] + 1
            if what in ("bytes", "num_steps"):  # and the total, which must agree with the shards listed
                doc[f"num_{what.removeprefix('num_')}"] += 1
        edit_index(root, bump)
    if what in ("length", "size", "hlen", "num_steps"):  # fields that disagree are refused when index.json is read
        field = "shards[2].num_steps" if what == "num_steps" else f"sequence {i}:"
        with pytest.raises(ManifestError, match=re.escape(field)):
            verify(str(root), progress=False)
        return
    with pytest.raises(ShardError) as info:
        verify(str(root), progress=False)
    e = info.value
    assert e.shard.endswith(m.shards[2].name)
    if what in ("length", "offset", "size", "hlen"):
        label = {"length": "shape: shard (", "offset": "content offset: shard ", "size": "size: shard ",
                 "hlen": "npy header length: shard "}[what]
        assert e.member == f"{m.key(i)}.npy" and e.offset == int(m.offset[i]) and label in str(e)
    else:
        assert e.member is None and {"sha256": "sha256 mismatch", "bytes": "bytes mismatch", "num_steps": "steps mismatch",
                                     "shard": "cannot open shard"}[what] in str(e)


def test_verify_without_index(tmp_path):
    make_dataset(tmp_path / "d")
    (tmp_path / "d" / "index.json").unlink()
    with pytest.raises(ManifestError, match="no index.json"):
        verify(str(tmp_path / "d"), progress=False)


# ---- index_shards ------------------------------------------------------------------------------

def write_wds_shards(root: Path, samples: list[dict], per_shard: int) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(0, len(samples), per_shard):
        path = root / f"data-{s // per_shard:04d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for sample in samples[s : s + per_shard]:
                sink.write(sample)
        paths.append(path)
    return paths


def wds_samples(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        key = f"group{i % 3}/item{i:03d}"
        if i == 4:
            key = "deep/" + "x" * 120 + f"/item{i:03d}"  # a member name past 100 bytes: a pax header
        arr = rng.integers(-1000, 1000, size=(int(rng.integers(1, 200)), 3)).astype(np.int32)
        out.append({"__key__": key, "npy": arr, "json": {"i": i}, "cls": str(i % 2)})
    return out


def test_index_webdataset_shards(tmp_path):
    root = tmp_path / "wds"
    samples = wds_samples(25)
    write_wds_shards(root, samples, per_shard=7)
    m = index_shards(str(root), progress=False)
    assert [m.key(i) for i in range(m.num_sequences)] == [s["__key__"] for s in samples]
    assert m.dtype == np.int32 and m.step_shape == (3,) and m.compression is None and len(m.shards) == 4
    assert sw.load_manifest(str(root)).num_sequences == 25
    # offsets read back with plain reads, independently of streamwin
    for k, shard in enumerate(m.shards):
        data = (root / shard.name).read_bytes()
        assert shard.bytes == len(data)
        for i in range(int(m.shard_starts[k]), int(m.shard_starts[k + 1])):
            member = data[int(m.offset[i]) : int(m.offset[i]) + int(m.size[i])]
            arr = np.load(io.BytesIO(member), allow_pickle=False)
            want = samples[i]["npy"]
            assert arr.tobytes() == want.tobytes() and arr.shape == want.shape and int(m.length[i]) == len(want)
    with tarfile.open(root / m.shards[0].name) as tf:
        long = next(t for t in tf.getmembers() if "xxx" in t.name)
    assert long.offset_data - long.offset > 512  # it did take a pax header
    assert verify(str(root), progress=False)["sequences"] == 25


def test_indexed_webdataset_shards_load_through_streamwin(tmp_path):
    root = tmp_path / "wds"
    samples = wds_samples(12, seed=1)
    write_wds_shards(root, samples, per_shard=5)
    index_shards(str(root), progress=False)
    ds = sw.WindowDataset(str(root), window=1, batch_size=1, rank=0, world_size=1, order=sw.Order(shuffle=False))
    got: dict[str, list] = {}
    for batch in sw.WindowLoader(ds):
        for key, start, x in zip(batch["key"], batch["start"].tolist(), batch["x"].numpy()):
            got.setdefault(key, []).append((start, x[0]))
    for s in samples:
        rows = [x for _, x in sorted(got[s["__key__"]], key=lambda t: t[0])]
        np.testing.assert_array_equal(np.stack(rows), s["npy"])


def test_index_of_our_own_shards_equals_the_packed_index(tmp_path):
    for compression in (None, "zstd"):
        root = tmp_path / f"d{compression}"
        make_dataset(root, compression=compression)
        packed = (root / "index.json").read_text()
        (root / "index.json").unlink()
        m = index_shards(str(root), progress=False)
        assert m.to_json() == packed


def test_index_refuses_inconsistent_shards(tmp_path):
    root = tmp_path / "mixed"
    samples = wds_samples(6)
    samples[4]["npy"] = samples[4]["npy"].astype(np.float64)
    write_wds_shards(root, samples, per_shard=3)
    with pytest.raises(ShardError, match="dtype <f8.*<i4") as info:
        index_shards(str(root), progress=False)
    assert info.value.shard.endswith("data-0001.tar") and info.value.member.endswith(".npy")
    assert info.value.offset is not None and not (root / "index.json").exists()

    root = tmp_path / "shape"
    samples = wds_samples(4)
    samples[2]["npy"] = samples[2]["npy"][:, :2]
    write_wds_shards(root, samples, per_shard=4)
    with pytest.raises(ShardError, match=r"step shape \(2,\)"):
        index_shards(str(root), progress=False)

    root = tmp_path / "dup"
    samples = wds_samples(4)
    samples[3]["__key__"] = samples[0]["__key__"]
    write_wds_shards(root, samples, per_shard=2)
    with pytest.raises(ShardError, match="duplicate key"):
        index_shards(str(root), progress=False)

    root = tmp_path / "pickled"
    root.mkdir()
    with wds.TarWriter(str(root / "a.tar")) as sink:
        sink.write({"__key__": "a", "npy": np.array([{"x": 1}], dtype=object)})
    with pytest.raises(ShardError, match="object|pickl|dtype") as info:
        index_shards(str(root), progress=False)
    assert info.value.member == "a.npy"


def test_index_errors_about_the_shards(tmp_path):
    with pytest.raises(ManifestError, match="no shards matching"):
        index_shards(str(tmp_path), progress=False)
    (tmp_path / "junk.tar").write_bytes(b"not a tar file at all" * 100)
    with pytest.raises(ShardError, match="junk.tar"):
        index_shards(str(tmp_path), progress=False)
    (tmp_path / "junk.tar").unlink()
    with wds.TarWriter(str(tmp_path / "nonpy.tar")) as sink:
        sink.write({"__key__": "a", "txt": "hello"})
    with pytest.raises(ManifestError, match="no .npy"):
        index_shards(str(tmp_path), progress=False)
    # a pattern selects the shards
    write_wds_shards(tmp_path / "sub", wds_samples(3), per_shard=3)
    m = index_shards(str(tmp_path), pattern="sub/*.tar", progress=False)
    assert [s.name for s in m.shards] == ["sub/data-0000.tar"]
    assert verify(str(tmp_path), progress=False)["sequences"] == 3
