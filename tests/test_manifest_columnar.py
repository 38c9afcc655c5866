"""The columnar manifest (version 2): index.json plus a memory-mapped columns file (index-gNNNNNN.columns).

Round trip against the inline form (version 1) computed by the same pack, old datasets still
readable, the same batches from either form, remote datasets through the node cache, and a
damaged columns file named in the error.
"""
from __future__ import annotations

import json
import mmap
import os

import numpy as np
import pytest

import streamwin as sw
import streamwin.storage.manifests
from conftest import make_sequences
from streamwin.errors import ManifestError
from streamwin.formats.manifest import INDEX_NAME

COLS = "index-g000001.columns"  # the columns file of the first generation packed into a folder


def pack_both(tmp_path, seqs):
    """The same sequences packed twice: inline (version 1) and columnar (version 2)."""
    inline, columnar = str(tmp_path / "inline"), str(tmp_path / "columnar")
    sw.pack(list(seqs.items()), inline, shard_bytes=40_000, progress=False)
    streamwin.storage.manifests.COLUMNAR_FROM, saved = 1, streamwin.storage.manifests.COLUMNAR_FROM
    try:
        sw.pack(list(seqs.items()), columnar, shard_bytes=40_000, progress=False)
    finally:
        streamwin.storage.manifests.COLUMNAR_FROM = saved
    return inline, columnar


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    seqs = make_sequences(seed=11)
    return (*pack_both(tmp_path_factory.mktemp("columnar"), seqs), seqs)


def read_json(url):
    with open(os.path.join(url, INDEX_NAME)) as f:
        return json.load(f)


def test_small_datasets_stay_one_inline_file_large_ones_get_a_columns_file(both):
    inline, columnar, _ = both
    assert read_json(inline)["version"] == 1 and not os.path.exists(os.path.join(inline, COLS))
    doc = read_json(columnar)
    assert doc["version"] == 2 and "columns" not in doc and "keys" not in doc
    assert doc["columns_file"]["name"] == COLS
    assert os.path.getsize(os.path.join(columnar, COLS)) == doc["columns_file"]["bytes"]


def test_round_trip_equals_the_inline_manifest(both):
    inline, columnar, seqs = both
    a, b = sw.load_manifest(inline), sw.load_manifest(columnar)
    keys = list(seqs)
    for m in (a, b):  # against the sequences themselves, not each other only
        assert m.keys(np.arange(m.num_sequences)) == keys
        assert m.length.tolist() == [len(seqs[k]) for k in keys]
    for col in ("length", "offset", "size", "hlen", "key_ends", "shard_starts"):
        assert np.array_equal(getattr(a, col), getattr(b, col)), col
    assert (a.dtype, a.step_shape, a.shards, a.nonfinite) == (b.dtype, b.step_shape, b.shards, b.nonfinite)
    assert a.key(7) == b.key(7) == keys[7]


def test_columns_are_a_shared_map_of_the_file_not_a_copy(both):
    m = sw.load_manifest(both[1])
    for col in ("length", "offset", "size", "hlen", "key_ends"):
        arr = getattr(m, col)
        assert not arr.flags.owndata and not arr.flags.writeable, col
        base = arr
        while isinstance(base, (np.ndarray, memoryview)):
            base = base.obj if isinstance(base, memoryview) else base.base
        assert isinstance(base, mmap.mmap), col


def test_either_form_gives_the_same_batches(both):
    inline, columnar, _ = both

    def epoch(url, **kw):
        ds = sw.WindowDataset(url, window=16, stride=8, batch_size=8, shuffle_buffer=200, seed=3, **kw)
        return [(list(b["key"]), b["start"].tolist(), b["x"].numpy().tobytes())
                for b in sw.WindowLoader(ds, num_workers=0)]

    assert epoch(inline) == epoch(columnar)
    val = sw.Select(split="val")
    assert epoch(inline, select=val) == epoch(columnar, select=val)


def test_a_version_1_index_written_by_an_older_streamwin_still_loads(tmp_path):
    seqs = make_sequences(n=12, seed=2)
    url = str(tmp_path / "old")
    sw.pack(list(seqs.items()), url, progress=False)
    doc = read_json(url)
    for key in ("value_columns", "left_out_columns", "nonfinite", "content_sha256"):  # the first release wrote none
        doc.pop(key, None)
    with open(os.path.join(url, INDEX_NAME), "w") as f:
        json.dump(doc, f)
    m = sw.load_manifest(url)
    assert m.keys(np.arange(m.num_sequences)) == list(seqs) and m.nonfinite is None and not m.sealed


