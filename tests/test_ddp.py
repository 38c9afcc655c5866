"""Multi-rank end-to-end tests under torchrun (gloo, loopback), with an all_reduce every step."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

import streamwin as sw
from conftest import make_sequences, reference_windows

HERE = os.path.dirname(__file__)
W, S, B = 16, 8, 8


def torchrun(nproc: int, url: str, out, *args: str, timeout: int = 240) -> list[dict]:
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(HERE, "ddp_run.py"), "--url", url, "--out", str(out), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(nproc)]


def windows(ranks: list[dict], epoch: int) -> list[tuple[str, int]]:
    return [(k, s) for r in ranks for rec in r["records"] if rec["epoch"] == epoch
            for k, s in zip(rec["key"], rec["start"])]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    seqs = make_sequences(90, seed=3)
    url = str(tmp_path_factory.mktemp("ddp") / "ds")
    sw.pack(list(seqs.items()), url, shard_bytes=30_000, progress=False)
    return url, seqs


def resume_at(n: int) -> dict[str, int]:
    """The steps the resume tests take a 2 x 2 run's state at, for ``n`` batches per rank per epoch."""
    return {"elastic": n // 2 + 1, "exact": n + n // 2}  # mid-way through epoch 0, and through epoch 1


@pytest.fixture(scope="module")
def runs(dataset, tmp_path_factory):
    """torchrun results by (nproc, workers), each launched once per module (launches are slow). The 2 x 2 run
    also saves every rank's state at the resume tests' steps (``resume_at``), going on: ``runs.saved(step)``."""
    cache, outs = {}, {}

    def get(nproc: int, workers: int) -> list[dict]:
        if (nproc, workers) not in cache:
            out = tmp_path_factory.mktemp(f"run{nproc}x{workers}")
            extra = []
            if (nproc, workers) == (2, 2):  # batches per rank per epoch, counted here as ddp_run.py's loaders do
                ds = sw.WindowDataset(dataset[0], window=W, stride=S, batch_size=B, shuffle_buffer=64, seed=7, rank=0,
                                      world_size=2)
                n = len(sw.WindowLoader(ds, num_workers=2))
                extra = ["--save-at", *(str(s) for s in resume_at(n).values())]
            cache[nproc, workers] = torchrun(nproc, dataset[0], out, "--workers", str(workers), *extra)
            outs[nproc, workers] = out
            if extra:
                assert cache[nproc, workers][0]["len"] == n
        return cache[nproc, workers]

    def saved(step: int) -> str:
        get(2, 2)
        return str(outs[2, 2] / f"at{step}")
    get.saved = saved
    return get


@pytest.mark.parametrize("nproc,workers", [(2, 0), (3, 2), (2, 2)])
def test_ranks_cover_each_window_at_most_once_in_lockstep(dataset, runs, nproc, workers):
    url, seqs = dataset
    ranks = runs(nproc, workers)
    lengths = {r["len"] for r in ranks}
    assert len(lengths) == 1 and all(len(r["records"]) == 2 * r["len"] for r in ranks)  # equal steps, 2 epochs
    expected = reference_windows(seqs, W, S)
    streams = nproc * max(1, workers)
    for epoch in (0, 1):
        seen = windows(ranks, epoch)
        dup = [w for w, c in Counter(seen).items() if c > 1]
        assert not dup, f"windows seen twice in epoch {epoch}: {dup[:5]}"
        assert set(seen) <= expected
        assert len(expected) - len(seen) < streams * B  # dropped: small, bounded
    assert windows(ranks, 0) != windows(ranks, 1)  # set_epoch changes the order


def test_two_runs_are_bitwise_identical(dataset, runs, tmp_path):
    url, _ = dataset
    a = runs(2, 2)
    b = torchrun(2, url, tmp_path / "b", "--workers", "2")
    assert [r["records"] for r in a] == [r["records"] for r in b]


def test_eval_mode_pads_every_rank_to_lockstep_with_weights(dataset, tmp_path):
    url, seqs = dataset
    ranks = torchrun(3, url, tmp_path / "run", "--equalize", "pad", "--epochs", "1", "--batch-size", "64")
    real = [(k, s) for r in ranks for rec in r["records"] for k, s, w in zip(rec["key"], rec["start"], rec["weight"]) if w == 1]
    assert sorted(real) == sorted(reference_windows(seqs, W, S))


def test_resume_under_torchrun_continues_exactly(dataset, runs, tmp_path):
    """Resumed from each rank's state at a step mid-way through epoch 1: the rest of the uninterrupted run."""
    url, _ = dataset
    full = runs(2, 2)
    stop = resume_at(full[0]["len"])["exact"]
    resumed = torchrun(2, url, tmp_path / "resumed", "--workers", "2", "--resume", runs.saved(stop))
    for f, r in zip(full, resumed):
        assert r["records"] == f["records"][stop:]


def test_elastic_resume_under_torchrun_two_ranks_to_three(dataset, runs, tmp_path):
    """Preempted on 2 ranks, requeued on 3: rank 0's state on every rank; the rest of the epoch, once."""
    url, seqs = dataset
    full = runs(2, 2)
    old_dropped = reference_windows(seqs, W, S) - set(windows(full, 0))
    stop = resume_at(full[0]["len"])["elastic"]
    before = [dict(r, records=r["records"][:stop]) for r in full]  # what the 2 ranks trained on up to the state
    after = torchrun(3, url, tmp_path / "resumed", "--workers", "1", "--epochs", "1", "--resume", runs.saved(stop),
                     "--state-of-rank", "0")
    steps = {len(r["records"]) for r in after}
    assert len(steps) == 1 and {r["len"] for r in after} == {stop + steps.pop()}  # lockstep, len = taken + rest
    seen_before, seen_after = windows(before, 0), windows(after, 0)
    assert not set(seen_before) & set(seen_after) and len(set(seen_after)) == len(seen_after)
    missing = reference_windows(seqs, W, S) - set(seen_before) - set(seen_after)
    assert old_dropped <= missing and len(missing) - len(old_dropped) <= 3 * B


def test_s3_dataset_under_torchrun(s3_server, s3_bucket, tmp_path):
    seqs = make_sequences(40, seed=5)
    url = f"{s3_bucket}/corpus"
    so = s3_server.storage_options()
    sw.pack(list(seqs.items()), url, shard_bytes=20_000, progress=False, storage_options=so)
    (tmp_path / "so.json").write_text(json.dumps(so))
    ranks = torchrun(2, url, tmp_path / "run", "--workers", "2", "--storage-options", str(tmp_path / "so.json"))
    seen = windows(ranks, 0)
    assert len(set(seen)) == len(seen) and set(seen) <= reference_windows(seqs, W, S)
    assert len(reference_windows(seqs, W, S)) - len(seen) < 4 * B
