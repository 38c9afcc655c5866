"""Nothing wrong is trained on silently: every byte a read covers is verified against chunk checksums.

A byte changed in a shard (on disk, in the page cache, on the server) is a ShardError naming
the shard, the member and an offset at most one chunk before it, whether the shard is mapped
locally, read over HTTP or through a worker, plain or zstd. With on_error="skip" exactly the
windows with a step in the damaged chunk weigh 0 (computed here from the member offsets and
the chunk size, independently of the reader). Each failure case first shows what happens with
verification off: the changed values reach the batch. Verification costs little in bytes: an
epoch of a long member read in small pieces over HTTP still reads about each byte once.
"""
from __future__ import annotations

import json
import os
import warnings
from functools import partial

import numpy as np
import pytest

import streamwin as sw
from conftest import flip_byte, make_sequences
from streamwin.formats import checks

W, S, H, B = 16, 8, 4, 8
pytestmark = pytest.mark.timeout(120)


def make(url, workers=0, **read):
    """A loader of ``url`` reading with ``sw.Read(**read)``."""
    ds = sw.WindowDataset(str(url), window=W, stride=S, horizon=H, batch_size=B, shuffle_buffer=200, seed=2,
                          read=sw.Read(**read))
    return sw.WindowLoader(ds, num_workers=workers)


def windows(loader) -> list[tuple[str, int, np.ndarray, float]]:
    out = []
    for b in loader:
        w = b["weight"].tolist() if "weight" in b else [1.0] * len(b["key"])
        out += [(k, s, x, wt) for k, s, x, wt in zip(b["key"], b["start"].tolist(), b["x"].numpy().copy(), w)]
    return out


@pytest.fixture()
def dataset(tmp_path):
    seqs = make_sequences(seed=7, max_len=600)
    url = tmp_path / "ds"
    m = sw.pack(list(seqs.items()), str(url), shard_bytes=60_000, progress=False)
    assert m.checks is not None and m.checks.chunk == checks.CHUNK
    return url, seqs, m


def victim(m, seqs) -> tuple[int, int, str]:
    """(sequence, shard byte to change, shard name): a byte in the middle of the longest member's steps."""
    i = int(np.argmax(m.length))
    at = int(m.offset[i] + m.hlen[i]) + int(m.length[i]) // 2 * m.step_bytes + 1  # inside a value's bytes
    return i, at, m.shards[m.shard_of(i)].name


change = partial(flip_byte, mask=0x40)


def assert_names(err: sw.ShardError, url, shard: str, member: str, at: int) -> None:
    assert "checksum mismatch" in str(err)
    assert err.shard == f"{url}/{shard}" and err.member == member
    assert err.offset <= at < err.offset + checks.CHUNK, (err.offset, at)
    assert f"byte offset {err.offset}" in str(err)


def test_unverified_a_changed_byte_trains_silently(dataset):
    """The failure this module is about: without verification a changed byte reaches the batch."""
    url, seqs, m = dataset
    i, at, shard = victim(m, seqs)
    change(url / shard, at)
    got = windows(make(url, verify_checksums=False))
    wrong = [(k, s) for k, s, x, _ in got if not np.array_equal(x, seqs[k][s : s + W])]
    assert wrong and {k for k, _ in wrong} == {m.key(i)}


@pytest.mark.parametrize("workers", [0, 1])
def test_changed_byte_in_a_mapped_shard_is_a_shard_error(dataset, workers):
    url, seqs, m = dataset
    i, at, shard = victim(m, seqs)
    change(url / shard, at)
    with pytest.raises(sw.ShardError) as e:
        windows(make(url, workers))
    assert_names(e.value, url, shard, f"{m.key(i)}.npy", at)


def test_changed_byte_over_http_is_a_shard_error(dataset, http_server):
    url, seqs, m = dataset
    i, at, shard = victim(m, seqs)
    change(url / shard, at)
    srv = http_server(url.parent)
    with pytest.raises(sw.ShardError) as e:
        windows(make(srv.url_for("ds")))
    assert_names(e.value, srv.url_for("ds"), shard, f"{m.key(i)}.npy", at)


