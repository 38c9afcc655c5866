"""A manifest never sends a read to the wrong bytes: each member's tar header is checked as it is read.

The attack: index.json edited (two sequences' rows, or two keys, swapped) and sealed anew, its
seal being a sha256 anyone can redo. The checksums verify the bytes at each offset, which are
still the packed ones, so only the tar header (the member's name and size, read with the
member or for that alone) tells the reader that the manifest is lying. Every such dataset
must fail with a ShardError before a single wrong window is yielded, locally and over HTTP;
the reference is the dataset as packed, read back with numpy.
"""
from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest

import streamwin as sw
from streamwin.formats.manifest import INDEX_NAME, parse_manifest

W, S = 16, 8


def sequences(seed: int = 0) -> dict[str, np.ndarray]:
    """40 sequences, many of equal length (so that a swap keeps every npy header right), values naming the step."""
    rng = np.random.default_rng(seed)
    lengths = rng.choice([60, 60, 60, 200, 200, 900], size=40)
    return {f"k{i:02d}" + "x" * (i % 3): (np.arange(int(t), dtype=np.float32)[:, None] * 100 + i).repeat(2, axis=1)
            for i, t in enumerate(lengths)}


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    seqs = sequences()
    url = tmp_path_factory.mktemp("members") / "ds"
    sw.pack(list(seqs.items()), str(url), shard_bytes=60_000, progress=False)
    return url, seqs


def swap_rows(m, i: int, j: int):
    """The manifest with sequences i and j's rows (where and how long each is) exchanged, keys kept."""
    cols = {}
    for name in ("length", "offset", "size", "hlen"):
        col = getattr(m, name).copy()
        col[[i, j]] = col[[j, i]]
        cols[name] = col
    return dataclasses.replace(m, **cols)


def swap_keys(m, i: int, j: int):
    """The manifest with sequences i and j's keys exchanged, rows kept."""
    keys = [m.key(k) for k in range(m.num_sequences)]
    keys[i], keys[j] = keys[j], keys[i]
    blob = "".join(keys).encode("ascii")
    ends = np.cumsum([len(k) for k in keys]).astype(m.key_ends.dtype)
    return dataclasses.replace(m, key_blob=blob, key_ends=ends)


def attacked(url, tmp, edit) -> str:
    """A copy of the dataset at ``url`` whose index.json is ``edit(manifest)``, sealed anew."""
    out = tmp / "attacked"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(url, out)
    m = parse_manifest((out / INDEX_NAME).read_text())
    (out / INDEX_NAME).write_text(edit(m).to_json())
    assert sw.load_manifest(str(out)).sealed  # the seal was made anew: it holds
    return str(out)


def read_until_error(url: str, seqs: dict[str, np.ndarray], **kw) -> tuple[int, Exception | None]:
    """(windows yielded, the error that ended the epoch); every window yielded is checked against ``seqs``."""
    ds = sw.WindowDataset(url, window=W, stride=S, batch_size=8, shuffle_buffer=64, seed=2, **kw)
    n = 0
    try:
        for b in sw.WindowLoader(ds):
            for k, s, x in zip(b["key"], b["start"].tolist(), b["x"].numpy()):
                assert np.array_equal(x, seqs[k][s : s + W]), f"window ({k}, {s}) is another member's bytes"
                n += 1
    except sw.ShardError as e:
        return n, e
    return n, None


def pairs(m, rng, count: int, same_length: bool) -> list[tuple[int, int]]:
    """``count`` pairs of distinct sequences (of equal length, when asked), drawn with ``rng``."""
    out = []
    while len(out) < count:
        i, j = (int(v) for v in rng.choice(m.num_sequences, size=2, replace=False))
        if not same_length or m.length[i] == m.length[j]:
            out.append((i, j))
    return out


