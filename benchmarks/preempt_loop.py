"""examples/train_ddp.py preempted and resumed N times in a row under torchrun: how many runs abort.

Each run is ``torchrun --standalone --nproc_per_node=P examples/train_ddp.py --stop-after K``
on one checkpoint, so every run resumes the last one's model, optimizer and data position,
trains K steps, saves and exits 0 (issue 28, item 9: 1 run in ~43 aborted rank 0 after
saving, ``terminate called without an active exception``, exit -6). A run that exits
non-zero, prints ``terminate called`` or a traceback, or does not resume at the step the last
one saved counts as a failure; its output is kept under ``--out``, with a core file where the
system writes one (``ulimit -c`` is raised for the runs) and its ``gdb`` backtrace if gdb is
there. ``--busy N`` runs N busy-looping processes beside the runs (load, as in a shared CI).

Not part of ``make test`` (a hundred runs take 20-60 minutes on 2 cores). Prints one line per
run, then one JSON line: {"runs", "aborts", "failures", "wall_s", ...}.

Usage:  python benchmarks/preempt_loop.py [--runs 100] [--stop-after 30] [--nproc 2] [--busy 1]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train_ddp.py"
TRAIN = ["--window", "32", "--horizon", "4", "--batch-size", "16", "--epochs", "100000", "--seed", "0",
         "--ckpt-every", "10", "--log-every", "10"]


def make_data(url: str) -> None:
    """The examples test's corpus: 40 noisy two-channel sinusoids of uneven lengths, small shards."""
    import numpy as np

    import streamwin as sw

    rng = np.random.default_rng(0)
    seqs = []
    for i in range(40):
        t = int(rng.integers(10, 400))
        x = np.sin(np.arange(t)[:, None] * rng.uniform(0.05, 0.3) + rng.uniform(0, 6, size=(1, 2)))
        seqs.append((f"s{i:03d}", (x + 0.05 * rng.standard_normal((t, 2))).astype(np.float32)))
    sw.pack(seqs, url, shard_bytes=20_000, progress=False)


def busy() -> None:
    """Spin (load beside the runs) until killed."""
    while True:
        pass


def env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "NODE_RANK")
    out = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in drop}
    out.update(GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return out


def cores_on() -> None:
    """In the child: write core files (the failure's evidence), and a session of its own."""
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    os.setsid()


def backtrace(core: Path) -> str:
    """gdb's backtrace of every thread of a core file (empty when gdb is missing)."""
    if shutil.which("gdb") is None:
        return ""
    r = subprocess.run(["gdb", "-batch", "-ex", "thread apply all bt 25", sys.executable, str(core)],
                       capture_output=True, text=True, timeout=300)
    return r.stdout[-200_000:]


def run_once(k: int, args: argparse.Namespace, url: str, ckpt: str, work: Path) -> dict:
    """One preempted run in a directory of its own (where a core file lands); its verdict."""
    cwd = work / f"run{k:03d}"
    cwd.mkdir()
    before = _step(ckpt)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(EXAMPLE), "--data", url, "--ckpt", ckpt, "--stop-after", str(args.stop_after), *TRAIN]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=cores_on)
    try:
        out, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session this run started: torchrun and its ranks
        out, _ = proc.communicate()
        out += f"\n[preempt_loop] killed after {args.timeout} s\n"
    wall = time.monotonic() - t0
    after = _step(ckpt)
    problems = []
    if proc.returncode != 0:
        problems.append(f"exit {proc.returncode}")
    if "terminate called" in out:
        problems.append("terminate called")
    if "Traceback" in out:
        problems.append("traceback")
    if after != before + args.stop_after:
        problems.append(f"checkpoint at step {after}, expected {before + args.stop_after}")
    cores = sorted(cwd.glob("core*"))
    if problems:
        (cwd / "output.txt").write_text(out)
        for core in cores:
            (cwd / f"{core.name}.bt.txt").write_text(backtrace(core))
    else:
        shutil.rmtree(cwd)
    return {"run": k, "wall_s": round(wall, 1), "problems": problems, "abort": "terminate called" in out
            or bool(re.search(r"exitcode\s*:\s*-6|Signal 6|SIGABRT", out)), "cores": [c.name for c in cores]}


def _step(ckpt: str) -> int:
    if not os.path.exists(ckpt):
        return 0
    import torch

    return int(torch.load(ckpt, map_location="cpu", weights_only=True)["step"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--stop-after", type=int, default=30)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--busy", type=int, default=0, help="busy-looping processes beside the runs (load)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a run may take before it is killed")
    p.add_argument("--out", default=None, help="where failed runs keep their output (default: a temp dir)")
    args = p.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="preempt_loop-"))
    work.mkdir(parents=True, exist_ok=True)
    url, ckpt = str(work / "data"), str(work / "ckpt.pt")
    if not os.path.exists(os.path.join(url, "index.json")):
        make_data(url)
    spinners = [mp.Process(target=busy, daemon=True) for _ in range(args.busy)]
    for s in spinners:
        s.start()
    results, t0 = [], time.monotonic()
    try:
        for k in range(args.runs):
            r = run_once(k, args, url, ckpt, work)
            results.append(r)
            print(f"run {k:3d}: {r['wall_s']:6.1f} s  {'ok' if not r['problems'] else '; '.join(r['problems'])}",
                  flush=True)
    finally:
        for s in spinners:
            s.kill()
            s.join()
    failed = [r for r in results if r["problems"]]
    print(json.dumps({"runs": len(results), "aborts": sum(r["abort"] for r in results), "failures": len(failed),
                      "failed_runs": [r["run"] for r in failed], "stop_after": args.stop_after, "nproc": args.nproc,
                      "busy": args.busy, "wall_s": round(time.monotonic() - t0, 1), "out": str(work)}))


if __name__ == "__main__":
    main()