@pytest.mark.parametrize("damage", ["truncate", "missing", "layout"])
def test_a_damaged_columns_file_is_named(tmp_path, damage):
    url = pack_both(tmp_path, make_sequences(n=20, seed=5))[1]
    path = os.path.join(url, COLS)
    if damage == "truncate":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 10)
    elif damage == "missing":
        os.remove(path)
    else:
        doc = read_json(url)
        doc["columns_file"]["layout"]["offset"][0] = 8  # not where the column is (nor aligned)
        with open(os.path.join(url, INDEX_NAME), "w") as f:
            json.dump(doc, f)
    with pytest.raises(ManifestError, match=COLS) as info:
        sw.load_manifest(url)
    assert url in str(info.value) or damage == "layout"


def test_a_version_2_index_alone_says_how_to_load_it(both):
    with open(os.path.join(both[1], INDEX_NAME)) as f:
        with pytest.raises(ManifestError, match="load_manifest"):
            sw.formats.manifest.parse_manifest(f.read())


def test_verify_checks_the_columns_file(tmp_path):
    url = pack_both(tmp_path, make_sequences(n=20, seed=6))[1]
    sw.verify(url, progress=False)
    path = os.path.join(url, COLS)
    with open(path, "r+b") as f:  # a flipped byte inside the key bytes: size unchanged
        f.seek(os.path.getsize(path) - 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ManifestError, match=f"{COLS}.*(sha256|xxh3_128)"):  # (the load checks its xxh3_128 now)
        sw.verify(url, progress=False)


def test_remote_columns_come_through_the_node_cache(both, http_server, tmp_path):
    root = os.path.dirname(both[1])
    srv = http_server(root)
    url = srv.url_for(os.path.basename(both[1]))
    cache_dir = tmp_path / "cache"
    ds = sw.WindowDataset(url, window=16, batch_size=8, read=sw.Read(cache_dir=str(cache_dir)))
    m = ds.manifest
    assert np.array_equal(m.length, sw.load_manifest(both[1]).length)
    cached = [n for n in os.listdir(cache_dir) if n.endswith(COLS.replace(".", "_")) or n.endswith(COLS)]
    assert len(cached) == 1  # fetched once into the cache and mapped from there
    assert not m.length.flags.owndata
    plain = sw.load_manifest(url)  # no cache: read into memory, same content
    assert np.array_equal(plain.key_ends, m.key_ends)


def test_a_corrupt_remote_columns_file_is_named(tmp_path, http_server):
    url = pack_both(tmp_path, make_sequences(n=20, seed=8))[1]
    path = os.path.join(url, COLS)
    with open(path, "r+b") as f:
        f.seek(70)
        f.write(b"\xff")
    srv = http_server(str(tmp_path))
    with pytest.raises(ManifestError, match=f"columnar/{COLS}.*checksum"):  # named when the dataset is made
        sw.WindowDataset(srv.url_for("columnar"), window=16, batch_size=8,
                         read=sw.Read(cache_dir=str(tmp_path / "cache")))


def test_columnar_parts_merge_into_the_same_manifest_and_repacking_small_drops_the_columns(tmp_path, monkeypatch):
    seqs = list(make_sequences(n=30, seed=9).items())
    monkeypatch.setattr(streamwin.storage.manifests, "COLUMNAR_FROM", 1)
    single, parts = str(tmp_path / "single"), str(tmp_path / "parts")
    sw.pack(seqs, single, progress=False)
    for i in (1, 0):
        sw.pack(seqs, parts, part=(i, 2), progress=False)
    assert os.path.exists(os.path.join(parts, "index.part00000-of-00002.columns"))
    merged = sw.merge(parts)
    assert read_json(parts)["version"] == 2
    loaded = sw.load_manifest(parts)
    assert sorted(loaded.keys(np.arange(loaded.num_sequences))) == sorted(k for k, _ in seqs)
    assert np.array_equal(loaded.length, merged.length)
    sw.verify(parts, progress=False)
    monkeypatch.setattr(streamwin.storage.manifests, "COLUMNAR_FROM", 10**9)
    sw.pack(seqs, single, progress=False)  # the same dataset, now small enough to be inline again
    assert read_json(single)["version"] == 1 and "columns_file" not in read_json(single)
    # generation 1's columns file stays with its shards for the readers of the index it replaced, until the next pack
    assert json.loads(open(os.path.join(single, "index-g000001.json")).read())["columns_file"]["name"] == COLS
    sw.pack(seqs[:3], single, progress=False)
    assert not os.path.exists(os.path.join(single, COLS))
