"""Does the trainer wait for data? ms per training step fed by streamwin, by webdataset, and by
batches already in place (the floor), in one run (issue #10).

data-wait = 1 - floor / step: the share of a step that the feed adds to the same step fed
preallocated batches. A loader measured alone is not a loader feeding a trainer: in-process
work takes the trainer's interpreter, worker processes pay a hand-off per batch.

Models (``--models``, with CUDA): ``mlp`` (a window MLP forecaster, hidden 512), ``small``
(transformer forecaster d128, 2 layers) and ``medium`` (d256, 4 layers); next-step MSE, bf16
autocast, fused AdamW; each step moves x to the device with non_blocking=True (a no-op when
the loader already delivers device tensors). Simulated models (the default without CUDA; any
device): each step holds the interpreter in a Python loop (a launch-bound step), touches the
batch (one element and a small slice's sum), then sleeps (the device finishing):
  simulated      4 ms held, 1 ms asleep (the small transformer's shape)
  simulated-mlp  1.0 ms held, 0.4 ms asleep (the MLP forecaster's shape: data-hungry)
  idle           0 ms held, 4 ms asleep: a step that uses no CPU, so the trainer process's CPU
                 per step above the floor's is what the feed costs the trainer per batch

Trainer CPU per batch: every run measures ``time.process_time`` (all threads of the trainer
process, its workers excluded) over the timed steps, and the workers' CPU (psutil, children).
With ``idle`` each run alternates blocks of CPU_ROUND steps fed by its case with as many fed
preallocated batches (a bare loop, through the same generator and ``batch_tensor`` as the cases, so the
harness's own per-batch Python is on both sides) in the same process, and "trainer CPU us/batch" is the
difference: the feed's CPU in the trainer, measured beside a bare loop under the same load (the
floor's row shows that difference for two bare loops: the noise). With the other models it is a
run's CPU per step minus the floor run's (medians): noisier, as the runs see different loads.

Cases (``--cases``), each at every model:
  floor                 the same step fed preallocated batches (on the device with CUDA)
  streamwin:N           WindowLoader(ds, num_workers=N, pin_memory=<CUDA>, persistent_workers=N > 0)
  streamwin-device:N    WindowLoader(ds, num_workers=N, device=<--device>, persistent_workers=N > 0)
  streamwin-static:N    the same with static=True (every batch in the same device tensors)
  webdataset:N          baselines' pipeline (decode -> window generator -> shuffle -> batched) in
                        DataLoader(batch_size=None, num_workers=N, pin_memory=<CUDA>, persistent_workers=N > 0)
with ds = WindowDataset(data, window=256, stride=64, batch_size=256, shuffle_buffer=10_000, seed=0).
Loaders loop over epochs (set_epoch each pass), so --steps is never cut short by an epoch. A
loader whose construction raises TypeError (an argument this streamwin lacks) shows as n/a.
Loader alone (``--loader-only``): windows/s of each loader with no model, after --warmup batches.

Defaults leave out worker counts above 2 x cores (listed as skipped; name them in --cases or
--loader-only to run them) and add webdataset:2 on machines with fewer than 8 cores.

Every (model, case, repeat) is a fresh child process (``--child``), so loaders share no state;
repeats are interleaved (A, B, C, A, B, C, ...) so drift hits every case alike; tables show medians.

Targets (issues #10 and #27), printed as met / NOT MET with the numbers:
  simulated trainer (2 cores): data-wait of streamwin's best mode <= 5%, and below webdataset's
  simulated-mlp (2 cores): data-wait of streamwin:1 <= 5% (webdataset's best shown beside)
  idle step: trainer CPU of streamwin:1 <= 25 us per batch above the floor
  loader alone: streamwin w=1 >= 0.6 x w=0 (2 cores); streamwin w=2 >= 3 x webdataset w=2;
                w=8 >= 1M windows/s (16 cores)
  GPU: data-wait <= 3% (small transformer) and <= 10% (MLP) in the default or a one-argument
       mode (streamwin:N or streamwin-device:0)

Usage:
  python benchmarks/gpu_feed.py --quick            # small corpus, few steps, 1 repeat (< 1 minute)
  python benchmarks/gpu_feed.py                    # perf-notes corpus, 3 interleaved repeats
  python benchmarks/gpu_feed.py --models small --cases floor streamwin:0 streamwin:8 --repeats 5
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

try:  # imported as benchmarks.gpu_feed
    from . import data, throughput
    from .children import run_child as run_in_child
except ImportError:  # run as a script: benchmarks/ is on sys.path
    import data
    import throughput
    from children import run_child as run_in_child

REPO = Path(__file__).resolve().parent.parent
SYSTEMS = ("streamwin", "streamwin-device", "streamwin-static", "webdataset")
SIMULATED = "simulated"
#: simulated models: name -> (seconds holding the interpreter, seconds asleep) per step
IDLE = "idle"
SIMULATED_MODELS = {SIMULATED: (0.004, 0.001), "simulated-mlp": (0.001, 0.0004), IDLE: (0.0, 0.004)}
CPU_ROUND = 25  # idle model: steps per block, alternately fed by the case and by preallocated batches
#: name -> (width, layers); layers 0 is the MLP forecaster (width = its hidden size).
MODELS = {"mlp": (512, 0), "small": (128, 2), "medium": (256, 4)}
HOLD_S, SLEEP_S = SIMULATED_MODELS[SIMULATED]  # the simulated step: interpreter held, then asleep
FLOOR_POOL = 8  # preallocated batches the floor cycles through
FLOOR_EPOCH = 512  # the floor's "epoch": FLOOR_POOL batches this many times
MODEL_CASES = ("floor", "streamwin:0", "streamwin:1", "streamwin:2", "streamwin:4", "streamwin:8",
               "streamwin-device:0", "streamwin-device:1", "webdataset:8")
LOADER_CASES = ("streamwin:0", "streamwin:1", "streamwin:2", "streamwin:8", "webdataset:2")
FEW_CORES = 8  # below this many cores webdataset:2 joins the default cases
SIM_WAIT_TARGET = 0.05
MLP_WAIT_TARGET = 0.05  # simulated-mlp, streamwin:1
TRAINER_CPU_TARGET_US = 25.0  # idle step, streamwin:1: trainer CPU per batch above the floor's
W1_VS_W0_TARGET = 0.6
W2_VS_WDS_TARGET = 3.0
W8_TARGET, W8_CORES = 1e6, 16
GPU_WAIT_TARGETS = {"small": 0.03, "mlp": 0.10}


@dataclass(frozen=True)
class Params(data.WindowSetup):
    """What every child runs with: the window setup, the step counts and the device."""

    features: int = 8
    steps: int = 300
    warmup: int = 30
    loader_windows: int = 400_000
    device: str = "cpu"


# =========================================================================== cases


def parse_case(text: str, floor_ok: bool = True) -> tuple[str, int]:
    """``(system, workers)`` of a case name ("floor" -> ("floor", 0)); ValueError naming the text."""
    if text == "floor" and floor_ok:
        return "floor", 0
    system, sep, workers = text.partition(":")
    if system in SYSTEMS and sep and workers.isdigit():
        return system, int(workers)
    forms = "floor, " if floor_ok else ""
    raise ValueError(f"{text!r} is not a case: use {forms}streamwin:N, streamwin-device:N, streamwin-static:N or webdataset:N "
                     "(N = worker processes, 0 or more)")


def _case_arg(text: str) -> str:
    """argparse type for --cases."""
    try:
        parse_case(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _loader_case_arg(text: str) -> str:
    """argparse type for --loader-only (no floor: there is no model)."""
    try:
        parse_case(text, floor_ok=False)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


@dataclass(frozen=True)
class CaseLists:
    """Default cases for a machine: run, and left out because workers > 2 x cores."""

    run: list[str]
    skipped: list[str]
    loader: list[str]
    loader_skipped: list[str]


def default_cases(cpus: int) -> CaseLists:
    """The issue's cases, plus webdataset:2 on few cores, minus worker counts above 2 x cores."""
    cases = list(MODEL_CASES)
    if cpus < FEW_CORES:
        cases.insert(cases.index("webdataset:8"), "webdataset:2")
    fits = [c for c in cases if parse_case(c)[1] <= 2 * cpus]
    loader = [c for c in LOADER_CASES if parse_case(c)[1] <= 2 * cpus]
    return CaseLists(fits, [c for c in cases if c not in fits], loader,
                     [c for c in LOADER_CASES if c not in loader])


