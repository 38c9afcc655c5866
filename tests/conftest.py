"""Shared fixtures: tiny datasets written by streamwin.pack, and the loopback servers."""
from __future__ import annotations

import os
import sys

import numpy as np
import psutil
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from servers import *  # noqa: E402,F401,F403  (s3_server, s3_bucket, s3_fault_proxy, http_server)

import streamwin as sw  # noqa: E402

#: The slowest test files first (their tests' seconds summed, under `make test` at 192146b), so that under
#: `make test` (pytest-xdist, ``--dist loadfile``: a file runs whole on one process, its module fixtures
#: built once) the two processes finish together instead of one starting a long file near the end.
SLOW_FIRST = ["test_examples.py", "test_longseq.py", "test_ddp.py", "test_benchmarks_peers.py", "test_docs.py",
              "test_cli.py", "test_transport.py", "test_benchmarks_smoke.py", "test_plan.py", "test_frictions.py",
              "test_pack_ray.py", "test_pack.py", "test_pretrain.py"]


def pytest_collection_modifyitems(config, items) -> None:
    """Under xdist, the slow files first (a stable sort: each file's tests keep their order)."""
    if getattr(config, "workerinput", None) is None:
        return  # a plain run keeps pytest's order
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def make_sequences(n: int = 60, *, features: tuple[int, ...] = (3,), seed: int = 0, max_len: int = 400,
                   dtype=np.float32) -> dict[str, np.ndarray]:
    """Sequences of very uneven lengths (some shorter than any window, a few long ones)."""
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([rng.integers(1, 40, size=n // 3), rng.integers(40, max_len, size=n - n // 3 - 2),
                              [max_len * 4, max_len * 2]])
    rng.shuffle(lengths)
    out = {}
    for i, t in enumerate(lengths):
        # values encode (sequence, step) so a misplaced window can never compare equal by chance
        base = np.arange(int(t), dtype=np.float64)[:, None] * 1000 + i + np.zeros((1,) + features)
        out[f"seq{i:04d}"] = (base.reshape((int(t),) + features)).astype(dtype)
    return out


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(url, sequences) of a dataset of 60 uneven sequences in several shards."""
    seqs = make_sequences()
    url = str(tmp_path_factory.mktemp("tiny") / "ds")
    sw.pack(list(seqs.items()), url, shard_bytes=40_000, progress=False)
    return url, seqs


def forbid_unpickling(monkeypatch) -> None:
    """Make any attempt to unpickle (or np.lib.format.read_array) fail the test."""
    import pickle

    def trap(*args, **kwargs):
        raise AssertionError("shard bytes reached an unpickler")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, trap)
    monkeypatch.setattr(np.lib.format, "read_array", trap)


def reference_windows(seqs: dict[str, np.ndarray], window: int, stride: int, horizon: int = 0,
                      pad: bool = False) -> set[tuple[str, int]]:
    """Every (key, start) an epoch must cover, computed naively and independently of streamwin."""
    out = set()
    for key, arr in seqs.items():
        t = len(arr)
        start = 0
        while start + window + horizon <= t:
            out.add((key, start))
            start += stride
        if pad and 0 < t < window + horizon:
            out.add((key, 0))
    return out


def lockstep(group, summarize, take=None, check=None) -> list[list]:
    """Step the ranks of one job (their loaders, in one process) together: per rank, ``summarize(batch)`` of
    each batch. Stops after ``take`` steps, or when the ranks run out, which they must do at the same step."""
    iters = [iter(x) for x in group]
    out = [[] for _ in group]
    while take is None or len(out[0]) < take:
        got = []
        for it in iters:
            try:
                got.append(next(it))
            except StopIteration:
                got.append(None)
        if all(b is None for b in got):
            break
        assert all(b is not None for b in got), "ranks ran out of batches at different steps"
        for rank, b in enumerate(got):
            if check:
                check(b)
            out[rank].append(summarize(b))
    return out


def two_corpora(root) -> tuple[list[str], list[dict[str, np.ndarray]]]:
    """(urls, sequences per source) of a mix: a large corpus and a small one with other keys and values."""
    big = make_sequences(120, seed=3, max_len=500)
    small = {f"small{k[3:]}": -v - 1 for k, v in make_sequences(24, seed=4, max_len=120).items()}
    urls = [str(root / "big"), str(root / "small")]
    for url, seqs in zip(urls, (big, small)):
        sw.pack(list(seqs.items()), url, shard_bytes=60_000, progress=False)
    return urls, [big, small]


def our_children() -> list[psutil.Process]:
    """Live child processes of this one, less Python's own servers, which live as long as the interpreter: the
    resource tracker (spawn starts one) and the fork server (forkserver starts one; the workers it forks count)."""
    return [p for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != "zombie"
            and not any(s in " ".join(p.cmdline()) for s in ("resource_tracker", "multiprocessing.forkserver"))]


def expect_killed_worker_named(loader, it) -> None:
    """Kill worker 1 of ``loader`` (iterated by ``it``, a batch in): the next batches raise a WorkerError naming it
    within 10 s, never a hang; once closed, no process or shared memory of ours is left."""
    import signal
    import time

    from streamwin.errors import WorkerError
    from streamwin.feed.slots import leftovers

    victim = loader._pool.procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=rf"worker 1 \(pid {victim.pid}\) was killed by signal 9"):
        for _ in it:
            pass
    assert time.monotonic() - t0 < 10
    loader.close()
    assert not our_children() and not leftovers(os.getpid())


OPENED: list = []  # loaders a test made through ``opened``, closed after it


def opened(loader):
    """``loader``, closed once the test that made it ends (passed or not): no worker outlives its test."""
    OPENED.append(loader)
    return loader


@pytest.fixture(autouse=True)
def close_opened():
    yield
    while OPENED:
        OPENED.pop().close()


def naive(seqs: dict[str, np.ndarray], key: str, start: int, span: int) -> np.ndarray:
    """Steps [start, start + span) of sequence ``key``, zero-padded past its end: a window as packed."""
    arr = seqs[key]
    ref = np.zeros((span,) + arr.shape[1:], arr.dtype)
    part = arr[start : start + span]
    ref[: len(part)] = part
    return ref


def flip_byte(path, at: int, mask: int) -> None:
    """XOR the byte at offset ``at`` of file ``path`` with ``mask``, in place (what a bit rot or an attacker does)."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ mask]))
