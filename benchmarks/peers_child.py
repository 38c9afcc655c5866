"""What one child process of peers.py measures: a rate, a fed training step, the checks, or a conversion.

Each job runs in a fresh interpreter (the one that has the system's package), prints one JSON
record and leaves. The checks are run, never assumed:

- **exact resume**: an uninterrupted epoch; a second loader stopped after k batches, its state
  pickled and loaded into a third, fresh loader whose rest must equal the uninterrupted rest,
  batch by batch, by content (a sha1 of each batch's bytes). A system with no state restarts.
- **elastic resume**: 2 simulated ranks take k batches each, their states load into 3 new ranks
  (new rank r takes old rank r % 2's state) that run to the end of the epoch; over both runs
  fewer than (2 + 3) x batch windows may come twice and fewer than (2 + 3) x batch be lost: at
  most one partial batch per rank of each world's plan, repeated to equalize steps (Mosaic's and
  DistributedSampler's padding) or dropped (streamwin's documented drop: fewer than streams x
  batch for the epoch's plan, and again for the rest's plan). Windows are told apart by their
  first and last rows' bytes.
- **equal steps**: 2 simulated ranks each run the epoch; the batch counts must be equal.

The ranks of a world run at once, each a process forked from the check's child with torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT: one node), each
loader in-process (num_workers=0), on the check corpus (the --quick corpus by default); a state
crosses from one process to the next pickled, as a checkpoint would carry it.
"""
from __future__ import annotations

import hashlib
import multiprocessing
import os
import pickle
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

import data
from peers_formats import (HFArrow, HFStream, LitDataSeqs, LitDataTemporal, LitDataWindows, MosaicSeqs,
                           MosaicWindows)
from peers_systems import Params, Streamwin, System, TorchdataNodes, Tutorial, WebDataset, tree_bytes

OLD_WORLD, NEW_WORLD = 2, 3


def all_systems() -> list[System]:
    """Every set-up of every system, in table order (a peer's set-ups side by side)."""
    return [Streamwin(), WebDataset(), MosaicWindows(), MosaicSeqs(), LitDataWindows(), LitDataSeqs(),
            LitDataTemporal(), HFStream(), HFArrow(), TorchdataNodes(), Tutorial()]


def system_named(name: str) -> System:
    """The system called ``name``."""
    return {s.name: s for s in all_systems()}[name]


def batch_array(batch: Any) -> np.ndarray:
    """The [B, W, F] array of any system's batch."""
    from baselines import batch_tensor  # noqa: PLC0415

    return batch_tensor(batch).numpy()


def window_keys(x: np.ndarray) -> list[bytes]:
    """One key per window: its first and last rows' bytes (unique in a random-normal corpus)."""
    rows = np.concatenate([x[:, 0, :], x[:, -1, :]], axis=1)
    return [r.tobytes() for r in np.ascontiguousarray(rows)]


def digest(x: np.ndarray) -> str:
    """A batch's content, for comparing batches across loaders."""
    return hashlib.sha1(np.ascontiguousarray(x).tobytes()).hexdigest()


def start_epoch(loader: Any) -> Iterator[Any]:
    """iter(loader) for epoch 0 (``set_epoch(0)`` first where the loader has it)."""
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(0)
    return iter(loader)


# =========================================================================== measurements


def measure_rate(system: System, job: dict[str, Any]) -> dict[str, Any]:
    """Windows/s from iter() to the epoch's end or ``seconds``; first batch from construction."""
    p = Params(**job["params"])
    constructed = time.perf_counter()
    loader = system.build(Path(job["corpus"]), Path(job["store"]), p, job["workers"])
    setup_s = time.perf_counter() - constructed
    windows = batches = 0
    first_at, full = 0.0, True
    started = time.perf_counter()
    for batch in start_epoch(loader):
        x = batch_array(batch)
        first_at = first_at or time.perf_counter()
        windows += int(x.shape[0])
        batches += 1
        float(x[0, 0, 0])
        if time.perf_counter() - started >= job["seconds"]:
            full = False
            break
    seconds = time.perf_counter() - started
    return {"windows_per_s": windows / max(seconds, 1e-9), "windows": windows, "batches": batches,
            "seconds": seconds, "setup_s": setup_s, "first_batch_s": (first_at or time.perf_counter()) - constructed,
            "full_epoch": full}


