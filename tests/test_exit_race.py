"""examples/train_ddp.py leaves without finalizing Python (issue 28, item 9: rank 0 aborted after saving).

The cause: torch's gloo worker threads outlive ``destroy_process_group`` once DDP has used the
group (its reducer keeps it alive). A worker thread that finishes a collective lets go of the
collective's tensors right after; if a busy machine preempts it in between, it lets go of them
after the main thread has begun to finalize Python, and taking the GIL then ends the thread by
an unwind C++ cannot do: ``terminate called without an active exception``, exit -6, in about 1
run of 40 under load, after the checkpoint was written (and so a flaky ``make test``).

This test makes that late release certain instead of rare: a ``sitecustomize`` on the ranks'
PYTHONPATH has rank 0 start one more allreduce on the (still living) group as the process
leaves, completed by rank 1 while the last atexit handler holds the GIL in C; the gloo thread
then waits for the GIL until Python finalizes (a module global's finalizer sleeps). A control
script that ends as the example used to (``sys.exit``) must abort under it; the example must exit
0 with its checkpoint written.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import streamwin as sw

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(600)

LATE_RELEASE = textwrap.dedent('''
    import atexit, os, time
    RANK = "LOCAL_RANK" in os.environ  # the ranks, not torchrun's agent
    if RANK:  # registered before torch's own handlers, so it runs after them: last, right before finalizing
        atexit.register(sum, range(100_000_000))  # C that never lets the GIL go
    import torch.distributed as dist

    _group = []
    _destroy = dist.destroy_process_group

    def _keeping(*args, **kwargs):  # the group's object, kept: DDP keeps its C++ side (and threads) alive anyway
        if dist.is_initialized() and not _group:
            _group.append(dist.group.WORLD)
        return _destroy(*args, **kwargs)

    dist.destroy_process_group = _keeping

    def _late_release():
        if not _group:
            return
        import torch
        if int(os.environ["RANK"]) == 0:
            work = _group[0].allreduce([torch.ones(64)])  # done by rank 1 in 0.3 s, while the handler below
            del work                                      # holds the GIL: the gloo thread then waits for it
        else:
            time.sleep(0.3)
            _group[0].allreduce([torch.ones(64)]).wait()

    class _SlowFinalizer:
        def __del__(self, sleep=time.sleep):  # (module globals may be gone by now)
            sleep(1.0)  # Python is finalizing: the GIL is free a while

    if RANK:
        _slow = _SlowFinalizer()
        atexit.register(_late_release)  # runs first: the allreduce is done while the sum above runs
''')

CONTROL = textwrap.dedent('''
    import sys, datetime
    import torch, torch.distributed as dist, torch.nn as nn
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=2))
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    model(torch.ones(3, 4)).sum().backward()
    dist.barrier()
    dist.destroy_process_group()
    print("control done", flush=True)
    sys.exit(0)
''')


def torchrun(script: str, *args: str, cwd: Path, hazard: Path) -> subprocess.CompletedProcess:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    env.update(PYTHONPATH=os.pathsep.join([str(hazard), str(ROOT)]), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               MASTER_ADDR="127.0.0.1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           script, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_train_ddp_exits_cleanly_when_a_gloo_thread_lets_go_late(tmp_path):
    hazard = tmp_path / "hazard"
    hazard.mkdir()
    (hazard / "sitecustomize.py").write_text(LATE_RELEASE)
    (tmp_path / "control.py").write_text(CONTROL)
    control = torchrun("control.py", cwd=tmp_path, hazard=hazard)
    out = control.stdout + control.stderr
    if control.returncode == 0:  # the race cannot be provoked with this torch: nothing to show
        pytest.skip(f"a late gloo release no longer aborts with torch {torch.__version__}")
    assert "control done" in out and "terminate called without an active exception" in out, out[-3000:]

    rng = np.random.default_rng(0)
    data = str(tmp_path / "data")
    sw.pack([(f"s{i}", rng.standard_normal((int(rng.integers(60, 300)), 2)).astype(np.float32)) for i in range(30)],
            data, shard_bytes=20_000, progress=False)
    ckpt = tmp_path / "ckpt.pt"
    run = torchrun(str(ROOT / "examples" / "train_ddp.py"), "--data", data, "--ckpt", str(ckpt), "--stop-after", "3",
                   "--window", "32", "--horizon", "4", "--batch-size", "8", "--epochs", "5", cwd=tmp_path,
                   hazard=hazard)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "terminate called" not in out, out[-3000:]  # before: exit -6 on rank 0
    assert "stopping at step 3" in out and "loader.stats()" in out  # its output, flushed before it left
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["step"] == 3
