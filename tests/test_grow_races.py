"""Appends raced against a reader mid-epoch and against another append, on local disk and on the S3 server
(issue 44, item 5), and an append killed midway. Real processes, real stores; every round is checked against
data computed in benchmarks/grow_races.py, not by the code under test. Each race runs a round or two here;
``python benchmarks/grow_races.py --rounds 50 [--where s3]`` runs them 50 times.
"""
from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest

import streamwin as sw

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks import grow_races as races  # noqa: E402


@pytest.mark.parametrize("scenario", ["reader", "appends"])
def test_appends_race_locally(tmp_path, scenario):
    for k in range(2):
        damaged, outcome = races.SCENARIOS[scenario](tmp_path, str(tmp_path / f"ds{k}"), None, random.Random(k))
        assert not damaged, outcome


@pytest.mark.parametrize("scenario", ["reader", "appends"])
def test_appends_race_on_s3(s3_server, tmp_path, scenario):
    """The reader keeps its generation on object storage too (its workers load the grown index.json and plan on
    the view their loader loaded); two appends commit one after the other, or one fails naming the holder."""
    damaged, outcome = races.SCENARIOS[scenario](tmp_path, f"{s3_server.make_bucket()}/ds",
                                                 s3_server.storage_options(), random.Random(7))
    assert not damaged, outcome
    if scenario == "reader":
        assert outcome == "committed mid-epoch"


def test_an_append_killed_midway_leaves_the_dataset_as_it_was(tmp_path):
    dest = str(tmp_path / "ds")
    base = races.old()
    sw.pack(list(base.items()), dest, shard_bytes=4 << 10, progress=False)
    index = open(f"{dest}/index.json", "rb").read()
    p = races.Proc(tmp_path, dict(repo=ROOT, dest=dest, seed=1, pause=0.3)).ready()
    p.go()
    deadline = time.monotonic() + 60
    while not any(n.startswith("shard-g000002") and n.endswith(".tar") for n in os.listdir(dest)):
        assert time.monotonic() < deadline and p.p.poll() is None
        time.sleep(0.01)
    os.kill(p.p.pid, signal.SIGKILL)  # shards of the append written, its manifest not
    p.result()
    assert open(f"{dest}/index.json", "rb").read() == index
    assert races.same(races.read_back(dest, None), base)
    sw.pack(list(races.additions(2).items()), dest, shard_bytes=4 << 10, progress=False, mode="extend")
    assert races.same(races.read_back(dest, None), races.grown(base, 2))
    assert not any(n.startswith("shard-g000002") for n in os.listdir(dest))  # what the killed one wrote is gone
