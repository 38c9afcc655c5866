"""benchmarks/remote_peers.py: measure() on a tiny corpus, from the loopback range server and moto at 0 and
50 ms, gives one row per system with every window of the epoch delivered; a peer this venv lacks is skipped."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import remote_peers  # noqa: E402
from benchmarks.remote_peers_stores import write_corpus  # noqa: E402

SEQS = 24
SYSTEMS = ["streamwin-http", "streamwin-http-warm", "webdataset-http", "streamwin-s3"]


def epoch_windows(n_seqs: int) -> int:
    """Windows of W=128, stride 64 over the corpus recipe's first ``n_seqs`` lengths (issue 42's RNG)."""
    lengths = np.random.default_rng(0).integers(500, 20_001, size=1_500)[:n_seqs]
    return int(((lengths - 128) // 64 + 1).sum())


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[dict], list[dict]]:
    """One round of four systems (and Mosaic, absent here) at 0 and 50 ms, in-process loaders, whole epochs."""
    work = tmp_path_factory.mktemp("remote-peers")
    corpus = work / "corpus"
    write_corpus(corpus, SEQS, 1 << 20)
    records: list[dict] = []
    rows = remote_peers.measure(corpus, work / "work", systems=[*SYSTEMS, "mosaic-s3"], latencies_ms=[0, 50],
                                workers=[0], rounds=1, seconds=0, timeout=600, records=records)
    return corpus, rows, records


def test_every_system_delivers_the_epoch_at_every_latency(run):
    corpus, rows, records = run
    total = epoch_windows(SEQS)
    assert [r["system"] for r in rows] == SYSTEMS
    for rec in (r for r in records if r.get("kind") == "rate"):
        assert "error" not in rec, rec
        # webdataset yields a last partial batch; streamwin drops the epoch's last partial batch (documented)
        want = total if rec["system"] == "webdataset-http" else total - total % 256
        assert rec["windows"] == want and rec["full_epoch"], rec
        assert rec["windows_per_s"] > 0 and rec["first_batch_s"] > 0 and rec["peak_pss_mb"] > 0, rec
    for row in rows:
        assert row["ratio_50ms"] is not None and row["windows_per_s_50ms"] > 0, row


def test_bytes_served_match_what_each_system_reads(run):
    corpus, _, records = run
    shard_mb = sum(p.stat().st_size for p in corpus.glob("*.tar")) / 1e6
    served = {(r["system"], r["latency_ms"]): r["served_mb"] for r in records if r.get("kind") == "rate"}
    for ms in (0, 50):
        assert served[("webdataset-http", ms)] == pytest.approx(shard_mb, abs=1e-6)  # whole shards, once each
        assert served[("streamwin-http-warm", ms)] < 0.01 * shard_mb  # index.json only: shards from the cache
        assert 0.5 * shard_mb < served[("streamwin-http", ms)] < 1.1 * shard_mb


def test_a_peer_this_venv_lacks_is_skipped_with_its_install_line(run):
    _, _, records = run
    skipped = [r for r in records if r.get("kind") == "skip"]
    assert [r["system"] for r in skipped] == ["mosaic-s3"] and "pip install" in skipped[0]["error"]
