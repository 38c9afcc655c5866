"""Train a small forecaster with DistributedDataParallel on windows streamed by streamwin.

    torchrun --nproc_per_node=4 examples/train_ddp.py --data s3://bucket/ecg/ --ckpt ckpt/ecg.pt \
        --window 256 --horizon 32 --epochs 10

Several datasets are mixed into every batch at chosen proportions with ``--data a,b --weights
0.7,0.3`` (each batch of 64: 45 or 44 windows of a, 19 or 20 of b; ``batch["source"]`` says which).

A plain PyTorch loop, the one you would write anyway, plus the three things streamwin asks:

1. ``loader.set_epoch(epoch)`` before each epoch (the same epoch on every rank);
2. ``loader.state_dict()`` in the checkpoint: ranks run in lockstep, so rank 0's says where
   every rank is (here the ranks' states are gathered and checked equal, and rank 0 writes one
   file atomically: tmp file + os.replace);
3. ``loader.load_state_dict(ckpt["loader"])`` on every rank on resume, then the usual
   ``for epoch in range(start_epoch, epochs)``: ``set_epoch`` with the checkpoint's epoch keeps
   the restored mid-epoch position, so the run continues with exactly the batches an
   uninterrupted run would have seen, and every rank still runs the same number of steps.
   Resumed on another number of processes (a job requeued on fewer nodes: elastic resume), what
   comes next depends on the global batch (ranks x ``--batch-size``). Kept the same (4 ranks x 64
   resumed on 2 x 128), on 1, 2, 4 or 8 ranks (canonical streams, the default), the run goes on
   with exactly the global batches the uninterrupted one would have had. Changed (the same
   ``--batch-size`` on fewer ranks), the windows of the epoch not yet yielded are dealt once over
   the new ranks' streams, in blocks shuffled again: none comes twice, fewer than streams x batch
   size are dropped; the next epoch is a normal one of the new world. (Scale the learning rate
   yourself if your recipe needs it when the global batch changes.)

Preemption: SIGTERM or SIGUSR1 (what SLURM sends before a time limit or a preemption, see
examples/slurm/train.sbatch), the file named by ``--stop-file`` appearing, or ``--stop-after N``
(N steps of this run, to simulate it) make every rank save the checkpoint at the same step and
exit 0. The ranks agree on stopping with a one-number all_reduce each step, so a signal that
reaches the nodes at different times cannot leave one rank waiting for the others. Run the
same command again and it resumes; once all epochs are done, running it again does nothing.
Once every rank has saved the checkpoint it stops with, rank 0 writes ``CKPT.stopped`` (the
step and why): under torchrun, which exits 1 when it is signalled whatever its ranks did, that
file is what says they saved (slurm/train.sbatch exits 0 on it).

A dataset that is not there, options the data cannot take, a checkpoint written under other
options: each process says it in one line (``error: ...``, naming the flag to change) and exits 2.

The model is an MLP over each window normalized by its own mean and standard deviation (so
it works on data of any scale; the deviation floored at half the batch's, so that flat
windows do not blow the loss up) that predicts the next ``--horizon`` steps: small, but it
trains for real. Works without torchrun too (one process). gloo on CPU, nccl on GPUs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import re
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import streamwin as sw

log = logging.getLogger("train_ddp")


# ---- model ---------------------------------------------------------------------------------------

class Forecaster(nn.Module):
    """[B, W, F] window -> [B, H, F] forecast of the next H steps, in the window's normalized units."""

    def __init__(self, window: int, horizon: int, features: int, hidden: int = 128):
        super().__init__()
        self.horizon, self.features = horizon, features
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(window * features, hidden), nn.GELU(),
            nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, horizon * features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).view(-1, self.horizon, self.features)


def as_steps(t: torch.Tensor) -> torch.Tensor:
    """[B, T] or [B, T, *F] of any dtype -> float32 [B, T, F]."""
    return t.float().reshape(t.shape[0], t.shape[1], -1)


def window_scale(x: torch.Tensor) -> torch.Tensor:
    """[B, 1, F]: each window's standard deviation, floored at half the batch's standard deviation of that
    feature, so that a flat window (a sensor at rest, an appliance off) does not divide its horizon's
    change by ~0 (losses of 1e4 and more); 1 where even the floor is ~0 (the whole batch flat at one level)."""
    sd = torch.maximum(x.std(1, keepdim=True), 0.5 * x.std(dim=(0, 1), keepdim=True))
    return torch.where(sd > 1e-6, sd, torch.ones_like(sd))


