"""The examples run end to end on tiny data, in bounded time (every launch has a timeout).

* examples/train_ddp.py under torchrun (2 gloo processes), stopped with --stop-after; then the
  same job goes on under examples/slurm/train.sbatch run as plain bash with SLURM's variables
  set (node cache warm-up, the torchrun line, SIGUSR1 -> checkpoint and stop, requeue ->
  resume). What each rank trained on at each step, and the losses, must be exactly those of
  an uninterrupted run, which the test recomputes in-process (same plan, model and AdamW).
* examples/train_lightning.py with Lightning's DDP on 2 CPU processes: stopped mid-epoch,
  stopped at an epoch's last batch, resumed to the end; the same exactness check.
* examples/hpo_optuna.py: three small trials, each with its own seed, over the same shards.
* examples/slurm/pack.sbatch: an array of three `--part i/n` tasks, then the merge.
* streamwin.world picks SLURM_PROCID / SLURM_NTASKS, and prefers torchrun's RANK / WORLD_SIZE.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

import streamwin as sw
from streamwin.world import resolve_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
W, H, B, EPOCHS, SEED = 32, 4, 16, 2, 0  # window, horizon, batch size; stride W // 2 (the examples' default)
TRAIN_ARGS = ["--window", str(W), "--horizon", str(H), "--batch-size", str(B), "--epochs", str(EPOCHS),
              "--seed", str(SEED)]
LAUNCH_TIMEOUT = 120  # seconds per launch; a hang (e.g. unequal steps under DDP) fails instead of blocking CI


def sequences(n: int = 40, seed: int = 0) -> dict[str, np.ndarray]:
    """Noisy two-channel sinusoids of uneven lengths (a few shorter than one window)."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        t = int(rng.integers(10, 400))
        steps = np.arange(t)[:, None]
        x = np.sin(steps * rng.uniform(0.05, 0.3) + rng.uniform(0, 6, size=(1, 2)))
        out[f"s{i:03d}"] = (x + 0.05 * rng.standard_normal((t, 2))).astype(np.float32)
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("examples") / "ds")
    sw.pack(list(sequences().items()), url, shard_bytes=20_000, progress=False)
    return url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables, on loopback, with the venv's tools on PATH."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "NODE_RANK")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in drop}
    env.update(GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    env.update(extra)
    return env


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: int = LAUNCH_TIMEOUT) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, env=env or clean_env(), capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-6000:]}"
    # an example that succeeds prints only its own lines: no "Exception ignored" at exit, no traceback (issue 28.8)
    assert "Exception ignored" not in out and "Traceback" not in out, f"{' '.join(cmd)}:\n{out[-6000:]}"
    return out


def torchrun(script: str, *args: str) -> str:
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                os.path.join(EXAMPLES, script), *args])


def records(root: str, world: int = 2) -> list[list[dict]]:
    return [[json.loads(line) for line in open(os.path.join(root, f"rank{r}.jsonl"))] for r in range(world)]


def reference(url: str, world: int = 2) -> list[list[tuple]]:
    """Per rank, (epoch, keys, starts) of every batch of an uninterrupted run, computed in-process."""
    out = []
    for rank in range(world):
        ds = sw.WindowDataset(url, window=W, stride=W // 2, horizon=H, batch_size=B, shuffle_buffer=4096, seed=SEED,
                              rank=rank, world_size=world)
        loader = sw.WindowLoader(ds)
        batches = []
        for epoch in range(EPOCHS):
            loader.set_epoch(epoch)
            batches += [(epoch, list(b["key"]), b["start"].tolist()) for b in loader]
        out.append(batches)
    return out


