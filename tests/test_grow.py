"""Datasets that grow (issue 44): the dataset packed then appended to and extended reads as the one packed at once.

The reference is independent of streamwin: the corpus (tests/grow_cases.py) is computed here,
every window's steps are compared with its slices, and the windows of an epoch of the grown
dataset must be those of the dataset packed at once (the same sequences in the same order),
under every order option, for 1 and 2 ranks (ranks stepped in lockstep in one process).
"""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

import grow_cases as gc
import streamwin as sw
from conftest import opened

W, S = 16, 8
PAD = sw.Order(equalize="pad")  # every window of an epoch at least once: the epochs compare whole
CASES = {
    "shuffled": dict(),
    "unshuffled": dict(order=sw.Order(shuffle=False, equalize="pad")),
    "canonical_none": dict(order=sw.Order(canonical=None, equalize="pad")),
    "jitter": dict(crops=sw.Crops(jitter=True)),
    "windows_per_sequence": dict(crops=sw.Crops(windows_per_sequence=2)),
    "packed_rows": dict(crops=sw.Crops(pack_length=48, min_window=8, window_multiple=4),
                        order=sw.Order(equalize="drop")),
    "split": dict(select=sw.Select(split="train")),
    "holdout": dict(select=sw.Select(split="val", holdout=40)),
    "horizon": dict(horizon=4, stride=5),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("grow")
    full = gc.corpus()
    return full, gc.grown(str(root / "grown"), full), gc.once(str(root / "once"), full)


def epoch(url: str, world: int, full: dict, **kw) -> list[tuple[str, int, int]]:
    """The real windows of one epoch of every rank, the ranks stepped together, each checked against ``full``."""
    kw = {"window": W, "stride": S, "batch_size": 8 // world, "shuffle_buffer": 48, "seed": 3, "order": PAD, **kw}
    loaders = [opened(sw.WindowLoader(sw.WindowDataset(url, rank=r, world_size=world, **kw))) for r in range(world)]
    out = []
    for step in zip(*loaders, strict=True):
        out += gc.windows(step, full, W, kw.get("horizon", 0))
    return out


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_the_grown_dataset_reads_as_the_one_packed_at_once(data, case, world):
    full, grown, once = data
    kw = CASES[case]
    got, want = epoch(grown, world, full, **kw), epoch(once, world, full, **kw)
    assert len(got) == len(set(got)), "a window twice in an epoch"
    if "crops" in kw and kw["crops"].pack_length:  # packed rows: which crops fill the rows follows the order
        crops = dataclasses.replace(kw["crops"], pack_length=None)  # each whole, once; the epoch's crops, all:
        every = epoch(once, 1, full, crops=crops, order=PAD)
        assert set(got) <= set(every) and set(want) <= set(every)
        assert len(got) > 0.8 * len(every)
        return
    assert sorted(got) == sorted(want)
    ends = {k: len(a) for k, a, _ in gc.stages(full)[0]}  # where the first pack ended each sequence
    assert sum(k in ends and s < ends[k] < s + n for k, s, n in got) >= 5, "windows across a first pack's end"


def test_a_byte_changed_in_a_continuation_member_is_named(data, tmp_path):
    import shutil
    full, grown, _ = data
    url = str(tmp_path / "copy")
    shutil.copytree(grown, url)
    m = sw.load_manifest(url)
    members = m.members()
    row = m.num_sequences  # the first continuation member
    shard = members.shards[int(members.shard_of(row))].name
    at = int(members.offset[row]) + int(members.hlen[row]) + 3
    with open(f"{url}/{shard}", "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(sw.ShardError) as e:
        ds = sw.WindowDataset(url, window=W, stride=S, batch_size=8, order=sw.Order(shuffle=False))
        for _ in sw.WindowLoader(ds):
            pass
    import re
    assert shard in str(e.value) and re.search(r"member s\d+\.g\d{6}\.npy, byte offset \d+", str(e.value)), str(e.value)
    with pytest.raises(sw.ShardError, match="checksum mismatch"):
        sw.verify(url, progress=False)


def test_an_append_writes_the_new_bytes_and_a_manifest(tmp_path):
    """Nothing already there is rewritten: every file of the first pack is kept, byte for byte."""
    full = gc.corpus()
    url = str(tmp_path / "ds")
    first, second, _ = gc.stages(full)
    sw.pack([(k, a, m) for k, a, m in first], url, shard_bytes=6000, progress=False)
    import os
    before = {n: open(f"{url}/{n}", "rb").read() for n in os.listdir(url) if n.startswith("shard-")}
    m = sw.pack([(k, a) if m is None else (k, a, m) for k, a, m in second], url, shard_bytes=6000, progress=False,
                mode="extend")
    after = {n: open(f"{url}/{n}", "rb").read() for n in os.listdir(url) if n.startswith("shard-")}
    assert all(after[n] == b for n, b in before.items())
    new = set(after) - set(before)
    import io
    import tarfile
    found = {}  # the new shards hold exactly the new steps: a member each
    for name in sorted(n for n in new if n.endswith(".tar")):
        with tarfile.open(fileobj=io.BytesIO(after[name])) as tf:
            for info in tf:
                if info.name.endswith(".npy"):
                    found[info.name] = np.load(io.BytesIO(tf.extractfile(info).read()), allow_pickle=False)
    want = {(k + ".npy" if m is not None and "site" in m else f"{k}.g000002.npy"): a for k, a, m in second}
    assert sorted(found) == sorted(want) and all(np.array_equal(found[k], want[k]) for k in want)
    assert [s.name for s in m.shards[: len(m.shards) - len([n for n in new if n.endswith('.tar')])]] == \
        sorted(n for n in before if n.endswith(".tar"))


def test_keys_already_there_are_an_error_naming_them(tmp_path):
    url = str(tmp_path / "ds")
    sw.pack([("a", np.ones((5, 2), np.float32)), ("b", np.ones((5, 2), np.float32))], url, progress=False)
    index = open(f"{url}/index.json", "rb").read()
    with pytest.raises(sw.PackError, match=r"holds sequences keyed 'b' already.*mode='extend'"):
        sw.pack([("c", np.ones((3, 2), np.float32)), ("b", np.ones((3, 2), np.float32))], url, progress=False,
                mode="append")
    assert open(f"{url}/index.json", "rb").read() == index  # the dataset as it was
    with pytest.raises(sw.PackError, match=r"dtype float32.*new sequences have dtype float64"):
        sw.pack([("c", np.ones((3, 2)))], url, progress=False, mode="append")
    with pytest.raises(sw.PackError, match="mode must be None, 'append' or 'extend'"):
        sw.pack([("c", np.ones((3, 2)))], url, progress=False, mode="add")
    assert open(f"{url}/index.json", "rb").read() == index


def test_an_extension_whose_times_do_not_continue_is_named(tmp_path):
    url = str(tmp_path / "ds")
    t0, f = gc.T0, gc.FREQ
    sw.pack([("a", np.ones((10, 2), np.float32), {"start": t0, "freq": f})], url, progress=False)
    index = open(f"{url}/index.json", "rb").read()
    for start, what in ((t0 + 11 * f, "a gap"), (t0 + 9 * f, "an overlap")):
        with pytest.raises(sw.PackError, match=rf"'a' is extended with {what}: its new steps start at "
                           rf"{start}.*end with the step before {t0 + 10 * f}"):
            sw.pack([("a", np.ones((3, 2), np.float32), {"start": start, "freq": f})], url, progress=False,
                    mode="extend")
    with pytest.raises(sw.PackError, match="extended with freq"):
        sw.pack([("a", np.ones((3, 2), np.float32), {"start": t0 + 10 * f, "freq": 2 * f})], url, progress=False,
                mode="extend")
    assert open(f"{url}/index.json", "rb").read() == index
    m = sw.pack([("a", np.ones((3, 2), np.float32), {"start": t0 + 12 * f, "freq": f})], url, progress=False,
                mode="extend", gaps="allow")
    assert m.length.tolist() == [13] and m.segments.count == 1


def test_fields_join_and_vocabularies_keep_their_codes(data):
    full, grown, once = data
    m = sw.load_manifest(grown)
    assert m.fields.vocabulary["site"][:3] == tuple(sorted(gc.SITES))  # the first pack's codes, unchanged
    assert set(m.fields.vocabulary["site"][3:]) == {"aomori", "zama"}
    ds = sw.WindowDataset(grown, window=W, stride=S, batch_size=8,
                          select=sw.Select(fields=["site", "label", "time"]))
    assert ds.vocabulary("site") == m.fields.vocabulary["site"]
    for b in sw.WindowLoader(ds):
        for key, start, site, label, time in zip(b["key"], b["start"].tolist(), b["site"].tolist(),
                                                 b["label"].tolist(), b["time"].tolist()):
            want = gc.meta(int(key[1:]), key, start)
            assert ds.vocabulary("site")[site] == want["site"] and label == want["label"]
            assert time == int(want["start"].astype(np.int64))


def test_a_field_the_new_sequences_lack_is_left_out_by_the_rule_for_missing_values(tmp_path):
    url = str(tmp_path / "ds")
    sw.pack([("a", np.ones((5, 2), np.float32), {"label": 1, "site": "x"})], url, progress=False)
    with pytest.warns(sw.packing.pack.MissingValuesWarning, match=r"'label' in 1 of 2 \(the first 'b'\)"):
        m = sw.pack([("b", np.ones((5, 2), np.float32), {"site": "y"})], url, progress=False, mode="append")
    assert m.fields.kinds == {"site": "str"} and m.fields.vocabulary["site"] == ("x", "y")
    assert m.fields.left_out["label"] == "missing in sequence 'b'"


def test_webdataset_readers_see_continuations_as_members_of_their_key(data):
    """A reader that groups tar members by key as webdataset does (up to the first dot of the name) finds each
    continuation under its sequence's key, extension gGGGGGG.npy: never a sequence of its own."""
    import re
    import tarfile
    full, grown, _ = data
    m = sw.load_manifest(grown)
    exts: dict[str, set] = {}
    for s in m.shards:
        with tarfile.open(f"{grown}/{s.name}") as tf:
            for info in tf:
                key, ext = info.name.split(".", 1)
                exts.setdefault(key, set()).add(ext)
    assert set(exts) == set(full)
    for key, found in exts.items():
        assert "npy" in found  # its first member
        assert all(e in ("npy", "json") or re.fullmatch(r"g\d{6}\.npy", e) for e in found), found


def test_verify_and_index_understand_continuations(data, tmp_path):
    import os
    import shutil
    full, grown, _ = data
    url = str(tmp_path / "copy")
    shutil.copytree(grown, url)
    before = sw.load_manifest(url)
    assert sw.verify(url, progress=False)["sequences"] == len(full)
    for name in os.listdir(url):
        if name.startswith("index"):
            os.remove(f"{url}/{name}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = sw.index_shards(url, progress=False)
    assert m.keys(np.arange(m.num_sequences)) == before.keys(np.arange(before.num_sequences))
    assert m.length.tolist() == [len(full[k]) for k in m.keys(np.arange(m.num_sequences))]
    assert m.segments.count == before.segments.count
    assert sorted(epoch(url, 1, full)) == sorted(epoch(grown, 1, full))


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_compact_merges_continuations_and_reads_the_same_batches(tmp_path, compression):
    if compression:
        pytest.importorskip("zstandard")
    full = gc.corpus(seed=8)
    url = gc.grown(str(tmp_path / "ds"), full, compression=compression)
    kw = dict(window=W, stride=S, batch_size=8, seed=2, shuffle_buffer=48, select=sw.Select(fields=["site"]))

    def batches():
        return [(list(b["key"]), b["start"].tolist(), b["x"].numpy().copy(), b["site"].tolist())
                for b in sw.WindowLoader(sw.WindowDataset(url, **kw))]
    before, old = batches(), sw.load_manifest(url)
    loader = sw.WindowLoader(sw.WindowDataset(url, **kw))
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    rest = [b["x"].numpy().copy() for b in it]
    m = sw.compact(url, progress=False)
    assert m.segments is None and sw.load_manifest(url).segments is None
    assert len(m.shards) < len(old.shards)  # the shards of continuations only are gone
    after = batches()
    assert len(before) == len(after)
    for a, b in zip(before, after):
        assert a[0] == b[0] and a[1] == b[1] and np.array_equal(a[2], b[2]) and a[3] == b[3]
    again = sw.WindowLoader(sw.WindowDataset(url, **kw))
    again.load_state_dict(state)  # a state saved before the compaction resumes after it, exactly
    assert all(np.array_equal(a, b["x"].numpy()) for a, b in zip(rest, again, strict=True))
    assert sw.verify(url, progress=False)["sequences"] == len(full)
    assert sw.compact(url, progress=False).digest == sw.load_manifest(url).digest  # nothing left to compact


def test_a_damaged_continuation_costs_only_the_windows_with_a_step_there(data, tmp_path):
    """on_error="skip": the windows whose steps lie in the damaged chunk of a continuation member weigh 0, every
    other window of the epoch comes out whole."""
    import shutil
    full, grown, _ = data
    url = str(tmp_path / "copy")
    shutil.copytree(grown, url)
    m = sw.load_manifest(url)
    members = m.members()
    row = m.num_sequences + 3
    seq = int(m.segments.seq[3])
    key = m.key(seq)
    shard = members.shards[int(members.shard_of(row))].name
    at = int(members.offset[row]) + int(members.hlen[row]) + 8
    with open(f"{url}/{shard}", "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))
    kw = dict(order=sw.Order(shuffle=False, equalize="pad"), read=sw.Read(on_error="skip"))
    with pytest.warns(RuntimeWarning, match="skipping unreadable data"):
        got = [w for b in sw.WindowLoader(sw.WindowDataset(url, window=W, stride=S, batch_size=8, **kw))
               for w in gc.windows([b], full, W)]
    want = epoch(grown, 1, full, **kw)
    lost = set(want) - set(got)
    assert lost and len(got) == len(set(got)) and set(got) <= set(want)
    # independently: the steps whose bytes lie in the damaged 4 KiB chunk, in any member of that shard
    chunk = (at // 4096 * 4096, at // 4096 * 4096 + 4096)
    sb = full[key].itemsize * full[key].shape[1]
    first = {}  # each member row's first step in its sequence
    for i in range(m.num_sequences):
        first[i], step = 0, int(members.length[i])
        for j in np.flatnonzero(np.asarray(m.segments.seq) == i).tolist():
            first[m.num_sequences + j] = step
            step += int(members.length[m.num_sequences + j])
    hit = []
    for r in range(members.num_members):
        if members.shards[int(members.shard_of(r))].name != shard:
            continue
        lo, hi = int(members.offset[r]) + int(members.hlen[r]), int(members.offset[r]) + int(members.size[r])
        a, b = max(lo, chunk[0]), min(hi, chunk[1])
        if a < b:
            seq_of = r if r < m.num_sequences else int(m.segments.seq[r - m.num_sequences])
            hit.append((m.key(seq_of), first[r] + (a - lo) // sb, first[r] + -(-(b - lo) // sb)))
    expected = {(k, s, n) for k, s, n in want for hk, a, b in hit if k == hk and s < b and s + n > a}
    assert lost == expected and key in {k for k, _, _ in lost}


def test_a_grown_dataset_on_s3_reads_whole_with_and_without_the_node_cache(data, s3_server, tmp_path):
    full, _, once = data
    url = f"{s3_server.make_bucket()}/grown"
    so = s3_server.storage_options()
    for k, items in enumerate(gc.stages(full)):
        sw.pack([(key, a) if m is None else (key, a, m) for key, a, m in items], url, shard_bytes=6000,
                progress=False, mode=None if k == 0 else "extend", storage_options=so)
    want = sorted(epoch(once, 1, full))
    assert sorted(epoch(url, 1, full, read=sw.Read(storage_options=so))) == want
    assert sorted(epoch(url, 1, full, read=sw.Read(storage_options=so, cache_dir=str(tmp_path / "cache")))) == want