@pytest.mark.parametrize("edit", ["rows", "keys"])
def test_twenty_edited_manifests_fail_before_a_wrong_window(packed, tmp_path, edit):
    """20 datasets each with one pair swapped (rows of equal length: every npy header still agrees; or keys):
    each read fails with a ShardError naming one of the pair, and no window it yielded was wrong."""
    url, seqs = packed
    m = sw.load_manifest(str(url))
    rng = np.random.default_rng(7 if edit == "rows" else 8)
    swap = swap_rows if edit == "rows" else swap_keys
    for i, j in pairs(m, rng, 20, same_length=edit == "rows"):
        bad = attacked(url, tmp_path, lambda doc, i=i, j=j: swap(doc, i, j))
        _, err = read_until_error(bad, seqs)
        assert err is not None, f"swapping {edit} of {m.key(i)} and {m.key(j)} went unnoticed"
        assert err.member in (f"{m.key(i)}.npy", f"{m.key(j)}.npy") and "tar header" in str(err), str(err)


def test_an_edited_manifest_fails_over_http_too(packed, tmp_path, http_server):
    url, seqs = packed
    m = sw.load_manifest(str(url))
    i, j = pairs(m, np.random.default_rng(3), 1, same_length=True)[0]
    bad = attacked(url, tmp_path, lambda doc: swap_rows(doc, i, j))
    srv = http_server(tmp_path)
    _, err = read_until_error(srv.url_for("attacked"), seqs)
    assert err is not None and err.shard.startswith(srv.url) and "tar header" in str(err)


def test_a_member_read_only_from_its_middle_is_checked_too(tmp_path):
    """Windows of a long member that start far from its headers still check them (a read of the headers alone):
    one block here reads only the member's second half."""
    long = (np.arange(4000, dtype=np.float32)[:, None] * 10).repeat(2, axis=1)
    seqs = {"a": long, "b": long + 1}  # equal lengths: swapped rows keep the npy headers right
    url = tmp_path / "ds"
    sw.pack(list(seqs.items()), str(url), progress=False)
    bad = attacked(url, tmp_path, lambda doc: swap_rows(doc, 0, 1))
    last = sw.Select(split="val", holdout=500)  # windows of the last 1,000 steps only
    _, err = read_until_error(bad, seqs, select=last)
    assert err is not None and "tar header" in str(err)
    n, err = read_until_error(str(url), seqs, select=last)  # the dataset as packed reads whole
    assert err is None and n > 0


def test_skip_loses_the_members_whose_headers_disagree_and_nothing_else(packed, tmp_path):
    url, seqs = packed
    m = sw.load_manifest(str(url))
    i, j = pairs(m, np.random.default_rng(5), 1, same_length=True)[0]
    bad = attacked(url, tmp_path, lambda doc: swap_rows(doc, i, j))
    ds = sw.WindowDataset(bad, window=W, stride=S, batch_size=8, shuffle_buffer=64, seed=2,
                          read=sw.Read(on_error="skip"))
    lost, kept = set(), 0
    with pytest.warns(RuntimeWarning, match="tar header"):
        for b in sw.WindowLoader(ds):
            for k, s, x, w in zip(b["key"], b["start"].tolist(), b["x"].numpy(), b["weight"].tolist()):
                if w:
                    assert np.array_equal(x, seqs[k][s : s + W])
                    kept += 1
                else:
                    lost.add(k)
    assert lost == {m.key(i), m.key(j)} and kept > 0


def test_zstd_members_are_checked_too(tmp_path):
    seqs = sequences(1)
    url = tmp_path / "z"
    sw.pack(list(seqs.items()), str(url), compression="zstd", shard_bytes=60_000, progress=False)
    m = sw.load_manifest(str(url))
    i, j = pairs(m, np.random.default_rng(4), 1, same_length=True)[0]
    bad = attacked(url, tmp_path, lambda doc: swap_rows(doc, i, j))
    _, err = read_until_error(bad, seqs)
    assert err is not None and "tar header" in str(err)
    n, err = read_until_error(str(url), seqs)
    assert err is None and n > 0