def replayed_losses(url: str, world: int = 2) -> list[list[float]]:
    """Per rank, the loss at every step of an uninterrupted DDP run, replayed in one process.

    DDP averages the ranks' gradients, so one step on the mean of the ranks' losses is the same
    update; a resume that lost the model or the optimizer state (AdamW moments) shows up as a
    different loss right after the resume.
    """
    sys.path.insert(0, EXAMPLES)
    try:
        from train_ddp import Forecaster, forecast_loss
    finally:
        sys.path.remove(EXAMPLES)
    loaders = [sw.WindowLoader(sw.WindowDataset(url, window=W, stride=W // 2, horizon=H, batch_size=B,
                                                shuffle_buffer=4096, seed=SEED, rank=r, world_size=world))
               for r in range(world)]
    torch.manual_seed(SEED)
    model = Forecaster(W, H, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses: list[list[float]] = [[] for _ in range(world)]
    for epoch in range(EPOCHS):
        for loader in loaders:
            loader.set_epoch(epoch)
        for batches in zip(*loaders):
            per_rank = [forecast_loss(model, b, torch.device("cpu")) for b in batches]
            opt.zero_grad()
            (sum(per_rank) / world).backward()
            opt.step()
            for r, loss in enumerate(per_rank):
                losses[r].append(loss.item())
    return losses


def check_continues_exactly(url: str, rec_dir: str) -> None:
    got, want, losses = records(rec_dir), reference(url), replayed_losses(url)
    for rank in range(2):
        assert [r["step"] for r in got[rank]] == list(range(1, len(want[rank]) + 1)), f"rank {rank}: steps not 1..N"
        assert [(r["epoch"], r["key"], r["start"]) for r in got[rank]] == want[rank], \
            f"rank {rank}: the resumed run trained on other windows than an uninterrupted run"
        np.testing.assert_allclose([r["loss"] for r in got[rank]], losses[rank], rtol=1e-5,
                                   err_msg=f"rank {rank}: losses differ from an uninterrupted run (model/optimizer state)")


# ---- train_ddp.py, under torchrun and under SLURM -------------------------------------------------

def ddp_args(data: str, ckpt: str, rec: str) -> list[str]:
    return ["--data", data, "--ckpt", ckpt, "--ckpt-every", "4", "--log-every", "5", "--record", rec, *TRAIN_ARGS]


@pytest.fixture(scope="module")
def stopped_run(data, tmp_path_factory) -> dict:
    """train_ddp.py under torchrun, "preempted" by --stop-after 7 (epoch 0 has 13 steps per rank)."""
    root = tmp_path_factory.mktemp("train_ddp")
    ckpt, rec = str(root / "ckpt" / "run.pt"), str(root / "rec")
    out = torchrun("train_ddp.py", *ddp_args(data, ckpt, rec), "--stop-after", "7")
    return {"ckpt": ckpt, "rec": rec, "out": out}


def test_train_ddp_stop_after_checkpoints_every_ranks_position(stopped_run):
    out, ckpt = stopped_run["out"], stopped_run["ckpt"]
    assert "stopping at step 7 (--stop-after 7)" in out
    assert "streamwin: {" in out and "'batches_per_rank': 13" in out, "rank 0's streamwin summary is not logged"
    assert "loader.stats()" in out and "windows/s" in out and "loss" in out
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert (saved["step"], saved["epoch"], saved["world_size"], saved["loader"]["batches"]) == (7, 0, 2, 7)
    assert not [f for f in os.listdir(os.path.dirname(ckpt)) if ".tmp" in f], "temporary checkpoint left behind"
    assert [len(r) for r in records(stopped_run["rec"])] == [7, 7]


def slurm_env(**extra: str) -> dict[str, str]:
    """What srun gives one task of a one-node job, plus SRUN=none to run the job steps in place."""
    return clean_env(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0", SLURM_NNODES="1", SLURM_NODEID="0",
                     SLURM_NTASKS_PER_NODE="1", SRUN="none", PYTHON=sys.executable, **extra)


def test_train_ddp_resumes_exactly_under_slurm_sbatch_sigusr1_and_requeue(data, stopped_run, tmp_path):
    """The stopped torchrun job goes on under examples/slurm/train.sbatch's torchrun line: resumed at
    step 7, stopped by SLURM's warning signal at step 8, resumed again by the "requeued" job to the
    end. Every rank must have trained on exactly the batches, with exactly the losses, of a run
    that was never interrupted."""
    ckpt, rec, cache = stopped_run["ckpt"], stopped_run["rec"], str(tmp_path / "node-cache")
    env = slurm_env(DATA=data, CKPT=ckpt, CACHE_DIR=cache, NPROC_PER_NODE="2", MASTER_PORT=str(free_port()))
    cmd = ["bash", os.path.join(EXAMPLES, "slurm", "train.sbatch"), *TRAIN_ARGS, "--ckpt-every", "4", "--record", rec]

    # SIGUSR1 (--signal=B:USR1@180) reaches the batch script as the job starts: checkpoint at the first step
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    lines: list[str] = []
    try:
        for line in proc.stdout:  # the trap is set before this line is printed
            lines.append(line)
            if "rendezvous 127.0.0.1" in line:
                proc.send_signal(signal.SIGUSR1)
                break
        lines += proc.stdout.readlines()
        proc.wait(timeout=LAUNCH_TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the process group this test started (bash, torchrun, ranks)
            proc.wait()
    out = "".join(lines)
    assert proc.returncode == 0, out[-6000:]
    assert "resumed from" in out and "step 7, epoch 0" in out
    assert "SIGUSR1" in out and "stopping at step 8 (stop file)" in out  # every rank stopped at the same step
    assert "not under SLURM, run the same command again to resume" in out
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["step"] == 8
    shards = [f for f in os.listdir(cache) if f.endswith("_tar")]
    assert len(shards) == len(sw.load_manifest(data).shards), "the prefetch step did not warm the node cache"
    assert "'cache_hits': 0" not in out and "'cache_hits'" in out, "training did not read from the node cache"

    # the requeued job runs the script again: it resumes and finishes
    out = run(cmd, env | {"MASTER_PORT": str(free_port())})
    assert "resumed from" in out and "step 8, epoch 0" in out
    assert not os.path.exists(ckpt + ".stop"), "the stop file of the previous run must be removed"
    check_continues_exactly(data, rec)
    final = torch.load(ckpt, map_location="cpu", weights_only=True)
    # all epochs done: the checkpoint names epoch EPOCHS, so a job requeued again has nothing left to run
    assert (final["step"], final["epoch"]) == (2 * 13, EPOCHS)


def test_slurm_requeue_on_fewer_processes_resumes_elastically(data, tmp_path):
    """Preempted with 2 processes, requeued with 1 (a smaller allocation): the rest of epoch 0 is
    dealt over the one rank (no window of it trained on twice), then epoch 1 is a normal epoch."""
    ckpt, rec, rec2 = str(tmp_path / "run.pt"), str(tmp_path / "rec"), str(tmp_path / "rec2")
    torchrun("train_ddp.py", *ddp_args(data, ckpt, rec), "--stop-after", "5")
    env = slurm_env(DATA=data, CKPT=ckpt, NPROC_PER_NODE="1", MASTER_PORT=str(free_port()))
    out = run(["bash", os.path.join(EXAMPLES, "slurm", "train.sbatch"), *TRAIN_ARGS, "--record", rec2], env)
    assert "step 5, epoch 0" in out and "elastic resume: the checkpoint's 2 ranks are 1 now" in out
    before = {(k, s) for r in records(rec) for x in r if x["epoch"] == 0 for k, s in zip(x["key"], x["start"])}
    after = [(k, s) for x in records(rec2, 1)[0] if x["epoch"] == 0 for k, s in zip(x["key"], x["start"])]
    assert after and not before & set(after) and len(set(after)) == len(after)
    epoch1 = [(x["key"], x["start"]) for x in records(rec2, 1)[0] if x["epoch"] == 1]
    assert epoch1 == [(k, s) for e, k, s in reference(data, world=1)[0] if e == 1]


# ---- train_lightning.py ------------------------------------------------------------------------

LIGHTNING_NOISE = ("GPU available", "TPU available", "Tip:", "Initializing distributed", "distributed_backend",
                   "processes registered", "Warning", "deprecated", "`IterableDataset`", "-----", "stopped:",
                   "Restor")


def assert_quiet(out: str) -> None:
    """Only the example's own lines: none of Lightning's banners, tips and warnings that do not apply here."""
    noise = [line for line in out.splitlines() if any(word in line for word in LIGHTNING_NOISE)]
    assert not noise, "Lightning noise in the example's output:\n" + "\n".join(noise)


def test_lightning_ddp_fit_resumes_model_and_every_ranks_loader(data, tmp_path):
    if importlib.util.find_spec("lightning") is None and importlib.util.find_spec("pytorch_lightning") is None:
        pytest.skip("the Lightning example needs `pip install lightning` (part of the dev extra)")
    ckpt_dir, rec = str(tmp_path / "ckpt"), str(tmp_path / "rec")
    cmd = [sys.executable, os.path.join(EXAMPLES, "train_lightning.py"), "--data", data, "--ckpt-dir", ckpt_dir,
           "--accelerator", "cpu", "--devices", "2", "--ckpt-every", "5", "--log-every", "5", "--record", rec,
           *TRAIN_ARGS]
    env = clean_env(MASTER_PORT=str(free_port()))

    out = run([*cmd, "--stop-after", "7"], env)  # mid-epoch 0
    assert "stopping at step 7" in out and os.path.exists(os.path.join(ckpt_dir, "last.ckpt"))
    assert_quiet(out)
    assert [len(r) for r in records(rec)] == [7, 7]
    saved = torch.load(os.path.join(ckpt_dir, "last.ckpt"), map_location="cpu", weights_only=False)
    assert '"batches": 7' in json.dumps(saved, default=str), "the checkpoint must hold the loader's position"

    out = run([*cmd, "--stop-after", "6"], env | {"MASTER_PORT": str(free_port())})  # to the last batch of epoch 0
    assert "resuming from" in out and "stopping at step 13" in out
    assert_quiet(out)

    out = run(cmd, env | {"MASTER_PORT": str(free_port())})  # from an end-of-epoch checkpoint to the end
    assert "resuming from" in out and "loader.stats()" in out
    assert_quiet(out)
    check_continues_exactly(data, rec)


# ---- hpo_optuna.py -----------------------------------------------------------------------------

def test_optuna_trials_have_their_own_seeds_and_share_the_shards(data):
    pytest.importorskip("optuna", reason="the HPO example needs `pip install optuna` (part of the dev extra)")
    before = sorted((f, os.path.getmtime(os.path.join(data, f))) for f in os.listdir(data))
    out = run([sys.executable, os.path.join(EXAMPLES, "hpo_optuna.py"), "--data", data, "--trials", "3",
               "--steps", "20", "--eval-every", "10", "--windows", "16", "32", "--horizon", str(H),
               "--batch-size", str(B), "--holdout", "24"])
    for k in range(3):
        assert f"trial {k}: seed {k} " in out and "val loss" in out
    assert "best trial" in out
    assert out.count("'split': 'train'") >= 3 and out.count("'split': 'val'") >= 3
    after = sorted((f, os.path.getmtime(os.path.join(data, f))) for f in os.listdir(data))
    assert before == after, "trials must read the shards in place, not copy or rewrite them"


# ---- SLURM pack array + merge, rank detection ------------------------------------------------

def test_slurm_pack_array_then_merge_has_every_sequence(tmp_path):
    src, dest = tmp_path / "src", str(tmp_path / "packed")
    src.mkdir()
    seqs = {f"s{i:03d}": np.random.default_rng(i).standard_normal((50 + 10 * i, 2)).astype(np.float32)
            for i in range(12)}
    for key, arr in seqs.items():
        np.save(src / f"{key}.npy", arr)
    script = os.path.join(EXAMPLES, "slurm", "pack.sbatch")
    tasks = [subprocess.Popen(["bash", script, str(src), dest, "--shard-size", "4KB"], cwd=ROOT, text=True,
                              env=clean_env(SLURM_ARRAY_TASK_ID=str(i), SLURM_ARRAY_TASK_COUNT="3",
                                            SLURM_ARRAY_TASK_MIN="0", SLURM_CPUS_PER_TASK="1", PYTHON=sys.executable),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for i in range(3)]  # the array's tasks run at the same time
    outs = []
    for t in tasks:
        try:
            outs.append(t.communicate(timeout=LAUNCH_TIMEOUT)[0])
        finally:
            if t.poll() is None:
                t.kill()
        assert t.returncode == 0, outs[-1][-3000:]
    assert "streamwin merge" in outs[0]  # task 0 names (under SLURM: submits) the dependent merge
    packed = [re.search(rf"part {i}/3: packed (\d+) sequences", outs[i]) for i in range(3)]
    assert all(packed) and sum(int(m.group(1)) for m in packed) == 12  # contiguous runs of units (runs of files)
    with pytest.raises(sw.StreamwinError):
        sw.load_manifest(dest)  # not a dataset until merged

    out = run(["bash", script, "merge", dest], clean_env(PYTHON=sys.executable))
    assert "merged 6 shards, 12 sequences" in out
    m = sw.load_manifest(dest)
    assert m.keys(range(m.num_sequences)) == sorted(seqs)
    assert m.length.tolist() == [len(seqs[k]) for k in sorted(seqs)]
    ds = sw.WindowDataset(dest, window=50, stride=1000, batch_size=1, rank=0, world_size=1,
                          order=sw.Order(shuffle=False))
    firsts = {b["key"][0]: b["x"][0].numpy() for b in sw.WindowLoader(ds)}
    assert sorted(firsts) == sorted(seqs)
    for key, x in firsts.items():
        np.testing.assert_array_equal(x, seqs[key][:50])


def test_world_from_slurm_variables_and_torchrun_first(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    assert resolve_world() == (0, 1)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert resolve_world() == (5, 8)
    monkeypatch.setenv("RANK", "2")  # torchrun inside an srun task: its ranks are the ones that count
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert resolve_world() == (2, 16)
    monkeypatch.setenv("SLURM_PROCID", "oops")
    assert resolve_world() == (2, 16)  # never consulted when torchrun's variables are there
    monkeypatch.delenv("RANK")
    with pytest.raises(ValueError, match="SLURM_PROCID"):
        resolve_world()


# ---- runs that can do nothing say so and exit non-zero ----------------------------------------------

def run_failing(cmd: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    proc = subprocess.run(cmd, cwd=ROOT, env=env or clean_env(), capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT)
    return proc.returncode, proc.stdout + proc.stderr


def test_train_ddp_with_a_window_longer_than_every_sequence_exits_non_zero_saying_why(data, tmp_path):
    """Before: 0 steps, exit 0."""
    args = ["--data", data, "--ckpt", str(tmp_path / "run.pt"), "--window", "1000", "--horizon", "4", "--epochs", "1"]
    code, out = run_failing([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             os.path.join(EXAMPLES, "train_ddp.py"), *args])
    assert code != 0 and "no step can run: 0 batches per rank per epoch" in out, out[-3000:]
    assert "window 1000 + horizon 4" in out and "Use a smaller --window" in out


def test_lightning_with_no_batch_exits_non_zero_saying_why(data, tmp_path):
    if importlib.util.find_spec("lightning") is None and importlib.util.find_spec("pytorch_lightning") is None:
        pytest.skip("the Lightning example needs `pip install lightning` (part of the dev extra)")
    cmd = [sys.executable, os.path.join(EXAMPLES, "train_lightning.py"), "--data", data, "--ckpt-dir",
           str(tmp_path / "ckpt"), "--accelerator", "cpu", "--devices", "1", "--window", "1000", "--epochs", "1"]
    code, out = run_failing(cmd, clean_env(MASTER_PORT=str(free_port())))
    assert code == 1 and "no step ran: 0 batches per rank per epoch" in out, out[-3000:]


def test_demo_with_no_batch_exits_non_zero_saying_why(tmp_path):
    url = str(tmp_path / "stdlib")
    sw.pack([(f"f{i}", np.frombuffer(b"short text %d" % i, np.uint8)) for i in range(20)], url, progress=False)
    code, out = run_failing([sys.executable, os.path.join(EXAMPLES, "demo.py"), "--data", url, "--steps", "10"])
    assert code == 1 and "no step can run: 0 batches per rank" in out, out[-3000:]


def test_optuna_says_why_each_trial_was_pruned(data):
    pytest.importorskip("optuna", reason="the HPO example needs `pip install optuna` (part of the dev extra)")
    code, out = run_failing([sys.executable, os.path.join(EXAMPLES, "hpo_optuna.py"), "--data", data, "--trials", "2",
                             "--steps", "10", "--windows", "1000", "--horizon", str(H), "--holdout", "24"])
    assert code == 1, out[-3000:]
    assert "no trial completed: 2 trial(s) pruned or failed; why: window 1000 + horizon 4: 0 train" in out
    assert out.count("pruned: window 1000 + horizon 4") >= 2  # the log line and the table, per trial