# =========================================================================== child side


class Unavailable(Exception):
    """This streamwin cannot build the case's loader (an argument it does not take yet)."""


def make_loader(system: str, workers: int, data_dir: str, p: Params) -> Any:
    """The case's loader: streamwin's WindowLoader or the webdataset pipeline in a DataLoader."""
    cuda = p.device == "cuda"
    persistent = {"persistent_workers": True} if workers > 0 else {}
    if system == "webdataset":
        return _webdataset_loader(workers, data_dir, p, cuda, persistent)
    import streamwin as sw  # noqa: PLC0415

    ds = sw.WindowDataset(data_dir, window=p.window, stride=p.stride, batch_size=p.batch_size,
                          shuffle_buffer=p.shuffle_buffer, seed=p.seed)
    feed = {"device": p.device} if system in ("streamwin-device", "streamwin-static") else {"pin_memory": cuda}
    if system == "streamwin-static":
        feed["static"] = True
    try:
        return sw.WindowLoader(ds, num_workers=workers, **feed, **persistent)
    except TypeError as e:
        raise Unavailable(f"{type(e).__name__}: {e}") from e


def _webdataset_loader(workers: int, data_dir: str, p: Params, cuda: bool, persistent: dict) -> Any:
    """The baselines' webdataset pipeline in a plain DataLoader, as the probe ran it."""
    import webdataset as wds  # noqa: PLC0415

    baselines = throughput.baselines_module()
    shards = data.shard_paths(data_dir)
    dataset = (wds.WebDataset(shards, shardshuffle=len(shards), seed=p.seed, nodesplitter=wds.split_by_node,
                              workersplitter=wds.split_by_worker, empty_check=False)
               .decode().compose(baselines.cut_windows(p.window, p.stride))
               .shuffle(p.shuffle_buffer, seed=p.seed).batched(p.batch_size))
    return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers, pin_memory=cuda,
                                       **persistent)