def test_changed_compressed_byte_is_a_checksum_mismatch(tmp_path):
    seqs = make_sequences(seed=8, max_len=600)
    url = tmp_path / "z"
    m = sw.pack(list(seqs.items()), str(url), shard_bytes=60_000, compression="zstd", progress=False)
    i = int(np.argmax(m.size))
    at = int(m.offset[i] + m.size[i] // 2)
    shard = m.shards[m.shard_of(i)].name
    change(url / shard, at)
    with pytest.raises(sw.ShardError) as e:
        windows(make(url))
    assert_names(e.value, url, shard, f"{m.key(i)}.npy.zst", at)


def test_skip_loses_exactly_the_windows_in_the_damaged_chunk(dataset):
    url, seqs, m = dataset
    i, at, shard = victim(m, seqs)
    ref = windows(make(url, on_error="skip"))
    change(url / shard, at)
    loader = make(url, on_error="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = windows(loader)
    # the reference: windows of sequence i with a byte in the chunk holding ``at`` (one sequence's steps there)
    c0 = at // checks.CHUNK * checks.CHUNK
    data0, sb = int(m.offset[i] + m.hlen[i]), m.step_bytes
    lost_ref = {(k, s) for k, s, _, _ in ref if k == m.key(i) and data0 + s * sb < c0 + checks.CHUNK
                and data0 + (s + W + H) * sb > c0}
    assert lost_ref
    assert [(k, s) for k, s, _, _ in got] == [(k, s) for k, s, _, _ in ref]  # same windows, same order
    lost = {(k, s) for k, s, x, w in got if w == 0.0}
    assert lost == lost_ref
    for k, s, x, w in got:
        if w == 0.0:
            assert not x.any()
        else:
            assert np.array_equal(x, seqs[k][s : s + W]), (k, s)
    stats = loader.stats()
    assert stats["skipped_ranges"] >= 1 and stats["skipped_windows"] == len(lost_ref)  # a range per read that met it
    assert stats["bytes_verified"] >= stats["bytes_read"] > 0
    skips = [w for w in caught if "skipping unreadable data" in str(w.message)]
    assert len(skips) == 1 and "checksum mismatch" in str(skips[0].message)


def test_a_manifest_without_checksums_still_loads_and_says_so_once(dataset):
    url, seqs, m = dataset
    path = url / "index.json"
    doc = json.loads(path.read_text())
    del doc["checks"], doc["content_sha256"]  # as packed by streamwin before chunk checksums (and seals)
    path.write_text(json.dumps(doc))
    loader = make(url)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            got = windows(loader)
    said = [w for w in caught if "without chunk checksums" in str(w.message)]
    assert len(said) == 1 and str(url) in str(said[0].message)
    assert all(np.array_equal(x, seqs[k][s : s + W]) for k, s, x, _ in got)
    assert loader.stats()["bytes_verified"] == 0


def test_a_long_member_read_in_small_pieces_reads_each_byte_about_once_over_http(tmp_path, http_server):
    """Verification reads whole chunks; neighbouring pieces share the chunk between them (a reading thread
    keeps the edge chunks it verified), so an epoch of stride-1 windows still reads each byte about once."""
    rng = np.random.default_rng(3)
    long = rng.standard_normal((60_000, 4)).astype(np.float32)  # 16-byte steps: a piece of 256 windows is 4 KB
    url = tmp_path / "long"
    m = sw.pack([("long", long)] + [(f"s{j}", long[:50] + j) for j in range(20)], str(url), progress=False)
    srv = http_server(tmp_path)
    loader = sw.WindowLoader(sw.WindowDataset(srv.url_for("long"), window=16, stride=1, batch_size=32,
                                              shuffle_buffer=2048, seed=5), num_workers=0)
    n = 0
    for b in loader:
        for k, s, x in zip(b["key"], b["start"].tolist(), b["x"].numpy()):
            if k == "long":
                assert np.array_equal(x, long[s : s + 16])
        n += len(b["key"])
    total = sum(s.bytes for s in m.shards)
    assert n > 50_000
    assert srv.stats.bytes_served / total <= 1.25, (srv.stats.bytes_served, total)
    assert loader.stats()["bytes_verified"] >= 0.95 * total


def test_index_writes_the_checksums_pack_wrote(dataset):
    url, seqs, m = dataset
    os.remove(url / "index.json")
    for s in m.shards:
        os.remove(url / f"{s.name}.sums")
    again = sw.index_shards(str(url), progress=False) if hasattr(sw, "index_shards") else None
    if again is None:
        from streamwin.packing.scan import index_shards

        again = index_shards(str(url), progress=False)
    # the same sums files (index writes them anew), named by the same digests
    assert again.checks.chunk == m.checks.chunk and np.array_equal(again.checks.digests, m.checks.digests)
    assert np.array_equal(again.checks.sha256, m.checks.sha256)
    assert np.array_equal(sw.load_manifest(str(url)).checks.digests, m.checks.digests)


def test_nan_in_the_manifest_warns_once_when_iteration_starts(tmp_path):
    seqs = make_sequences(12, seed=2)
    key = next(iter(seqs))
    seqs[key][3, 0], seqs[key][5, 1] = np.nan, np.inf
    url = tmp_path / "nan"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sw.pack(list(seqs.items()), str(url), progress=False)
    loader = make(url)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = make(url)
        assert not [w for w in caught if "NaN" in str(w.message)]  # not when the loader is made
        for _ in range(2):
            windows(loader)
    said = [w for w in caught if "NaN" in str(w.message)]
    assert len(said) == 1
    text = str(said[0].message)
    assert "1 NaN and 1 inf" in text and "nan='raise'" in text and "missing='mask'" in text and str(url) in text
    clean = tmp_path / "clean"
    sw.pack(list(make_sequences(12, seed=2).items()), str(clean), progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        windows(make(clean))
    assert not [w for w in caught if "NaN" in str(w.message)]
