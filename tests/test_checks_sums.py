"""Chunk checksums at corpus scale: in sums files beside the shards, read as blocks need them, verified.

What holds (each against a reference computed here with xxhash over the bytes, not by the code
under test): a block sum verifies what its chunks verify, damage is found to the chunk; a
reader holds the sums of the shards it reads and no others, within its bound; a sums file
that is damaged, missing or another shard's is an error naming it, through local files, HTTP
and S3 (with on_error="skip": the windows read from that shard are lost, counted, the rest
exact); manifests written before sums files (chunk sums inline or in the columns file) load
and verify as before.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import zlib

import numpy as np
import pytest
import xxhash

import streamwin as sw
from conftest import make_sequences
from streamwin.formats import checks, sums
from streamwin.read import ReadOptions, ShardReader

pytestmark = pytest.mark.timeout(180)
W, S, B = 16, 8, 8


def ref_sums(data: bytes, size: int) -> np.ndarray:
    """The low 32 bits of xxh3_64 of each ``size``-byte piece: the reference, one xxhash call per piece."""
    return np.array([xxhash.xxh3_64_intdigest(data[a : a + size]) & 0xFFFFFFFF for a in range(0, len(data), size)],
                    dtype=np.uint32)


# -- the format, against references ---------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 4095, 4096, sums.BLOCK, 3 * sums.BLOCK + 5000, 17 * sums.BLOCK + 1])
def test_a_sums_file_holds_every_chunk_and_block_sum(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    writer = sums.ShardSumsWriter()
    for a in range(0, n, 7919):  # pieces of any size, as a shard is written
        writer.update(data[a : a + 7919])
    file, (digest, sha) = writer.file()
    layout = sums.Layout(n)
    assert len(file) == layout.file_bytes and digest == f"{xxhash.xxh3_64_intdigest(file[: layout.table_bytes]):016x}"
    assert sha == hashlib.sha256(file).hexdigest()
    c = checks.Checks.of_shards([(digest, sha)], [n])
    coarse, fine = c.parse_file(0, file)
    assert np.array_equal(fine, ref_sums(data, sums.CHUNK)) and np.array_equal(coarse, ref_sums(data, sums.BLOCK))
    damaged = bytearray(file)
    damaged[-1] ^= 1
    with pytest.raises(ValueError, match="page"):
        c.parse_file(0, bytes(damaged))
    with pytest.raises(ValueError, match="another shard's"):
        checks.Checks.of_shards([("0" * 16, sha)], [n]).parse_file(0, file)


def test_block_sums_find_damage_to_the_chunk():
    rng = np.random.default_rng(1)
    n = 9 * sums.BLOCK + 12_345
    data = rng.integers(0, 256, n, dtype=np.uint8)
    fine, coarse = ref_sums(data.tobytes(), sums.CHUNK), ref_sums(data.tobytes(), sums.BLOCK)
    with_blocks = sums.SumsSpan(n, sums.CHUNK, 0, fine, sums.BLOCK, 0, coarse)
    chunks_only = sums.SumsSpan(n, sums.CHUNK, 0, fine)
    for _ in range(60):
        lo = int(rng.integers(0, n)) // sums.CHUNK * sums.CHUNK
        hi = min(-(-int(rng.integers(lo + 1, n + 1)) // sums.CHUNK) * sums.CHUNK, n)
        got = data[lo:hi].copy()
        flips = rng.integers(lo, hi, size=int(rng.integers(0, 4)))
        for x in flips:
            got[x - lo] ^= 0x10
        chunks = sorted({int(x) // sums.CHUNK for x in flips})
        want = []
        for j in chunks:  # the reference: each damaged chunk, neighbours merged
            a, b = j * sums.CHUNK, min((j + 1) * sums.CHUNK, n)
            want = want[:-1] + [(want[-1][0], b)] if want and want[-1][1] == a else want + [(a, b)]
        assert with_blocks.bad(lo, got) == want and chunks_only.bad(lo, got) == want


# -- a dataset's sums files, read lazily ----------------------------------------------------------

@pytest.fixture()
def dataset(tmp_path):
    seqs = make_sequences(80, seed=11, max_len=900)
    url = tmp_path / "srv" / "ds"
    m = sw.pack(list(seqs.items()), str(url), shard_bytes=100_000, progress=False)
    assert m.checks.in_files and len(m.shards) >= 4
    return url, seqs, m


class OneShard:
    """A plan whose one block is windows of the sequences of one shard (what ShardReader asks of a plan)."""

    def __init__(self, ds, shard: int):
        self.ds, m = ds, ds.manifest
        self.config = ds.plan(0, 0).sources[0].config
        seqs = np.arange(m.shard_starts[shard], m.shard_starts[shard + 1])
        seqs = seqs[m.length[seqs] >= W]
        self.seq, self.start = seqs, np.zeros(len(seqs), dtype=np.int64)

    def block_parts(self, stream, block):
        g = np.arange(len(self.seq))
        return g, np.ones(len(g), dtype=bool), None

    def locate(self, g):
        return self.seq[g], self.start[g]

    def ends(self, seq):
        return self.ds.manifest.length[seq]


def test_a_reader_holds_the_sums_of_the_shards_it_reads_only(dataset):
    url, seqs, m = dataset
    ds = sw.WindowDataset(str(url), window=W, stride=S, batch_size=B)
    reader = ShardReader(str(url), m, ReadOptions())
    block = reader.read_block(OneShard(ds, 2), 0, 0)
    assert len(block) > 0
    sums_file = (url / (m.shards[2].name + ".sums")).stat().st_size
    assert reader.sums.held() == [2]
    assert 0 < reader.sums.nbytes <= sums_file and 0 < reader.stats.bytes_sums <= sums_file
    block = reader.read_block(OneShard(ds, 3), 0, 0)
    assert reader.sums.held() == [2, 3]
    small = ShardReader(str(url), m, ReadOptions())
    small.sums.limit = 1  # keeps no more than the block being read needs
    for k in range(len(m.shards)):
        small.read_block(OneShard(ds, k), 0, 0)
        assert small.sums.held() == [k]


def assert_names_sums_file(err: sw.ShardError, url: str, shard: str, what: str) -> None:
    assert f"{url}/{shard}.sums" in str(err) and what in str(err), str(err)


def break_sums(path, how: str, other=None) -> None:
    if how == "missing":
        os.remove(path)
    elif how == "damaged":
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 1]))
    elif how == "swapped":
        shutil.copyfile(other, path)
    elif how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 100)


WHY = {"missing": "cannot read the chunk checksums file", "damaged": "is damaged",
       "swapped": "another shard's", "truncated": "cannot read the chunk checksums file"}


@pytest.mark.parametrize("how", ["missing", "damaged", "swapped", "truncated"])
def test_a_broken_sums_file_is_an_error_naming_it(dataset, how):
    url, seqs, m = dataset
    shard = m.shards[1].name
    break_sums(url / f"{shard}.sums", how, url / f"{m.shards[2].name}.sums")
    loader = sw.WindowLoader(sw.WindowDataset(str(url), window=W, stride=S, batch_size=B,
                                              order=sw.Order(shuffle=False)), num_workers=0)
    with pytest.raises(sw.ShardError) as e:
        for _ in loader:
            pass
    assert_names_sums_file(e.value, str(url), shard, WHY[how])
    with pytest.raises(sw.ShardError) as e:  # verify names it too
        sw.verify(str(url), progress=False)
    assert f"{url}/{shard}.sums" in str(e.value)


@pytest.mark.parametrize("how", ["damaged", "missing"])
def test_skip_loses_the_windows_of_the_shard_whose_sums_fail(dataset, how):
    url, seqs, m = dataset
    break_sums(url / f"{m.shards[1].name}.sums", how)
    lost_keys = {m.key(i) for i in range(m.shard_starts[1], m.shard_starts[2])}
    loader = sw.WindowLoader(sw.WindowDataset(str(url), window=W, stride=S, batch_size=B, seed=3,
                                              read=sw.Read(on_error="skip")),
                             num_workers=0)
    seen = lost = 0
    with pytest.warns(RuntimeWarning, match="chunk checksums file"):
        for b in loader:
            for k, s, x, wt in zip(b["key"], b["start"].tolist(), b["x"].numpy(), b["weight"].tolist()):
                if wt == 0:
                    assert k in lost_keys and not x.any()
                    lost += 1
                else:
                    assert k not in lost_keys and np.array_equal(x, seqs[k][s : s + W])
                    seen += 1
    assert lost > 0 and seen > 0 and loader.stats()["skipped_windows"] == lost


def test_broken_sums_files_over_http_and_s3_are_named(dataset, http_server, s3_server, s3_bucket):
    url, seqs, m = dataset
    shard = m.shards[1].name
    s3_url, opts = f"{s3_bucket}/ds", s3_server.storage_options()
    sw.pack(list(seqs.items()), s3_url, shard_bytes=100_000, progress=False, storage_options=opts)
    good = sw.WindowLoader(sw.WindowDataset(s3_url, window=W, stride=S, batch_size=B,
                                            read=sw.Read(storage_options=opts)))
    assert sum(len(b["key"]) for b in good) > 0 and good.stats()["bytes_sums"] > 0  # read through S3, verified
    fs = s3_server.filesystem()
    fs.pipe(f"{s3_url}/{shard}.sums", fs.cat(f"{s3_url}/{m.shards[2].name}.sums"))  # another shard's
    break_sums(url / f"{shard}.sums", "damaged")
    srv = http_server(url.parent)
    for where, options, why in ((srv.url_for("ds"), None, "is damaged"), (s3_url, opts, "another shard's")):
        loader = sw.WindowLoader(sw.WindowDataset(where, window=W, stride=S, batch_size=B,
                                                  read=sw.Read(storage_options=options)))
        with pytest.raises(sw.ShardError) as e:
            for _ in loader:
                pass
        assert_names_sums_file(e.value, where, shard, why)


def test_a_changed_byte_is_found_through_block_sums(dataset):
    url, seqs, m = dataset
    i = int(np.argmax(m.length))
    at = int(m.offset[i] + m.hlen[i]) + int(m.length[i]) // 2 * m.step_bytes
    with open(url / m.shards[m.shard_of(i)].name, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 4]))
    with pytest.raises(sw.ShardError, match="checksum mismatch") as e:
        for _ in sw.WindowLoader(sw.WindowDataset(str(url), window=W, stride=S, batch_size=B)):
            pass
    assert e.value.member == f"{m.key(i)}.npy" and e.value.offset <= at < e.value.offset + checks.CHUNK


# -- manifests written before sums files ----------------------------------------------------------

def old_form(url, m, columns: bool) -> None:
    """Rewrite the dataset's manifest as streamwin wrote it before sums files: every chunk sum (computed here) in
    index.json, or in its columns file; the sums files removed."""
    per = []
    for s in m.shards:
        per.append(ref_sums((url / s.name).read_bytes(), checks.CHUNK))
        os.remove(url / f"{s.name}.sums")
    held = checks.Checks.make(checks.ALGORITHM, checks.CHUNK, np.concatenate(per), [s.bytes for s in m.shards])
    if columns:
        from dataclasses import replace

        from streamwin.storage.manifests import write_manifest
        from streamwin.storage.urls import url_to_fs

        write_manifest(*url_to_fs(str(url)), replace(m, checks=held), columnar=True)
        assert "check_sums" in json.loads((url / "index.json").read_text())["columns_file"]["layout"]
        return
    doc = json.loads((url / "index.json").read_text())
    doc["checks"] = {"algorithm": checks.ALGORITHM, "chunk": checks.CHUNK,
                     "sums": base64.b64encode(zlib.compress(np.concatenate(per).astype("<u4").tobytes())).decode()}
    doc.pop("content_sha256", None)  # written before manifests were sealed, as these were
    (url / "index.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("columns", [False, True], ids=["inline", "columns-file"])
def test_manifests_before_sums_files_still_verify(dataset, columns):
    url, seqs, m = dataset
    old_form(url, m, columns)
    old = sw.load_manifest(str(url))
    assert old.checks is not None and not old.checks.in_files
    loader = sw.WindowLoader(sw.WindowDataset(str(url), window=W, stride=S, batch_size=B))
    got = [(k, s, x.copy()) for b in loader for k, s, x in zip(b["key"], b["start"].tolist(), b["x"].numpy())]
    assert got and all(np.array_equal(x, seqs[k][s : s + W]) for k, s, x in got)
    assert loader.stats()["bytes_verified"] > 0 and loader.stats()["bytes_sums"] == 0
    sw.verify(str(url), progress=False)
    i = int(np.argmax(m.length))
    at = int(m.offset[i] + m.hlen[i]) + 5 * m.step_bytes
    with open(url / m.shards[m.shard_of(i)].name, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 4]))
    with pytest.raises(sw.ShardError, match="checksum mismatch"):
        for _ in sw.WindowLoader(sw.WindowDataset(str(url), window=W, stride=S, batch_size=B)):
            pass