def batches_forever(loader: Any) -> Iterator[torch.Tensor]:
    """The loader's [B, W, F] tensors, epoch after epoch (set_epoch before each pass)."""
    batch_tensor = throughput.baselines_module().batch_tensor
    epoch = 0
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        count = 0
        for batch in loader:
            count += 1
            yield batch_tensor(batch)
        if not count:
            raise RuntimeError(f"epoch {epoch} yielded no batches: the corpus is too small for this case")
        epoch += 1


def floor_batches(p: Params) -> Iterator[torch.Tensor]:
    """Preallocated batches, already on the device: the feed that costs nothing. Yielded through the cases' own
    path (``batches_forever`` over dicts), so that the trainer CPU above the floor is the loader's, not the harness's."""
    generator = torch.Generator().manual_seed(p.seed)
    pool = [{"x": torch.randn(p.batch_size, p.window, p.features, generator=generator).to(p.device)}
            for _ in range(FLOOR_POOL)]
    return batches_forever(pool * FLOOR_EPOCH)


def simulated_step(x: Any, hold: float = HOLD_S, sleep: float = SLEEP_S) -> float:
    """A launch-bound trainer: hold the interpreter ``hold`` s (4 ms), touch the batch, sleep ``sleep`` s (1 ms)."""
    started = time.perf_counter()
    spins = 0
    while time.perf_counter() - started < hold:
        spins += 1
    touched = float(x[0, 0, 0]) + float(x[0, :8].sum())
    time.sleep(sleep)
    return touched