def forecast_loss(model: nn.Module, batch: dict, device: torch.device) -> torch.Tensor:
    """MSE of the forecast, both sides normalized by the window's mean and (floored) std: scale-free."""
    x = as_steps(batch["x"].to(device, non_blocking=True))
    y = as_steps(batch["y"].to(device, non_blocking=True))
    mu, sd = x.mean(1, keepdim=True), window_scale(x)
    err = (model((x - mu) / sd) - (y - mu) / sd).pow(2).mean(dim=(1, 2))
    if "weight" in batch:  # equalize="pad" repeats, or on_error="skip" holes: weight 0
        w = batch["weight"].to(device).float()
        return (err * w).sum() / w.sum().clamp_min(1.0)
    return err.mean()


def features_of(ds: sw.WindowDataset) -> int:
    return int(math.prod(ds.manifest.step_shape))  # 1 for [T] sequences


# ---- distributed set-up --------------------------------------------------------------------------

def init_distributed(backend: str | None) -> tuple[int, int, int, torch.device]:
    """(rank, world, local_rank, device); also works as a single process without torchrun."""
    if "RANK" not in os.environ:  # plain `python train_ddp.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"))
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available() and local_rank < torch.cuda.device_count()
    backend = backend or ("nccl" if cuda else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        # share the node's cores between its processes instead of oversubscribing them
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    return dist.get_rank(), dist.get_world_size(), local_rank, device


class StopRequest:
    """Set by SIGTERM/SIGUSR1 (or a stop file); the ranks agree on it at a step boundary."""

    def __init__(self, stop_file: str | None, rank: int):
        self.signal: int | None = None
        self.stop_file = stop_file if rank == 0 else None  # one process polls the (shared) file system
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        self.signal = signum  # act at the next step boundary, never in the middle of a collective

    def agreed(self, device: torch.device) -> bool:
        """True on every rank if any rank was asked to stop (one tiny all_reduce)."""
        local = self.signal is not None or (self.stop_file is not None and os.path.exists(self.stop_file))
        flag = torch.tensor([1.0 if local else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() > 0


# ---- checkpoint ----------------------------------------------------------------------------------

def save_checkpoint(path: str, *, model: nn.Module, opt: torch.optim.Optimizer, loader: sw.WindowLoader,
                    epoch: int, step: int, args: argparse.Namespace) -> None:
    """Collective: the ranks' loader states must agree (lockstep); rank 0 writes one file atomically."""
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, loader.state_dict())  # a few hundred bytes per rank: a cursor, not data
    if any(s != states[0] for s in states):
        raise RuntimeError("the ranks' data positions differ: they did not run in lockstep")
    if dist.get_rank() == 0:
        ckpt = {"model": model.state_dict(), "opt": opt.state_dict(), "loader": states[0], "epoch": epoch,
                "step": step, "world_size": dist.get_world_size(), "args": vars(args)}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            torch.save(ckpt, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # a crash leaves the previous checkpoint, never half of a new one
    dist.barrier()


def write_atomically(path: str, text: str) -> None:
    """``text`` to ``path`` through a temporary file and ``os.replace``: never half-written."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def load_checkpoint(path: str) -> dict:
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(ckpt["loader"], list):  # written by an earlier version of this script: one state per rank
        ckpt["loader"] = ckpt["loader"][0]  # they are equal (lockstep)
    return ckpt


class Recorder:
    """--record DIR: rank r appends one JSON line per step to DIR/rank<r>.jsonl (what it trained on)."""

    def __init__(self, root: str | None, rank: int, resumed_step: int):
        self.f = None
        if root is None:
            return
        os.makedirs(root, exist_ok=True)
        path = os.path.join(root, f"rank{rank}.jsonl")
        lines = open(path).read().splitlines() if os.path.exists(path) else []
        # steps after the checkpoint were lost with the crash and are trained again: forget them
        kept = [ln for ln in lines if json.loads(ln)["step"] <= resumed_step]
        with open(path, "w") as f:
            f.writelines(ln + "\n" for ln in kept)
        self.f = open(path, "a")

    def write(self, step: int, epoch: int, batch: dict, loss: float) -> None:
        if self.f is not None:
            line = {"step": step, "epoch": epoch, "key": list(batch["key"]), "start": batch["start"].tolist(),
                    "loss": loss}
            if "source" in batch:  # mixed datasets: which one each window came from
                line["source"] = batch["source"].tolist()
            self.f.write(json.dumps(line) + "\n")
            self.f.flush()


# ---- training ------------------------------------------------------------------------------------

WORKERS_HELP = ("streamwin worker processes per rank, as WindowLoader(num_workers=N), not DataLoader workers: each "
                "reads its own stream; 0 (the default here) reads one stream in the trainer's process")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, type=lambda text: [u for u in text.split(",") if u],
                   help="dataset URL (local path, s3://, gs://, ...) written by streamwin pack; a,b,... mixes several")
    p.add_argument("--weights", type=lambda text: [float(w) for w in text.split(",")], default=None,
                   help="with several --data URLs: each one's share of every batch and epoch (e.g. 0.7,0.3)")
    p.add_argument("--ckpt", required=True, help="checkpoint file: resumed from if it exists, written every --ckpt-every steps")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps in total (default: no limit)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="simulate a preemption: save and exit after N steps of this run")
    p.add_argument("--stop-file", default=None, help="save and exit when this file appears (see slurm/train.sbatch)")
    p.add_argument("--ckpt-every", type=int, default=50, help="checkpoint every K steps (default 50)")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--stride", type=int, default=None, help="default: --window // 2")
    p.add_argument("--horizon", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64, help="windows per batch per rank")
    p.add_argument("--shuffle-buffer", type=int, default=4096)
    p.add_argument("--workers", type=int, default=0, help=WORKERS_HELP)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--cache-dir", default=None,
                   help="node-local shard cache: warmed with streamwin.prefetch before training (each local rank "
                        "fetches its share), then a barrier")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl with GPUs, else gloo")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--record", default=None, help="write each rank's (step, key, start, loss) to DIR/rank<r>.jsonl")
    args = p.parse_args(argv)
    if args.weights is not None and len(args.weights) != len(args.data):
        p.error(f"--weights lists {len(args.weights)} numbers for {len(args.data)} --data URLs")
    args.stride = args.stride or max(1, args.window // 2)
    return args


def set_up(args: argparse.Namespace, world: int, local_rank: int, device: torch.device) -> tuple:
    """The dataset, loader, model (and its DDP wrapper), optimizer, step and epoch, restored from --ckpt if it exists."""
    rank = dist.get_rank()
    if args.cache_dir:  # optional: copy the shards to node-local disk once per node, then read them there
        t = time.perf_counter()
        fetched = sum(sw.prefetch(url, args.cache_dir) for url in args.data)
        dist.barrier()  # nobody reads before the whole node cache is warm
        log.info("prefetched %d shards into %s in %.1fs", fetched, args.cache_dir, time.perf_counter() - t)

    data = args.data[0] if len(args.data) == 1 else args.data  # one URL, or several mixed by --weights
    mix = None if len(args.data) == 1 else sw.Mix(weights=args.weights)
    ds = sw.WindowDataset(data, window=args.window, stride=args.stride, horizon=args.horizon,
                          batch_size=args.batch_size, shuffle_buffer=args.shuffle_buffer, seed=args.seed, mix=mix,
                          read=sw.Read(cache_dir=args.cache_dir))
    features = features_of(ds)  # reads the manifest: a missing or unfinished dataset is said here
    loader = sw.WindowLoader(ds, num_workers=args.workers, pin_memory=device.type == "cuda")

    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts them anyway)
    net = Forecaster(args.window, args.horizon, features, args.hidden).to(device)
    model = nn.parallel.DistributedDataParallel(net, device_ids=[local_rank] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    step, start_epoch = 0, 0
    if os.path.exists(args.ckpt):
        ckpt = load_checkpoint(args.ckpt)
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        restore_loader(loader, ckpt, args, PLAN_OPTIONS)  # one position for every rank, in this world or another
        step, start_epoch = ckpt["step"], ckpt["epoch"]
        if rank == 0:
            log.info("resumed from %s: step %d, epoch %d (every rank's data position restored)", args.ckpt, step, start_epoch)
            if ckpt["world_size"] != world:
                log.info("elastic resume: the checkpoint's %d ranks are %d now; the rest of epoch %d is dealt over "
                         "them (%d batches per rank left)", ckpt["world_size"], world, start_epoch,
                         len(loader) - loader.state_dict()["batches"])
    len(loader)  # plans the epoch: options that leave a dataset of a mix without windows are said here
    return ds, loader, net, model, opt, step, start_epoch


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world, local_rank, device = init_distributed(args.backend)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    stop = StopRequest(args.stop_file, rank)
    try:
        ds, loader, net, model, opt, step, start_epoch = set_up(args, world, local_rank, device)
    except USER_ERRORS as e:  # no data at --data, options the data or the checkpoint cannot take: one line, exit 2
        return failed(e, args)
    recorder = Recorder(args.record, rank, step)
    if rank == 0 and os.path.exists(f"{args.ckpt}.stopped"):  # said by an earlier run, which stopped on request
        os.remove(f"{args.ckpt}.stopped")
    if rank == 0:
        log.info("%d ranks x %d batches per epoch of %d windows [%d steps -> %d]; device %s",
                 world, len(loader), args.batch_size, args.window, args.horizon, device)
    nothing_left = start_epoch >= args.epochs or (args.steps is not None and step >= args.steps)
    if len(loader) == 0 and not nothing_left:  # the same on every rank: every rank stops here
        return finish(loader, rank, f"no step can run: 0 batches per rank per epoch ({no_batches(ds, world)})")

    def checkpoint(epoch: int) -> None:
        save_checkpoint(args.ckpt, model=net, opt=opt, loader=loader, epoch=epoch, step=step, args=args)
        if rank == 0:
            log.info("checkpoint: step %d, epoch %d -> %s", step, epoch, args.ckpt)

    run_steps, windows, t0 = 0, 0, time.perf_counter()
    losses: list[float] = []
    preempted, done = False, args.steps is not None and step >= args.steps
    for epoch in range(start_epoch, args.epochs):
        if done:  # resumed with nothing left under --steps
            break
        loader.set_epoch(epoch)  # the checkpoint's epoch: keeps the restored position; a new one: new order
        for batch in loader:
            loss = forecast_loss(model, batch, device)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # DDP all_reduces gradients: equal batch counts on every rank keep this from hanging
            opt.step()
            step += 1
            run_steps += 1
            windows += len(batch["key"])
            losses.append(loss.item())
            recorder.write(step, epoch, batch, losses[-1])

            if step % args.log_every == 0:
                mean = torch.tensor([sum(losses) / len(losses)], device=device)
                dist.all_reduce(mean)
                losses.clear()
                if rank == 0:
                    rate = windows * world / (time.perf_counter() - t0)
                    log.info("epoch %d step %5d  loss %.4f  %s windows/s", epoch, step, mean.item() / world,
                             f"{rate:,.0f}")
            preempted = stop.agreed(device) or run_steps == args.stop_after
            done = args.steps is not None and step >= args.steps
            if preempted or done or step % args.ckpt_every == 0:
                checkpoint(epoch)
            if preempted or done:
                break
        if preempted or done:
            break
    else:  # every epoch finished: the final checkpoint says so (epoch = args.epochs: nothing left to run)
        if run_steps:
            # "epoch" in a checkpoint is the epoch to resume in. A loader state taken after an epoch's
            # last batch was consumed starts that epoch afresh when loaded, so a checkpoint made
            # between epochs must name the next one.
            checkpoint(args.epochs)

    if preempted:  # saved and leaving: a second SIGTERM (torchrun's, after SLURM's) must not end it -15
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if preempted and rank == 0:
        why = f"signal {signal.Signals(stop.signal).name}" if stop.signal else (
            "stop file" if run_steps != args.stop_after else f"--stop-after {args.stop_after}")
        log.info("stopping at step %d (%s); run the same command again to resume", step, why)
        write_atomically(f"{args.ckpt}.stopped", f"step {step} ({why})\n")  # every rank saved (train.sbatch)
    stats = [None] * world
    dist.all_gather_object(stats, loader.stats())
    if rank == 0:
        elapsed = time.perf_counter() - t0
        log.info("%d steps in this run, %.1fs, %s windows/s over %d ranks", run_steps, elapsed,
                 f"{windows * world / max(elapsed, 1e-9):,.0f}", world)
        for r, s in enumerate(stats):
            log.info("rank %d loader.stats(): %s", r, {k: (round(v, 1) if isinstance(v, float) else v) for k, v in s.items()})
    if nothing_left and rank == 0:
        log.info("nothing left to run: the checkpoint is at epoch %d of %d, step %d", start_epoch, args.epochs, step)
    return finish(loader, rank, None if run_steps or nothing_left else "no step ran")


# ---- failures said in one line ---------------------------------------------------------------------

USER_ERRORS = (sw.StreamwinError, ValueError, TypeError)  # what the data, the options or the checkpoint refuse
PLAN_OPTIONS = ("data", "weights", "window", "stride", "horizon", "batch_size", "shuffle_buffer", "seed")


def restore_loader(loader: sw.WindowLoader, ckpt: dict, args: argparse.Namespace, options: tuple[str, ...]) -> None:
    """``loader.load_state_dict``; a checkpoint written under other plan options is refused naming them as flags."""
    try:
        loader.load_state_dict(ckpt["loader"])
    except sw.StateMismatchError as e:
        saved, now = ckpt.get("args", {}), vars(args)
        was = " ".join(f"--{k.replace('_', '-')} {flag_value(saved[k])}" for k in options
                       if saved.get(k) is not None and saved[k] != now[k])
        raise sw.StateMismatchError(f"{e}; {args.ckpt} was written with {was or 'other options'}: pass "
                                    f"{'them' if was else 'those'} again to resume it, or another --ckpt to start "
                                    "afresh") from None


def flag_value(value: object) -> str:
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def in_flags(message: str, flags: set[str]) -> str:
    """A library message in this script's words: ``crops=sw.Crops(pad=True)`` -> ``--pad``, ``window=28`` ->
    ``--window 28`` (a group's wrapper goes where each of its fields is a flag here)."""
    def flag(m: re.Match) -> str:
        option = "--" + m.group(1).replace("_", "-")
        return option if m.group(2) == "True" else f"{option} {m.group(2)}"
    def unwrapped(m: re.Match) -> str:
        return m.group(1) if set(re.findall(r"(\w+)=", m.group(1))) <= flags else m.group(0)
    message = re.sub(r"\b[a-z]+=sw\.[A-Z]\w*\(((?:[^()]|\([^()]*\))*)\)", unwrapped, message)
    return re.sub(rf"\b({'|'.join(sorted(flags, key=len, reverse=True))})=([^\s,;)]+)", flag, message)


def failed(error: Exception, args: argparse.Namespace, logger: logging.Logger = log) -> int:
    """Say ``error`` in one line, in this script's flags, and exit 2 (each rank says its own; under torchrun
    its report of the ranks' exit codes follows)."""
    hint = " (check --data)" if isinstance(error, sw.ManifestError) else ""
    logger.error("error: %s: %s%s", type(error).__name__, in_flags(str(error), set(vars(args))), hint)
    # torchrun sends SIGTERM to the ranks still running once one has failed; Python restores the default
    # action (death, -15) while it shuts down, so this rank's 2 would be lost: it is leaving anyway
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dist.destroy_process_group()
    return 2


def no_batches(ds: sw.WindowDataset, world: int) -> str:
    """Why an epoch has no batch: the windows there are for the ranks' streams and the batch size."""
    s = ds.summary()
    return (f"{s['windows_per_epoch']} windows for {world} ranks in batches of {ds.batch_size}; window "
            f"{ds.spec.window} + horizon {ds.spec.horizon} vs. the sequences' lengths: {s['short_sequences']} of "
            f"{s['sequences']} are shorter. Use a smaller --window or --batch-size")


def finish(loader: sw.WindowLoader, rank: int, error: str | None) -> int:
    """Stop the loader (its worker processes and threads) before the process group, then leave: 0, or 1 with
    ``error`` said. Closing the loader first leaves no thread or process of it alive at exit."""
    loader.close()
    dist.barrier()
    dist.destroy_process_group()
    if error is not None:
        if rank == 0:
            log.error("%s", error)
        return 1
    return 0


def leave(code: int) -> None:
    """End the process with ``code`` once its output is out, without finalizing Python.

    torch's gloo threads outlive ``destroy_process_group`` once DDP has used the group (its
    reducer keeps it). A thread that a busy machine preempts between finishing a collective and
    letting go of its tensors lets go of them after Python has begun to finalize; taking the GIL
    then ends the thread in a way C++ cannot unwind, and the process aborts ("terminate called
    without an active exception", exit -6) after the checkpoint was written. Everything this
    script must do before exiting is done by now (checkpoint synced, loader closed, group
    destroyed): what finalizing Python would add is that race.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())
