"""Damage on the read side (issue 28, items 6 and 10): a damaged node-cache copy is repaired; zstd loses a frame.

* A byte flipped in a shard's copy in the node cache: the copy is dropped and fetched again,
  once, with a warning naming the cache file, and the epoch is exact (with on_error "raise"
  and "skip" alike: nothing skipped). Damaged at the remote too, the fresh copy fails its
  fetch and the error names the remote shard.
* zstd, on_error="skip": one flipped byte in a framed member loses only the windows with a
  step in the frame(s) its checksum chunk covers; every other window of the member is exact.

Shards are served by the loopback HTTP server; expected windows are cut from the original
arrays in the test.
"""
from __future__ import annotations

import os
import shutil
import warnings
from functools import partial

import numpy as np
import pytest

import streamwin as sw
from conftest import flip_byte, make_sequences
from servers import FaultPlan
from streamwin.storage.cache import ShardCache

W, S, B = 16, 8, 8

pytestmark = pytest.mark.timeout(180)


def loader(url, **read):
    """A loader of ``url`` reading with ``sw.Read(**read)``."""
    return sw.WindowLoader(sw.WindowDataset(str(url), window=W, stride=S, batch_size=B, shuffle_buffer=300, seed=4,
                                            read=sw.Read(**read)))


def epoch(ld):
    """(key, start, window values, weight) of every window of an epoch."""
    out = []
    for b in ld:
        w = b["weight"].tolist() if "weight" in b else [1.0] * len(b["key"])
        out += [(k, s, x.tobytes(), wt) for k, s, x, wt in zip(b["key"], b["start"].tolist(), b["x"].numpy(), w)]
    return out


def check_exact(windows, seqs) -> int:
    """Every window of weight 1 equals the slice of its original sequence; returns how many there are."""
    n = 0
    for k, s, xb, w in windows:
        if w:
            assert xb == np.ascontiguousarray(seqs[k][s : s + W]).tobytes(), (k, s)
            n += 1
    return n


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    seqs = make_sequences(seed=11)
    root = tmp_path_factory.mktemp("repair")
    sw.pack(list(seqs.items()), str(root / "ds"), shard_bytes=40_000, progress=False)
    return root, seqs, sw.load_manifest(str(root / "ds"))


flip = partial(flip_byte, mask=0x10)


def data_byte(m, k: int) -> int:
    """A byte of array data of the first member of shard k with steps (what a window reads)."""
    i = next(i for i in range(int(m.shard_starts[k]), int(m.shard_starts[k + 1])) if m.length[i] >= 3 * W)
    return int(m.offset[i] + m.hlen[i]) + 24


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_damaged_cached_copy_is_fetched_again_once(served, http_server, tmp_path, on_error):
    root, seqs, m = served
    srv = http_server(root, FaultPlan(path_contains="shard-"))  # counts the shards' GETs only
    url, cache_dir = srv.url_for("ds"), str(tmp_path / "cache")
    first = epoch(loader(url, cache_dir=cache_dir, on_error=on_error))
    local = ShardCache(cache_dir).local_path(f"{url}/{m.shards[1].name}", m.shards[1])
    flip(local, data_byte(m, 1))
    gets = srv.stats.get_requests
    with pytest.warns(RuntimeWarning, match=f"copy {local} of {url}/{m.shards[1].name} is damaged"):
        again = epoch(loader(url, cache_dir=cache_dir, on_error=on_error))  # before: ShardError (naming the remote)
    assert again == first and check_exact(again, seqs) == len(again)
    assert srv.stats.get_requests > gets  # fetched anew
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # repaired for good: the next run says nothing and fetches nothing
        gets = srv.stats.get_requests
        assert epoch(loader(url, cache_dir=cache_dir, on_error=on_error)) == first
        assert srv.stats.get_requests == gets


def test_damaged_in_the_cache_and_at_the_remote_names_the_remote(served, http_server, tmp_path):
    root, _, m = served
    remote = tmp_path / "srv"
    shutil.copytree(root / "ds", remote / "ds")
    srv = http_server(str(remote))
    url, cache_dir = srv.url_for("ds"), str(tmp_path / "cache")
    epoch(loader(url, cache_dir=cache_dir))
    name = m.shards[1].name
    flip(ShardCache(cache_dir).local_path(f"{url}/{name}", m.shards[1]), data_byte(m, 1))
    flip(remote / "ds" / name, data_byte(m, 1))
    with pytest.warns(RuntimeWarning, match="is damaged"), pytest.raises(sw.ShardError) as e:
        epoch(loader(url, cache_dir=cache_dir))
    assert e.value.shard == f"{url}/{name}" and "sha256" in str(e.value)


# -- zstd: a damaged frame costs its own windows (item 10) ------------------------------------------

def test_zstd_skip_loses_only_the_damaged_frames_windows(tmp_path):
    rng = np.random.default_rng(5)
    seqs = {f"s{i}": rng.standard_normal((int(n), 4)).astype(np.float32) for i, n in enumerate([160_000, 3000, 900])}
    url = str(tmp_path / "z")
    sw.pack(list(seqs.items()), url, compression="zstd", progress=False)
    m = sw.load_manifest(url)
    fr = m.frames
    assert fr is not None and 0 in fr.seq.tolist(), "the long member is packed as frames"
    ends = fr.ends[fr.first[0] : fr.first[1]]  # member 0's frames: where each ends, from the member's first byte
    j = len(ends) // 2  # a frame in the middle of the member
    at = int(m.offset[0]) + (int(ends[j - 1]) + int(ends[j])) // 2
    chunk = m.checks.chunk
    hit = [f for f in range(len(ends)) if (int(ends[f - 1]) if f else 0) < (at // chunk + 1) * chunk - int(m.offset[0])
           and int(ends[f]) > at // chunk * chunk - int(m.offset[0])]  # the frames its checksum chunk touches
    flip(os.path.join(url, m.shards[0].name), at)

    win = 64
    ld = sw.WindowLoader(sw.WindowDataset(url, window=win, stride=win, batch_size=16, seed=1,
                                          read=sw.Read(on_error="skip")))
    with pytest.warns(RuntimeWarning, match="checksum"):
        got = [(k, s, x, w) for b in ld for k, s, x, w in zip(b["key"], b["start"].tolist(), b["x"].numpy().copy(),
                                                               b["weight"].tolist())]
    rows = fr.rows
    lo, hi = min(hit) * rows, (max(hit) + 1) * rows  # the steps of the damaged frames
    lost = {(k, s) for k, s, _, w in got if not w}
    want = {("s0", s) for s in range(0, len(seqs["s0"]) - win + 1, win) if s < hi and s + win > lo}
    assert len(ends) >= 8 and len(hit) <= 2
    assert lost == want and len(want) <= 2 * rows // win + 1  # before: all 2,500 of s0's windows
    for k, s, x, w in got:
        if w:
            assert np.array_equal(x, seqs[k][s : s + win]), (k, s)
    assert ld.stats()["skipped_windows"] == len(want)
