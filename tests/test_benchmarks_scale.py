"""benchmarks/scale.py writes its synthetic corpus straight with numpy: it must be a valid dataset."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

import streamwin as sw

ROOT = Path(__file__).resolve().parent.parent


def load_scale():
    spec = importlib.util.spec_from_file_location("bench_scale", ROOT / "benchmarks" / "scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_synthetic_corpus_verifies_and_reads_back(tmp_path, monkeypatch):
    scale = load_scale()
    monkeypatch.setattr(scale, "PER_SHARD", 700)
    url = scale.make_corpus(tmp_path / "c", 2_000)
    assert sw.verify(url, progress=False)["sequences"] == 2_000  # tar headers, offsets, npy headers, sha256
    m = sw.load_manifest(url)
    assert len(m.shards) == 3 and m.key(1234) == "s00001234"
    ds = sw.WindowDataset(url, window=8, stride=4, batch_size=64, seed=1)
    batch = next(iter(sw.WindowLoader(ds, num_workers=0)))
    for key, start, x in zip(batch["key"], batch["start"].tolist(), batch["x"].numpy()):
        i = int(key[1:])
        assert np.allclose(x, (i % 1000) + np.arange(start, start + 8, dtype=np.float32) / 100)


def test_pack_rows_report_speed_up_per_core_and_memory(tmp_path, capsys):
    scale = load_scale()
    pack = scale.pack_rates(tmp_path, 1_600, [1, 2])
    pack["memory"] = scale.pack_memory(tmp_path, [1_000, 3_000])
    scale.print_table([], pack, 1_600)
    out = capsys.readouterr().out
    assert pack["identical"] and set(pack["seq_per_s"]) == {1, 2}
    assert "2 workers:" in out and "x)" in out and "in the writer" in out
    assert [m["sequences"] for m in pack["memory"]] == [1_000, 3_000] and "growth per sequence" in out


def test_sparse_corpus_reads_verified_and_its_reader_holds_bounded_sums(tmp_path, monkeypatch):
    """The terabyte stand-in: sparse shards whose sums files are real, read through a bounded sums cache."""
    scale = load_scale()
    monkeypatch.setattr(scale, "SPARSE_SHARD", 8 << 20)
    url = scale.make_sparse_corpus(tmp_path / "sparse", 1)  # 128 shards of 8 MB, no disk but the sums files
    m = sw.load_manifest(url)
    assert len(m.shards) == 128 and m.checks.in_files
    from streamwin.read import sums as read_sums

    monkeypatch.setattr(read_sums, "SUMS_LIMIT", 64 << 10)
    monkeypatch.setattr(scale, "SUMS_STRIDE", 4096)  # 512 windows a shard: a block of 10,000 reads ~20 shards
    got = scale.child_sums(url, "3")
    # 3 blocks of shuffle_buffer (10,000) windows; canonical streams (the default) cut them at chunks of 40 steps
    assert got["windows"] in (30_000, 3 * 40 * 256) and got["shards_read"] > got["held_shards"] >= 1
    assert got["held_kb"] <= 64 + 21 * 8.2  # the bound, plus what one block's reads need (~20 shards' sums)
    assert got["before_sums_files_mb"] == 1.0  # 4 bytes per 4 KiB of a GB