class MLP(nn.Module):
    """A window MLP forecaster (the data-hungry kind: DLinear / TSMixer-sized), from the probe."""

    def __init__(self, window: int, features: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear((window - 1) * features, hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Forecaster(nn.Module):
    """A causal transformer encoder predicting the next step at every position, from the probe."""

    def __init__(self, features: int, d: int, layers: int):
        super().__init__()
        self.inp = nn.Linear(features, d)
        layer = nn.TransformerEncoderLayer(d, nhead=8, dim_feedforward=4 * d, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)  # unused with norm_first
        self.out = nn.Linear(d, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device, dtype=x.dtype)
        return self.out(self.enc(self.inp(x), is_causal=True, mask=mask))


def model_step(name: str, p: Params) -> Callable[[torch.Tensor], Any]:
    """One optimizer step of model ``name`` (next-step MSE, bf16 autocast, fused AdamW)."""
    if name in SIMULATED_MODELS:
        hold, sleep = SIMULATED_MODELS[name]
        return lambda x: simulated_step(x, hold, sleep)
    torch.manual_seed(p.seed)
    device = torch.device(p.device)
    width, layers = MODELS[name]
    model = (MLP(p.window, p.features, width) if layers == 0 else Forecaster(p.features, width, layers)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(x: torch.Tensor) -> torch.Tensor:
        x = x.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            pred = model(x[:, :-1])
            loss = nn.functional.mse_loss(pred.float(), x[:, -1] if layers == 0 else x[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    return step


def _sync(p: Params) -> None:
    """Wait for the device, so a timing covers the work queued on it."""
    if p.device == "cuda":
        torch.cuda.synchronize()


def children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's live descendants: the loader's workers."""
    import psutil  # noqa: PLC0415

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def time_steps(step: Callable[[Any], Any], batches: Iterator[Any], p: Params) -> dict[str, float]:
    """ms per step over --steps after --warmup steps, the trainer's wait inside next(), and CPU per step:
    the trainer process's (every thread of it) and its workers'."""
    started = time.perf_counter()
    step(next(batches))
    first_step_s = time.perf_counter() - started
    for _ in range(p.warmup - 1):
        step(next(batches))
    _sync(p)
    waited, windows = 0.0, 0
    kids = children_cpu_s()
    cpu0, t0 = time.process_time(), time.perf_counter()
    for _ in range(p.steps):
        before = time.perf_counter()
        x = next(batches)
        waited += time.perf_counter() - before
        windows += int(x.shape[0])
        step(x)
    _sync(p)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    kids = children_cpu_s() - kids
    return {"step_ms": 1000 * seconds / p.steps, "windows_per_s": windows / seconds,
            "next_wait_ms": 1000 * waited / p.steps, "first_step_s": first_step_s,
            "warmup_s": t0 - started, "cpu_us": 1e6 * cpu / p.steps, "workers_cpu_us": 1e6 * kids / p.steps}


def time_cpu(step: Callable[[Any], Any], batches: Iterator[Any], p: Params) -> dict[str, float]:
    """The idle model's run: blocks of CPU_ROUND steps fed by the case, each followed by as many steps fed
    preallocated batches (the bare loop), in this process, so both see the same machine; the trainer process's
    CPU per batch of the case minus the bare loop's (``trainer_cpu_us``), and the times of the case's blocks."""
    bare = floor_batches(p)
    started = time.perf_counter()
    step(next(batches))
    first_step_s = time.perf_counter() - started
    for _ in range(p.warmup - 1):
        step(next(batches))
        step(next(bare))
    kids, fed, plain, seconds, waited, windows = children_cpu_s(), 0.0, 0.0, 0.0, 0.0, 0
    rounds = max(1, p.steps // CPU_ROUND)
    for _ in range(rounds):
        cpu0, t0 = time.process_time(), time.perf_counter()
        for _ in range(CPU_ROUND):
            before = time.perf_counter()
            x = next(batches)
            waited += time.perf_counter() - before
            windows += int(x.shape[0])
            step(x)
        cpu1, t1 = time.process_time(), time.perf_counter()
        for _ in range(CPU_ROUND):
            step(next(bare))
        fed, plain, seconds = fed + cpu1 - cpu0, plain + time.process_time() - cpu1, seconds + t1 - t0
    n = rounds * CPU_ROUND
    return {"step_ms": 1000 * seconds / n, "windows_per_s": windows / seconds, "next_wait_ms": 1000 * waited / n,
            "first_step_s": first_step_s, "cpu_us": 1e6 * fed / n, "bare_cpu_us": 1e6 * plain / n,
            "trainer_cpu_us": 1e6 * (fed - plain) / n, "workers_cpu_us": 1e6 * (children_cpu_s() - kids) / n}


def time_loader(batches: Iterator[Any], p: Params) -> dict[str, float]:
    """Windows/s of the loader alone (one element read per batch) after --warmup batches."""
    started = time.perf_counter()
    next(batches)
    first_batch_s = time.perf_counter() - started
    for _ in range(p.warmup - 1):
        next(batches)
    windows = 0
    t0 = time.perf_counter()
    while windows < p.loader_windows:
        x = next(batches)
        float(x[0, 0, 0])
        windows += int(x.shape[0])
    seconds = time.perf_counter() - t0
    return {"windows_per_s": windows / seconds, "windows": windows, "first_batch_s": first_batch_s}


def run_child(job: dict[str, Any]) -> dict[str, Any]:
    """Measure one (kind, model, case) in this process; the record the parent collects."""
    p = Params(**job["params"])
    if p.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    system, workers = parse_case(job["case"])
    record = {k: job[k] for k in ("kind", "model", "case", "repeat")}
    constructed = time.perf_counter()
    try:
        source = floor_batches(p) if system == "floor" else batches_forever(
            make_loader(system, workers, job["data"], p))
    except Unavailable as e:
        return {**record, "na": str(e)}
    record["setup_s"] = time.perf_counter() - constructed
    if job["kind"] == "loader":
        return {**record, **time_loader(source, p)}
    timer = time_cpu if job["model"] == IDLE else time_steps
    return {**record, **timer(model_step(job["model"], p), source, p)}


def child_main(job_json: str) -> None:
    """Child mode: print the record as the last stdout line and leave without tear-down."""
    record = run_child(json.loads(job_json))
    print(json.dumps(record), flush=True)
    sys.stderr.flush()
    os._exit(0)  # persistent workers and prefetch threads need no orderly shutdown here


# =========================================================================== parent side


def plan_runs(models: Sequence[str], cases: Sequence[str], loader_cases: Sequence[str],
              repeats: int) -> list[dict[str, Any]]:
    """Jobs in run order: one round of every (model, case) and loader case, ``repeats`` times."""
    one_round = ([{"kind": "model", "model": m, "case": c} for m in models for c in cases]
                 + [{"kind": "loader", "model": "-", "case": c} for c in loader_cases])
    return [{**job, "repeat": r} for r in range(repeats) for job in one_round]


def _child_env(streamwin_root: str | None) -> dict[str, str]:
    """The environment of a child: it imports the very streamwin the parent imported."""
    env = dict(os.environ)
    if streamwin_root:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [streamwin_root, env.get("PYTHONPATH")]))
    return env


def run_job(job: dict[str, Any], timeout: float, env: dict[str, str]) -> dict[str, Any]:
    """Run one job in a fresh child process; a crash or timeout gives a record with ``error``."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(job)]
    run = run_in_child(cmd, timeout, cwd=str(REPO), env=env)
    record = run.record or {**{k: job[k] for k in ("kind", "model", "case", "repeat")}, **run.failed()}
    record["other_cpu_cores"] = run.other_cpu_cores
    return record


def _median(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def _group(records: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Records by (model, case), in first-seen order."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rec in records:
        groups.setdefault((rec["model"], rec["case"]), []).append(rec)
    return groups


def _row(model: str, case: str, recs: list[dict[str, Any]], keys: Sequence[str]) -> dict[str, Any]:
    """Medians of ``keys`` over the runs that measured, or why none did (n/a or error)."""
    ok = [r for r in recs if "na" not in r and "error" not in r]
    row: dict[str, Any] = {"model": model, "case": case, "runs": len(recs), "ok": len(ok)}
    if not ok:
        failed = recs[-1]
        row.update({k: failed[k] for k in ("na", "error", "stderr_tail") if k in failed})
        return row
    return {**row, **{k: _median(ok, k) for k in keys}}


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, case): median ms/step, windows/s and next() wait, and data-wait vs the floor."""
    keys = ("step_ms", "windows_per_s", "next_wait_ms", "first_step_s", "other_cpu_cores", "cpu_us",
            "workers_cpu_us", "trainer_cpu_us")
    rows = [_row(m, c, recs, keys) for (m, c), recs in _group(records).items()]
    floors = {r["model"]: r for r in rows if r["case"] == "floor"}
    for row in rows:
        floor = floors.get(row["model"], {})
        step, cpu, floor_ms, floor_cpu = row.get("step_ms"), row.get("cpu_us"), floor.get("step_ms"), floor.get("cpu_us")
        mine = row["case"] != "floor"
        row["data_wait"] = 1 - floor_ms / step if floor_ms and step and mine else None
        if row.get("trainer_cpu_us") is None:  # not measured beside a bare loop in its process: against the floor's
            row["trainer_cpu_us"] = cpu - floor_cpu if cpu is not None and floor_cpu is not None and mine else None
    return rows


def summarize_loader(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per loader case: median windows/s and first-batch time with no model."""
    keys = ("windows_per_s", "first_batch_s", "other_cpu_cores")
    return [_row(m, c, recs, keys) for (m, c), recs in _group(records).items()]


# --------------------------------------------------------------------------- targets


def _verdict(target: str, value: str, met: bool | None, note: str = "") -> dict[str, Any]:
    return {"target": target, "value": value, "met": met, "note": note}


def _best(rows: list[dict[str, Any]], model: str, accept: Callable[[str], bool]) -> dict[str, Any] | None:
    """The row of ``model`` with the least data-wait among the cases ``accept`` admits."""
    candidates = [r for r in rows if r["model"] == model and r.get("data_wait") is not None and accept(r["case"])]
    return min(candidates, key=lambda r: r["data_wait"], default=None)


def simulated_verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Simulated trainer: streamwin's best data-wait <= 5% and below webdataset's best."""
    target = f"simulated trainer: data-wait of streamwin's best mode <= {SIM_WAIT_TARGET:.0%} and below webdataset's"
    sw = _best(rows, SIMULATED, lambda c: c.startswith("streamwin"))
    wds = _best(rows, SIMULATED, lambda c: c.startswith("webdataset"))
    if sw is None:
        return {**_verdict(target, "streamwin not measured", None), "best_case": None, "best_wait": None}
    value = f"{sw['case']} {sw['data_wait']:.1%}"
    if wds is None:
        met, note = None, "webdataset not measured"
    else:
        value += f" vs {wds['case']} {wds['data_wait']:.1%}"
        met, note = sw["data_wait"] <= SIM_WAIT_TARGET and sw["data_wait"] < wds["data_wait"], ""
    return {**_verdict(target, value, met, note), "best_case": sw["case"], "best_wait": sw["data_wait"]}


def mlp_verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """simulated-mlp: data-wait of streamwin:1 <= 5%, webdataset's best beside it."""
    target = f"simulated-mlp: data-wait of streamwin:1 <= {MLP_WAIT_TARGET:.0%} (webdataset beside)"
    row = next((r for r in rows if r["model"] == "simulated-mlp" and r["case"] == "streamwin:1"), None)
    if row is None or row.get("data_wait") is None:
        return _verdict(target, "not measured", None)
    wds = _best(rows, "simulated-mlp", lambda c: c.startswith("webdataset"))
    beside = f" vs {wds['case']} {wds['data_wait']:.1%}" if wds else ""
    return _verdict(target, f"{row['data_wait']:.1%}{beside}", row["data_wait"] <= MLP_WAIT_TARGET)


def cpu_verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """idle step: the trainer process's CPU per batch with streamwin:1, above the floor's, <= 25 us."""
    target = f"idle step: trainer CPU of streamwin:1 <= {TRAINER_CPU_TARGET_US:g} us/batch above the floor"
    row = next((r for r in rows if r["model"] == "idle" and r["case"] == "streamwin:1"), None)
    if row is None or row.get("trainer_cpu_us") is None:
        return _verdict(target, "not measured", None)
    return _verdict(target, f"{row['trainer_cpu_us']:.1f} us", row["trainer_cpu_us"] <= TRAINER_CPU_TARGET_US)


def _one_argument_mode(case: str) -> bool:
    """WindowLoader(ds) plus at most one argument: num_workers=N, or device= alone (one worker, the default)."""
    system, workers = parse_case(case)
    return system == "streamwin" or (system == "streamwin-device" and workers == 1)


def gpu_verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """GPU: data-wait of the best default or one-argument streamwin mode, per model with a target."""
    verdicts = []
    for model, limit in GPU_WAIT_TARGETS.items():
        target = f"GPU, {model}: data-wait <= {limit:.0%} in the default or a one-argument mode"
        best = _best(rows, model, _one_argument_mode)
        if best is None:
            verdicts.append(_verdict(target, "not measured", None))
        else:
            verdicts.append(_verdict(target, f"{best['case']} {best['data_wait']:.1%}", best["data_wait"] <= limit))
    return verdicts


def _rate(rows: list[dict[str, Any]], case: str) -> float | None:
    return next((r.get("windows_per_s") for r in rows if r["case"] == case), None)


def _ratio_verdict(target: str, num: float | None, den: float | None, limit: float, note: str) -> dict[str, Any]:
    if not num or not den:
        return _verdict(target, "not measured", None, note)
    return _verdict(target, f"{num:,.0f} / {den:,.0f} = {num / den:.2f}x", num / den >= limit, note)


def loader_verdicts(rows: list[dict[str, Any]], cpus: int) -> list[dict[str, Any]]:
    """Loader alone: w=1 vs w=0, streamwin w=2 vs webdataset w=2, and w=8 vs 1M windows/s."""
    cores = f"this machine has {cpus} cores"
    verdicts = [
        _ratio_verdict(f"loader alone: streamwin w=1 / w=0 >= {W1_VS_W0_TARGET:g} (on 2 cores)",
                       _rate(rows, "streamwin:1"), _rate(rows, "streamwin:0"), W1_VS_W0_TARGET, cores),
        _ratio_verdict(f"loader alone: streamwin w=2 / webdataset w=2 >= {W2_VS_WDS_TARGET:g}",
                       _rate(rows, "streamwin:2"), _rate(rows, "webdataset:2"), W2_VS_WDS_TARGET, ""),
    ]
    w8 = _rate(rows, "streamwin:8")
    target = f"loader alone: streamwin w=8 >= {W8_TARGET / 1e6:g}M windows/s (on {W8_CORES} cores)"
    verdicts.append(_verdict(target, "not measured" if not w8 else f"{w8:,.0f}",
                             None if not w8 else w8 >= W8_TARGET, cores))
    return verdicts


# --------------------------------------------------------------------------- report


def _cell(text: str) -> str:
    """Text made safe for a markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _failure(row: dict[str, Any]) -> str | None:
    if "na" in row:
        return f"n/a: {_cell(row['na'])}"
    if "error" in row:
        return f"error: {row['error']} (stderr below)"
    return None


def step_table(rows: list[dict[str, Any]], skipped: list[tuple[str, str]]) -> str:
    """Rows model x case: ms/step, data-wait, windows/s, next() wait; then skipped cases."""
    lines = ["| model | case | ms/step | data-wait | windows/s | next() wait ms/step | trainer CPU us/batch "
             "(above floor) | workers CPU us/batch |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        failed = _failure(r)
        if failed:
            lines.append(f"| {r['model']} | {r['case']} | {failed} | | | | | |")
            continue
        floor = r["case"] == "floor"
        wait = "(floor)" if floor else _fmt(r["data_wait"], ".1%")
        cpu = f"({_fmt(r.get('cpu_us'), '.0f')} per step)" if floor and r["model"] != IDLE else \
            _fmt(r.get("trainer_cpu_us"), ".1f")
        lines.append(f"| {r['model']} | {r['case']} | {r['step_ms']:.2f} | {wait} | "
                     f"{_fmt(r['windows_per_s'], ',.0f')} | {_fmt(r['next_wait_ms'], '.2f')} | {cpu} | "
                     f"{_fmt(r.get('workers_cpu_us'), '.0f')} |")
    lines += [f"| {model} | {case} | skipped: {skip_reason()} | | | | | |" for model, case in skipped]
    return "\n".join(lines)


def loader_table(rows: list[dict[str, Any]], skipped: list[str]) -> str:
    """Loader alone: windows/s and first-batch time per case."""
    lines = ["| loader | windows/s | first batch s |", "|---|---:|---:|"]
    for r in rows:
        failed = _failure(r)
        lines.append(f"| {r['case']} | {failed} | |" if failed else
                     f"| {r['case']} | {r['windows_per_s']:,.0f} | {_fmt(r['first_batch_s'], '.2f')} |")
    lines += [f"| {case} | skipped: {skip_reason()} | |" for case in skipped]
    return "\n".join(lines)


def skip_reason() -> str:
    """Why a default case was left out on this machine."""
    return f"workers > 2 x {os.cpu_count()} cores (name it to run it)"


def verdict_lines(verdicts: list[dict[str, Any]]) -> list[str]:
    """One line per target: met / NOT MET / not judged, with the numbers."""
    lines = []
    for v in verdicts:
        word = {True: "met", False: "NOT MET", None: "not judged"}[v["met"]]
        note = f" ({v['note']})" if v["note"] else ""
        lines.append(f"- {v['target']}: {v['value']} -> {word}{note}")
    return lines


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Bar chart of data-wait per case (x) and model (bars); n/a and errors labelled."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    models = list(dict.fromkeys(r["model"] for r in rows))
    cases = list(dict.fromkeys(r["case"] for r in rows if r["case"] != "floor"))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(cases) + 2), 4.5))
    width = 0.8 / max(1, len(models))
    for i, model in enumerate(models):
        found = {r["case"]: r for r in rows if r["model"] == model}
        waits = [found.get(c, {}).get("data_wait") for c in cases]
        xs = [j + (i - (len(models) - 1) / 2) * width for j in range(len(cases))]
        bars = ax.bar(xs, [100 * (w or 0.0) for w in waits], width, label=model)
        ax.bar_label(bars, labels=["n/a" if w is None else f"{100 * w:.0f}%" for w in waits], fontsize=7)
    ax.axhline(0, color="k", linewidth=0.8)
    ax.set_xticks(range(len(cases)), cases, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("data-wait, % of step (1 - floor / step)")
    ax.set_title("\n".join(textwrap.wrap(title, 100)), fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment(device: str) -> dict[str, Any]:
    """throughput's versions and machine facts, plus the GPU's name."""
    env = throughput.environment()
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


# --------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--data", type=Path,
                        help="packed corpus (default: bench_data/full, or quick; written if missing)")
    parser.add_argument("--quick", action="store_true", help="quick corpus, 60 steps, 1 repeat (< 1 minute)")
    parser.add_argument("--models", nargs="+", choices=[*MODELS, *SIMULATED_MODELS],
                        help="with CUDA (default mlp small medium); simulated ones anywhere (the default "
                             "without CUDA: simulated simulated-mlp idle)")
    parser.add_argument("--cases", nargs="*", type=_case_arg, help="default: the issue's cases for this machine")
    parser.add_argument("--loader-only", nargs="*", type=_loader_case_arg,
                        help="loaders timed alone (default streamwin:0 :1 :2 :8 webdataset:2; none if given empty)")
    parser.add_argument("--steps", type=int, help="timed steps per run (default 300; --quick 60)")
    parser.add_argument("--warmup", type=int, help="untimed steps (or batches) first (default 30; --quick 10)")
    parser.add_argument("--repeats", type=int, help="interleaved runs per case (default 3; --quick 1)")
    parser.add_argument("--loader-windows", type=int,
                        help="windows timed per loader-alone run (default 400,000; --quick 30,000)")
    parser.add_argument("--out", type=Path, help="folder for the JSON and PNG (default bench_data/gpu_feed/)")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--stride", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--shuffle-buffer", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per child run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("steps", "warmup", "repeats", "loader_windows"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} {value}: must be at least 1")
    return args


def _device(requested: str | None) -> str:
    """cuda when asked for or available; asking for it where there is none is an error."""
    available = torch.cuda.is_available()
    if requested == "cuda" and not available:
        raise SystemExit("--device cuda: torch.cuda.is_available() is False on this machine")
    return requested or ("cuda" if available else "cpu")


def _features(data_dir: Path) -> int:
    """Features per step recorded in a benchmark corpus's marker (8 when it has none)."""
    try:
        return int(json.loads((data_dir / data.MARKER).read_text())["spec"]["features"])
    except (OSError, ValueError, KeyError):
        return 8


def _corpus(args: argparse.Namespace) -> Path:
    """The corpus directory: --data as given, else the default one, written if missing."""
    if args.data is not None:
        if not data.shard_paths(args.data):
            raise SystemExit(f"--data {args.data}: no *.tar shards there (write one with benchmarks/data.py)")
        return args.data.resolve()
    spec = data.CorpusSpec.quick() if args.quick else data.CorpusSpec()
    return data.write_corpus(data.default_dir(spec), spec)


def _params(args: argparse.Namespace, device: str, data_dir: Path) -> Params:
    quick = args.quick
    return Params(window=args.window, stride=args.stride, batch_size=args.batch_size,
                  shuffle_buffer=args.shuffle_buffer, seed=args.seed, features=_features(data_dir),
                  steps=args.steps or (60 if quick else 300), warmup=args.warmup or (10 if quick else 30),
                  loader_windows=args.loader_windows or (30_000 if quick else 400_000), device=device)


def _selection(args: argparse.Namespace, device: str) -> tuple[list[str], CaseLists]:
    """Models and cases to run (explicit ones as named, defaults for this machine otherwise)."""
    models = args.models or ([*MODELS] if device == "cuda" else [*SIMULATED_MODELS])
    real = [m for m in models if m not in SIMULATED_MODELS]
    if device != "cuda" and real:
        print(f"NOTE: no CUDA: --models {' '.join(real)} ignored, only simulated models run", flush=True)
        models = [m for m in models if m in SIMULATED_MODELS] or [*SIMULATED_MODELS]
    defaults = default_cases(os.cpu_count() or 1)
    run = args.cases if args.cases is not None else defaults.run
    loader = args.loader_only if args.loader_only is not None else defaults.loader
    return models, CaseLists(run, defaults.skipped if args.cases is None else [], loader,
                             defaults.loader_skipped if args.loader_only is None else [])


def _run_all(jobs: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    """Run every job in order with a progress bar on stderr."""
    try:  # a plain line now and then in a log, a bar redrawn in place on a terminal
        from streamwin.progress import progress_bar  # noqa: PLC0415
    except ImportError:  # a streamwin without it: tqdm's own, off where stderr is no terminal
        from tqdm import tqdm  # noqa: PLC0415

        def progress_bar(iterable, **kw):
            return tqdm(iterable, disable=None, dynamic_ncols=True, **kw)

    api = data.streamwin_api()
    env = _child_env(str(Path(api.__file__).resolve().parent.parent) if api else None)
    records = []
    with progress_bar(jobs, desc="gpu_feed", unit="run", file=sys.stderr) as bar:
        for job in bar:
            bar.set_postfix_str(f"{job['model']} {job['case']} #{job['repeat'] + 1}")
            rec = run_job(job, timeout, env)
            records.append(rec)
            got = rec.get("na") or rec.get("error") or (
                f"{rec['step_ms']:.2f} ms/step" if "step_ms" in rec else f"{rec['windows_per_s']:,.0f} windows/s")
            bar.write(f"  {job['kind']:<6} {job['model']:<9} {job['case']:<20} {got}", file=sys.stderr)
    return records


def report(records: list[dict[str, Any]], models: list[str], cases: CaseLists, header: str) -> dict[str, Any]:
    """Print the tables and target verdicts; return what the JSON file keeps."""
    rows = summarize([r for r in records if r["kind"] == "model"])
    loader_rows = summarize_loader([r for r in records if r["kind"] == "loader"])
    cpus = os.cpu_count() or 1
    verdicts = [simulated_verdict(rows), mlp_verdict(rows), cpu_verdict(rows), *loader_verdicts(loader_rows, cpus),
                *gpu_verdicts(rows)]
    print(f"# gpu_feed: {header}\n")
    print(step_table(rows, [(m, c) for m in models for c in cases.skipped]))
    print("\nLoader alone (no model):\n")
    print(loader_table(loader_rows, cases.loader_skipped))
    print("\nTargets (issues #10 and #27):")
    print("\n".join(verdict_lines(verdicts)))
    heavy = [c for c in cases.run + cases.loader if parse_case(c)[1] > 2 * cpus]
    if heavy:
        print(f"NOTE: {', '.join(dict.fromkeys(heavy))}: more workers than 2 x {cpus} cores: "
              "this machine is oversubscribed")
    busy = throughput.busy_warning(records)
    if busy:
        print(busy)
    for r in rows + loader_rows:
        if "error" in r:
            print(f"\n{r['model']} {r['case']} failed ({r['error']}):\n{r.get('stderr_tail', '')}")
    return {"summary": rows, "loader": loader_rows, "verdicts": verdicts}


def _header(p: Params, data_dir: Path, models: list[str], repeats: int) -> str:
    trainer = "models " + ", ".join(
        f"{m} ({SIMULATED_MODELS[m][0] * 1e3:g} ms held + {SIMULATED_MODELS[m][1] * 1e3:g} ms asleep)"
        if m in SIMULATED_MODELS else m for m in models) + f" on {p.device}"
    return (f"{data_dir.name} ({len(data.shard_paths(data_dir))} shards), W={p.window} stride={p.stride} "
            f"batch={p.batch_size} shuffle={p.shuffle_buffer}; {trainer}; {p.steps} steps after {p.warmup} "
            f"warm-up; median of {repeats} interleaved; {os.cpu_count()} cores")


def parent_main(args: argparse.Namespace) -> int:
    """Run every case in children, print the tables and verdicts, save JSON and PNG."""
    device = _device(args.device)
    data_dir = _corpus(args)
    p = _params(args, device, data_dir)
    models, cases = _selection(args, device)
    repeats = args.repeats or (1 if args.quick else 3)
    header = _header(p, data_dir, models, repeats)
    throughput.baselines_module().read_limit(data.shard_paths(data_dir), min_seconds=0.0)  # warm the page cache
    common = {"params": asdict(p), "data": str(data_dir)}
    jobs = [{**job, **common} for job in plan_runs(models, cases.run, cases.loader, repeats)]
    records = _run_all(jobs, args.timeout)
    print()
    summary = report(records, models, cases, header)
    out = args.out or REPO / "bench_data" / "gpu_feed"
    stem = "gpu_feed-quick" if args.quick else "gpu_feed"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(
        {"setup": {**common, "models": models, "cases": asdict(cases), "repeats": repeats, "header": header},
         "environment": environment(device), **summary, "runs": records}, indent=1))
    plot(summary["summary"], out / f"{stem}.png", f"data-wait per case — {header}")
    print(f"\nwrote {out / (stem + '.json')} and {out / (stem + '.png')}")
    return 1 if any("error" in r for r in records) else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args.child)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
