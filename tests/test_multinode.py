"""Several nodes and elastic resume under torchrun (gloo, loopback), with an all_reduce every step.

Two nodes are simulated on one machine: two torchrun agents (``--nnodes 2``, static rendezvous
on 127.0.0.1), two ranks each, each node with its own cache directory, the shards served by the
loopback HTTP server. Every property is checked against what the runs recorded and what the
server saw, never against the planner: each shard fetched at most once per node, equal steps on
every rank, no window twice; and one node of four ranks stopped mid-epoch and resumed on two ranks
trains on exactly the global batches of the two nodes' job (in-process, tests/test_canon.py checks
more worlds and worker counts).
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
from collections import Counter

import pytest

import streamwin as sw
from conftest import make_sequences, reference_windows

HERE = os.path.dirname(__file__)
W, S = 16, 8
ENV = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")


def launch(out, url, nproc: int, *args: str, nodes: int = 1, node: int = 0, port: int = 0, cache=None):
    """A torchrun agent running tests/ddp_run.py (started, not waited for)."""
    os.makedirs(out, exist_ok=True)
    where = ["--standalone"] if nodes == 1 else ["--nnodes", str(nodes), "--node_rank", str(node),
                                                  "--master_addr", "127.0.0.1", "--master_port", str(port)]
    cmd = [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc_per_node={nproc}",
           os.path.join(HERE, "ddp_run.py"), "--url", url, "--out", str(out), "--epochs", "1",
           "--canonical", "8,8", *args]
    if cache is not None:
        cmd += ["--cache-dir", str(cache)]
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs, out, world: int, timeout: int = 300) -> list[dict]:
    for p in procs:
        text = p.communicate(timeout=timeout)[0]
        assert p.returncode == 0, text[-5000:]
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]


def global_batches(ranks: list[dict]) -> list[list[tuple[str, int]]]:
    """Step k: every rank's windows of step k, in rank order."""
    steps = {len(r["records"]) for r in ranks}
    assert len(steps) == 1, f"unequal steps: {steps}"
    return [[(k, s) for r in ranks for k, s in zip(r["records"][i]["key"], r["records"][i]["start"])]
            for i in range(steps.pop())]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GetLog(logging.Handler):
    """Paths of the GET requests the loopback server answered (its handler logs each one at DEBUG)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.paths: list[str] = []

    def emit(self, record):
        m = re.search(r'"GET (\S+) HTTP', record.getMessage())
        if m:
            self.paths.append(m.group(1))


@pytest.fixture(scope="module")
def served(tmp_path_factory, http_server_module):
    seqs = make_sequences(90, seed=3)
    root = tmp_path_factory.mktemp("nodes")
    sw.pack(list(seqs.items()), str(root / "ds"), shard_bytes=30_000, progress=False)
    srv = http_server_module(str(root))
    return srv, srv.url_for("ds"), seqs


@pytest.fixture(scope="module")
def http_server_module():
    from servers import HTTPFileServer
    made = []

    def make(root):
        made.append(HTTPFileServer(root))
        return made[-1]
    yield make
    for s in made:
        s.close()


def test_two_nodes_make_one_nodes_batches_and_a_job_preempted_on_4_ranks_resumes_on_2(served, tmp_path):
    """One torchrun test (three agents): two nodes of 2 ranks run a whole epoch, fetching each shard once per node;
    one node of 4 ranks stopped mid-epoch and resumed on 2 ranks (global batch 16 both) trains on exactly its
    global batches."""
    srv, url, seqs = served
    log, logger = GetLog(), logging.getLogger("servers")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(log)
    try:
        port = free_port()
        procs = [launch(tmp_path / "run", url, 2, "--batch-size", "4", nodes=2, node=n, port=port,
                        cache=tmp_path / f"node{n}") for n in range(2)]
        ranks = finish(procs, tmp_path / "run", 4)
    finally:
        logger.removeHandler(log)
        logger.setLevel(level)
    batches = global_batches(ranks)  # equal steps on all 4 ranks (and every step did an all_reduce)
    assert {r["len"] for r in ranks} == {len(batches)} and len(batches) > 5
    seen = [w for b in batches for w in b]
    assert len(seen) == len(set(seen)) and set(seen) <= reference_windows(seqs, W, S)
    shards = [p for p in log.paths if p.endswith(".tar")]
    cached = [sorted(n for n in os.listdir(tmp_path / f"node{k}") if not n.endswith((".lock", "_sums")))
              for k in range(2)]  # each node's shard copies (as tests/test_cache.py lists them)
    per_path = Counter(shards)
    assert shards and all(n <= 2 for n in per_path.values()), f"a shard fetched more than once per node: {per_path}"
    assert sum(per_path.values()) == sum(len(c) for c in cached), "every fetch is one node's cached copy"
    assert all(len(c) > 0 for c in cached)

    stop = len(batches) // 2 + 1
    first = finish([launch(tmp_path / "ckpt", url, 4, "--batch-size", "4", "--stop-after", str(stop),
                           cache=tmp_path / "cache")], tmp_path / "ckpt", 4)
    after = finish([launch(tmp_path / "resumed", url, 2, "--batch-size", "8", "--resume", str(tmp_path / "ckpt"),
                           "--state-of-rank", "0", cache=tmp_path / "cache")], tmp_path / "resumed", 2)
    assert len(global_batches(first)) == stop and {r["len"] for r in after} == {len(batches)}
    assert global_batches(first) + global_batches(after) == batches, \
        "one node of 4 ranks, then 2 ranks, made other global batches than two nodes of 2 ranks"
