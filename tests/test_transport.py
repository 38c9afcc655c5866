"""Every way of running a loader keeps the invariants; worker processes and shared memory are cleaned up.

Modes: in-process (workers 0), worker processes over shared-memory slots (1, 2), and device
mode (in-process: windows cut on a device from blocks uploaded once; with workers: each batch
copied to the device whole; device="cpu" here, the same code as CUDA). References are computed
naively from the sequences, never by streamwin.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest
import torch

import streamwin as sw
from conftest import expect_killed_worker_named, naive, our_children, reference_windows
from streamwin.feed.slots import leftovers

W, S, H, B = 16, 8, 4, 8
MODES = [(0, None), (1, None), (2, None), (0, "cpu"), (2, "cpu")]


def make(url, workers=0, device=None, **kw):
    loader_kw = {k: kw.pop(k) for k in ("persistent_workers", "prefetch_factor", "pin_memory") if k in kw}
    args = dict(window=W, stride=S, horizon=H, batch_size=B, shuffle_buffer=64, seed=3) | kw
    return sw.WindowLoader(sw.WindowDataset(url, **args), num_workers=workers, device=device, **loader_kw)


def run(loader):
    return [{k: (v.clone() if torch.is_tensor(v) else list(v)) for k, v in b.items()} for b in loader]


def same(a, b):
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(list(x[k]) == list(y[k]) if k == "key" else torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b))


@pytest.mark.parametrize("workers,device", MODES)
@pytest.mark.parametrize("pad", [False, True])
def test_every_mode_yields_exact_windows_at_most_once(tiny, workers, device, pad):
    url, seqs = tiny
    loader = make(url, workers, device, crops=sw.Crops(pad=pad))
    batches = run(loader)
    assert len(batches) == len(loader) > 0
    seen = []
    for b in batches:
        assert b["x"].shape == (B, W, 3) and b["y"].shape == (B, H, 3) and b["x"].dtype == torch.float32
        for i, (key, start) in enumerate(zip(b["key"], b["start"].tolist())):
            ref = naive(seqs, key, start, W + H)
            assert np.array_equal(b["x"][i].numpy(), ref[:W]) and np.array_equal(b["y"][i].numpy(), ref[W:])
            if pad:
                assert b["mask"][i].tolist() == [j < len(seqs[key]) - start for j in range(W)]
        seen += list(zip(b["key"], b["start"].tolist()))
    expected = reference_windows(seqs, W, S, H, pad)
    assert len(set(seen)) == len(seen) and set(seen) <= expected
    assert len(expected) - len(seen) == loader.summary()["dropped_windows"] < max(1, workers) * B
    assert not our_children() and not leftovers(os.getpid())


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("opts", [{}, dict(crops=sw.Crops(pad=True), order=sw.Order(equalize="pad"))])
def test_device_mode_is_bitwise_the_cpu_path(tiny, workers, opts):
    url, _ = tiny
    cpu, dev = run(make(url, workers, **opts)), run(make(url, workers, "cpu", **opts))
    assert same(cpu, dev) and len(cpu) > 0


@pytest.mark.parametrize("workers,device", MODES)
def test_same_run_twice_and_a_new_order_per_epoch(tiny, workers, device):
    url, _ = tiny
    a, b = run(make(url, workers, device)), run(make(url, workers, device))
    assert same(a, b)
    loader = make(url, workers, device)
    loader.set_epoch(1)
    assert not same(a, run(loader))


@pytest.mark.parametrize("workers,device", MODES)
def test_resume_is_exact_in_every_mode(tiny, workers, device):
    url, _ = tiny
    full = run(make(url, workers, device))
    for k in (0, 1, 3, len(full) // 2, len(full) - 1):
        loader = make(url, workers, device)
        it = iter(loader)
        for _ in range(k):
            next(it)
        state = json.loads(json.dumps(loader.state_dict()))
        loader.close()
        restored = make(url, workers, device)
        restored.load_state_dict(state)
        assert same(full[k:], run(restored)), (workers, device, k)


@pytest.mark.parametrize("workers", [0, 2])
def test_ranks_in_lockstep_cover_each_window_at_most_once(tiny, workers):
    url, seqs = tiny
    world, lens, seen = 3, [], []
    for rank in range(world):
        ds = sw.WindowDataset(url, window=W, stride=S, horizon=H, batch_size=B, shuffle_buffer=64, seed=3,
                              rank=rank, world_size=world)
        loader = sw.WindowLoader(ds, num_workers=workers)
        batches = run(loader)
        lens.append((len(batches), len(loader)))
        seen += [(k, s) for b in batches for k, s in zip(b["key"], b["start"].tolist())]
    assert len({n for pair in lens for n in pair}) == 1 and lens[0][0] > 0  # equal steps
    assert len(set(seen)) == len(seen) and set(seen) <= reference_windows(seqs, W, S, H)


def test_a_dead_worker_is_named_within_seconds(tiny):
    url, _ = tiny
    loader = make(url, 2, shuffle_buffer=16)
    it = iter(loader)
    next(it)
    expect_killed_worker_named(loader, it)


def test_an_error_in_a_worker_is_raised_in_the_trainer(tiny, tmp_path):
    import shutil

    url, _ = tiny
    bad = tmp_path / "bad"
    shutil.copytree(url, bad)
    shard = sorted(p for p in os.listdir(bad) if p.endswith(".tar"))[0]
    data = (bad / shard).read_bytes()
    (bad / shard).write_bytes(data.replace(b"\x93NUMPY", b"\x93NOMPY"))  # every .npy header of a shard damaged
    loader = make(str(bad), 2, order=sw.Order(shuffle=False))
    with pytest.raises(sw.ShardError, match=shard):
        run(loader)
    loader.close()
    assert not our_children() and not leftovers(os.getpid())


def test_persistent_workers_survive_a_pass_abandoned_midway(tiny):
    url, _ = tiny
    full = run(make(url, 2))
    loader = make(url, 2, persistent_workers=True)
    it = iter(loader)
    for _ in range(3):
        next(it)
    pids = [p.pid for p in loader._pool.procs]
    assert same(run(loader), full)  # a new pass after an abandoned one starts the epoch again
    assert [p.pid for p in loader._pool.procs] == pids
    loader.set_epoch(1)
    assert same(run(loader), _epoch_of(url, 2, 1))
    loader.close()
    assert not our_children()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_forgotten_set_epoch_advances_the_epoch(tiny, workers):
    url, _ = tiny
    loader = make(url, workers)
    first, second = run(loader), run(loader)
    assert same(first, _epoch_of(url, workers, 0)) and same(second, _epoch_of(url, workers, 1))
    state = loader.state_dict()  # taken at the end of epoch 1: a resumed loader goes on with epoch 2
    restored = make(url, workers)
    restored.load_state_dict(state)
    assert same(run(restored), _epoch_of(url, workers, 2)) and same(run(loader), _epoch_of(url, workers, 2))


def _epoch_of(url, workers, epoch):
    loader = make(url, workers)
    loader.set_epoch(epoch)
    return run(loader)


def test_kept_batches_are_never_overwritten_and_a_loop_needs_no_copy(tiny, recwarn):
    url, seqs = tiny
    for b in make(url, 2):  # the usual loop holds one batch at a time: slots recycle, no copy
        pass
    assert not [w for w in recwarn if "copied out" in str(w.message)]
    kept = list(make(url, 2, shuffle_buffer=16))  # everything kept: later batches are copied out, all intact
    assert [w for w in recwarn if "copied out" in str(w.message)]
    for b in kept:
        for i, (key, start) in enumerate(zip(b["key"], b["start"].tolist())):
            assert np.array_equal(b["x"][i].numpy(), naive(seqs, key, start, W))


def test_two_loaders_on_one_dataset_keep_their_own_worker_count(tiny):
    url, _ = tiny
    ds = sw.WindowDataset(url, window=W, stride=S, horizon=H, batch_size=B, shuffle_buffer=64, seed=3)
    first = sw.WindowLoader(ds, num_workers=0)
    alone = run(first)
    second = sw.WindowLoader(ds, num_workers=2)
    assert same(run(first), _epoch_of(url, 0, 1)) and len(first) == len(alone)
    assert first.state_dict()["inputs"]["num_workers"] == 0 and second.state_dict()["inputs"]["num_workers"] == 2


def test_a_plain_dataloader_is_refused_clearly(tiny):
    url, _ = tiny
    ds = sw.WindowDataset(url, window=W, batch_size=B)
    with pytest.raises(TypeError, match="WindowLoader"):
        next(iter(torch.utils.data.DataLoader(ds)))


SCRIPT = """
import os, sys, time
import streamwin as sw
ds = sw.WindowDataset({url!r}, window=16, stride=1, batch_size=4, shuffle_buffer=16)
loader = sw.WindowLoader(ds, num_workers=2, persistent_workers=True)
for epoch in range(1000):
    for i, batch in enumerate(loader):
        if epoch == 0 and i == 0:
            import signal
            deliverable = callable(signal.getsignal(signal.SIGINT)) and \
                signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # (Python's, or the loader's)
            print("PIDS", os.getpid(), *[p.pid for p in loader._pool.procs], flush=True)
            print("SIGINT", "deliverable" if deliverable else "ignored or blocked", flush=True)
        time.sleep(0.001)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_interrupted_trainer_leaves_no_process_and_no_shared_memory(tiny, tmp_path, sig):
    url, _ = tiny
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(url=url)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path), "PYTHONFAULTHANDLER": "1"})
    line = proc.stdout.readline()
    assert line.startswith("PIDS"), proc.stderr.read()
    pids = [int(p) for p in line.split()[1:]]
    # a SIGINT ignored or blocked where the test runs is inherited by the trainer, which then never sees it
    if proc.stdout.readline().strip() != "SIGINT deliverable":
        proc.kill()
        proc.wait(timeout=10)
        pytest.fail("the process running this test ignores or blocks SIGINT, and so does the trainer it starts")
    time.sleep(0.3)
    proc.send_signal(sig)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:  # a hang: fail saying where it was, leaving no process to the next tests
        proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack (where the trainer waits)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
        pytest.fail(f"the trainer did not exit within 20 s of {sig.name}:\n{proc.communicate()[1][-3000:]}")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                              for p in pids[1:]):
        time.sleep(0.1)
    alive = [p for p in pids[1:] if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not alive, f"workers outlived the trainer after {sig.name}"
    assert not leftovers(pids[0]), f"shared memory left behind after {sig.name}"


@pytest.mark.parametrize("workers", [0, 2])
def test_stats_are_run_totals(tiny, workers):
    url, _ = tiny
    loader = make(url, workers)
    n = len(loader)
    run(loader)
    first = loader.stats()
    run(loader)
    second = loader.stats()
    assert (first["batches"], second["batches"]) == (n, 2 * n) and second["windows"] == 2 * n * B
    assert second["bytes_read"] > first["bytes_read"] > 0 and second["reads"] > first["reads"] > 0
    assert (second["epoch"], second["batches_in_epoch"]) == (1, n) and second["wait_s"] > 0


@pytest.mark.parametrize("batch_size", [2 * B, B // 2])
def test_a_state_at_an_epochs_end_loads_with_another_batch_size(tiny, batch_size):
    url, _ = tiny
    loader = make(url)
    run(loader)
    end = loader.state_dict()
    other = make(url, batch_size=batch_size)
    other.load_state_dict(end)  # carries no position: accepted, a larger or a smaller batch size
    expected = make(url, batch_size=batch_size)
    expected.set_epoch(1)
    assert same(run(other), run(expected))
    it = iter(loader)
    first = next(it)
    mid = make(url, batch_size=2 * B)
    mid.load_state_dict(loader.state_dict())  # mid-epoch: the rest of the epoch, dealt in batches of 2B
    taken = set(zip(first["key"], first["start"].tolist()))
    rest = [w for b in run(mid) for w in zip(b["key"], b["start"].tolist())]
    assert rest and not taken & set(rest) and len(set(rest)) == len(rest)


def test_a_state_saved_by_streamwin_0_1_still_loads(tiny):
    """0.1's WindowLoader was a StatefulDataLoader: its state nested one {stream, batch, epoch, inputs} per stream."""
    url, _ = tiny
    full = run(make(url, 2))
    fresh = make(url, 2)
    inputs = fresh.dataset.plan_inputs(2)
    k = 5  # batches taken: 3 from worker 0, 2 from worker 1 (round robin)
    per_worker = {0: 3, 1: 2}
    old = {"_snapshot": {"_worker_snapshots": {f"worker_{w}": {"dataset_state": {
        "version": 1, "inputs": inputs, "epoch": 0, "stream": w, "batch": n, "stats": {}}}
        for w, n in per_worker.items()}}, "_iterator_finished": False,
        "streamwin": {"version": 1, "epoch": 0, "inputs": inputs}}
    fresh.load_state_dict(old)
    assert same(run(fresh), full[k:])


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("opts", [{}, dict(crops=sw.Crops(pad=True), order=sw.Order(equalize="pad"))])
def test_cuda_batches_are_bitwise_the_cpu_path(tiny, workers, opts):
    url, _ = tiny
    cpu = run(make(url, workers, **opts))
    loader = make(url, workers, "cuda", **opts)
    got = []
    for b in loader:
        assert all(v.is_cuda for k, v in b.items() if k != "key")
        got.append({k: (v.cpu() if torch.is_tensor(v) else list(v)) for k, v in b.items()})
    assert same(cpu, got)
    if workers == 0:
        assert 0 < loader.stats()["device_peak_bytes"] <= 4 * loader.stats()["device_uploaded_bytes"]


@cuda
def test_pinned_slots_are_not_reused_before_their_copies_finish(tiny):
    url, seqs = tiny
    loader = make(url, 2, pin_memory=True, shuffle_buffer=16)
    out = []
    for b in loader:  # the batch is dropped right after queuing its copy: the slot must outlive the copy
        x = b["x"].to("cuda", non_blocking=True)
        out.append((list(b["key"]), b["start"].tolist(), x))
    torch.cuda.synchronize()
    for keys, starts, x in out:
        for i, (key, start) in enumerate(zip(keys, starts)):
            assert np.array_equal(x[i].cpu().numpy(), naive(seqs, key, start, W))


def test_device_memory_is_bounded_and_reported(tiny):
    """In-process device mode uploads blocks once: a few live at a time, never all (with workers, batches are
    copied whole, each freed when dropped)."""
    url, _ = tiny
    loader = make(url, 0, "cpu", shuffle_buffer=16)  # many small blocks
    for _ in loader:
        pass
    s = loader.stats()
    assert s["device_blocks"] == -(-len(loader) * B // 16) or s["device_blocks"] >= len(loader) * B // 16
    per_block = s["device_uploaded_bytes"] / s["device_blocks"]
    assert 0 < s["device_peak_bytes"] <= 6 * per_block * 1.5 < s["device_uploaded_bytes"]  # a few blocks, not all


def test_spawned_workers_yield_the_same_batches(tiny):
    """With spawn (macOS's default, or chosen) workers rebuild the dataset from its pickle: same batches."""
    url, _ = tiny
    forked = run(make(url, 2))
    ds = sw.WindowDataset(url, window=W, stride=S, horizon=H, batch_size=B, shuffle_buffer=64, seed=3)
    spawned = sw.WindowLoader(ds, num_workers=2, multiprocessing_context="spawn")
    assert same(run(spawned), forked)
    assert not our_children() and not leftovers(os.getpid())


STARTING = """
import os, sys
import streamwin as sw
ds = sw.WindowDataset({url!r}, window=16, stride=8, batch_size=4, shuffle_buffer=16)
loader = sw.WindowLoader(ds, num_workers=2, multiprocessing_context="spawn")  # seconds to start
print("STARTING", os.getpid(), flush=True)
for batch in loader:
    pass
"""


def test_a_trainer_killed_while_its_workers_start_leaves_no_shared_memory(tiny, tmp_path):
    """Spawned workers take seconds to start; a SIGKILL meanwhile must leave nothing named in /dev/shm."""
    url, _ = tiny
    script = tmp_path / "start.py"
    script.write_text(STARTING.format(url=url))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
    line = proc.stdout.readline()
    assert line.startswith("STARTING"), proc.stderr.read()
    pid = int(line.split()[1])
    time.sleep(1.0)  # the pool exists; its spawned workers are still importing torch
    proc.kill()
    proc.wait(timeout=20)
    assert not leftovers(pid), "shared memory named in /dev/shm outlived a trainer killed during start-up"