def measure_feed(system: System | None, job: dict[str, Any]) -> dict[str, Any]:
    """ms per simulated training step (gpu_feed.py's), fed by the system or preallocated (floor)."""
    import gpu_feed  # noqa: PLC0415

    p = Params(**job["params"])
    gp = gpu_feed.Params(window=p.window, stride=p.stride, batch_size=p.batch_size, seed=p.seed,
                         steps=job["steps"], warmup=job["warmup"], device="cpu")
    if system is None:
        batches = gpu_feed.floor_batches(gp)
    else:
        batches = gpu_feed.batches_forever(system.build(Path(job["corpus"]), Path(job["store"]), p,
                                                        job["workers"]))
    return gpu_feed.time_steps(gpu_feed.simulated_step, batches, gp)


def prepare(system: System, job: dict[str, Any]) -> dict[str, Any]:
    """Convert the corpus into the system's format; seconds taken and bytes it then reads."""
    corpus, store = Path(job["corpus"]), Path(job["store"])
    started = time.perf_counter()
    system.prepare(corpus, store, Params(**job["params"]))
    return {"prepare_s": time.perf_counter() - started, "disk_bytes": data_bytes(system, corpus, store)}


def data_bytes(system: System, corpus: Path, store: Path) -> int:
    """Bytes on disk of what the system reads."""
    return tree_bytes(system.disk(corpus, store))


# =========================================================================== checks


@dataclass
class RankRun:
    """What one simulated rank yielded: batch digests, window keys, and its state when it stopped."""

    digests: list[str]
    keys: list[bytes]
    state: bytes | None


def run_world(system: System, job: dict[str, Any], world: int, *, stop: int | None = None,
              states: list[bytes | None] | None = None, timeout: float = 900.0) -> list[RankRun]:
    """Run every rank of ``world`` at once, one forked process each, as torchrun would on one node.

    Rank r loads ``states[r]`` (if given), yields ``stop`` batches or its epoch, and reports them;
    a rank that raises, or a world that does not finish in ``timeout``, raises RuntimeError."""
    ctx = multiprocessing.get_context("fork")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    pipes, procs = [], []
    for rank in range(world):
        mine, theirs = ctx.Pipe(duplex=False)
        state = None if states is None else states[rank]
        proc = ctx.Process(target=_rank_main, args=(theirs, system, job, world, rank, stop, state), daemon=True)
        proc.start()
        pipes.append(mine)
        procs.append(proc)
    try:
        return [_receive(pipe, proc, rank, timeout) for rank, (pipe, proc) in enumerate(zip(pipes, procs))]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()


def _receive(pipe: Any, proc: Any, rank: int, timeout: float) -> RankRun:
    """One rank's report (or its error)."""
    if not pipe.poll(timeout):
        raise RuntimeError(f"rank {rank} did not finish in {timeout:.0f} s")
    try:
        kind, payload = pickle.loads(pipe.recv_bytes())
    except EOFError:
        raise RuntimeError(f"rank {rank} died (exit {proc.exitcode})") from None
    if kind == "error":
        raise RuntimeError(f"rank {rank}: {payload}")
    return payload


def _free_port() -> int:
    """A free TCP port on loopback (for peers that rendezvous over torch.distributed)."""
    import socket  # noqa: PLC0415

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(pipe: Any, system: System, job: dict[str, Any], world: int, rank: int, stop: int | None,
               state: bytes | None) -> None:
    """A simulated rank's process: torchrun's environment, build, load, run, report, leave."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        report = ("ok", run_rank(system, job, world, rank, stop=stop, state=state))
    except BaseException as e:  # noqa: BLE001 - reported to the parent as the verdict's reason
        report = ("error", f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    pipe.send_bytes(pickle.dumps(report))
    pipe.close()
    os._exit(0)


def run_rank(system: System, job: dict[str, Any], world: int, rank: int, *, stop: int | None = None,
             state: bytes | None = None) -> RankRun:
    """Build rank ``rank`` of ``world`` on the check corpus (in-process: num_workers=0), load
    ``state``, take ``stop`` batches or the epoch; then the loader's state (None if it has none)."""
    p = Params(**job["params"])
    loader = system.build(Path(job["check_corpus"]), Path(job["check_store"]), p, 0, rank, world)
    if state is not None:
        system.load(loader, pickle.loads(state))
    digests: list[str] = []
    keys: list[bytes] = []
    for batch in start_epoch(loader):
        x = batch_array(batch)
        digests.append(digest(x))
        keys.extend(window_keys(x))
        if stop is not None and len(digests) >= stop:
            break
    saved = system.state(loader) if stop is not None else None
    return RankRun(digests, keys, None if saved is None else pickle.dumps(saved))


def check_exact(system: System, job: dict[str, Any]) -> str:
    """Resume mid-epoch: the rest after a pickled state equals the uninterrupted rest, by content."""
    full = run_world(system, job, 1)[0].digests
    k = max(1, len(full) // 3)
    state = run_world(system, job, 1, stop=k)[0].state
    rest = run_world(system, job, 1, states=[state])[0].digests
    if rest == full[k:]:
        return f"yes ({len(rest)} batches after {k} equal)"
    same = sum(a == b for a, b in zip(rest, full[k:]))
    why = "no state_dict: a new loader restarts the epoch; " if state is None else ""
    return f"no: {why}{same} of {len(full) - k} batches after {k} equal ({len(rest)} yielded)"


def check_elastic(system: System, job: dict[str, Any]) -> str:
    """2 ranks -> 3: over both runs fewer than (2 + 3) x batch windows twice (padding) and fewer lost (drop)."""
    p = Params(**job["params"])
    total = expected_windows(job)
    k = max(1, total // (OLD_WORLD * p.batch_size) // 3)
    old = run_world(system, job, OLD_WORLD, stop=k)
    new = run_world(system, job, NEW_WORLD, states=[old[r % OLD_WORLD].state for r in range(NEW_WORLD)])
    before = [key for run in old for key in run.keys]
    after = [key for run in new for key in run.keys]
    unique = len(set(before + after))
    twice, lost = len(before) + len(after) - unique, total - unique
    allowed = (OLD_WORLD + NEW_WORLD) * p.batch_size  # one partial batch per rank of each plan
    counts = f"{twice:,} twice, {lost:,} of {total:,} lost ({len(before):,} before, {len(after):,} after)"
    no_state = "no state_dict: new ranks restart the epoch; " if old[0].state is None else ""
    if twice < allowed and 0 <= lost < allowed:  # repeated (pad) or dropped to equalize steps
        return f"yes ({counts})"
    return f"no: {no_state}{counts}"


def check_equal(system: System, job: dict[str, Any]) -> str:
    """2 ranks over the skewed corpus (lengths 200..20,000): the same number of batches each."""
    counts = [len(run.digests) for run in run_world(system, job, OLD_WORLD)]
    if len(set(counts)) == 1:
        return f"yes ({counts[0]} batches per rank)"
    return "no: " + " vs ".join(str(c) for c in counts) + " batches"


def expected_windows(job: dict[str, Any]) -> int:
    """Windows of one epoch of the check corpus (from its spec)."""
    import json  # noqa: PLC0415

    spec = data.CorpusSpec(**json.loads((Path(job["check_corpus"]) / data.MARKER).read_text())["spec"])
    lengths = data.sequence_lengths(spec.n_seqs, spec.min_len, spec.max_len, spec.seed)
    p = Params(**job["params"])
    return data.count_windows(lengths, p.window, p.stride)


CHECKS = {"exact_resume": check_exact, "elastic_resume": check_elastic, "equal_steps": check_equal}


def run_checks(system: System, job: dict[str, Any]) -> dict[str, Any]:
    """Every check; one that raises is a "no" naming the exception (the capability failed)."""
    out: dict[str, Any] = {}
    for name, check in CHECKS.items():
        started = time.perf_counter()
        try:
            out[name] = check(system, job)
        except Exception as e:  # noqa: BLE001 - a peer's own error is the verdict
            out[name] = f"no: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            out[f"{name}_traceback"] = traceback.format_exc()[-1500:]
        out[f"{name}_s"] = time.perf_counter() - started
    return out


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Dispatch one job to its measurement; the record the parent prints."""
    kind = job["kind"]
    system = None if job["system"] == "floor" else system_named(job["system"])
    if system is not None:
        system.preload()
    if kind == "prepare":
        return prepare(system, job)
    if kind == "rate":
        return measure_rate(system, job)
    if kind == "feed":
        return measure_feed(system, job)
    if kind == "checks":
        return run_checks(system, job)
    raise ValueError(f"unknown job kind {kind!r}")
