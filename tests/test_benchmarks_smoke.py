"""benchmarks/gpu_feed.py: a --quick run on a tiny corpus prints every table (no GPU needed),
and its summary arithmetic (medians, data-wait, target verdicts) matches a reference computed here."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import data, gpu_feed  # noqa: E402

SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_feed.py")
CASES = ["floor", "streamwin:0", "streamwin:1", "streamwin-device:0", "webdataset:1"]
LOADER_CASES = ["streamwin:0", "streamwin:1", "webdataset:1"]
SMOKE_TIMEOUT = 900  # a hang guard, not a speed check: ~20-30 s on 2 idle cores, minutes on busy ones


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """60 sequences of the benchmark recipe in 1 MB shards (about 8 MB)."""
    spec = data.CorpusSpec(n_seqs=60, shard_bytes=1 << 20)
    return str(data.write_corpus(tmp_path_factory.mktemp("gpu_feed") / "corpus", spec, log=lambda _: None))


def test_quick_run_prints_every_case(corpus, tmp_path):
    """The idle model (a step that sleeps 4 ms) through every kind of case: its table row, data-wait, and the
    trainer's CPU per batch measured beside a bare loop in the same process."""
    out = tmp_path / "out"
    cmd = [sys.executable, SCRIPT, "--quick", "--data", corpus, "--out", str(out), "--device", "cpu",
           "--models", "idle", "--cases", *CASES, "--loader-only", *LOADER_CASES, "--steps", "50",
           "--warmup", "5", "--loader-windows", "5000"]
    started = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=SMOKE_TIMEOUT, cwd=ROOT)
    elapsed = time.perf_counter() - started
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    for case in CASES:
        row = [ln for ln in lines if ln.startswith(f"| idle | {case} |")]
        assert len(row) == 1, f"no table row for {case}:\n{run.stdout}"
        assert "n/a" not in row[0] and "error" not in row[0], row[0]
    for case in LOADER_CASES:
        assert sum(ln.startswith(f"| {case} |") for ln in lines) == 1, f"no loader row for {case}:\n{run.stdout}"
    assert any("data-wait of streamwin's best mode" in ln for ln in lines), run.stdout
    assert any("w=1 / w=0" in ln for ln in lines), run.stdout
    assert any("trainer CPU of streamwin:1" in ln for ln in lines), run.stdout

    saved = json.loads((out / "gpu_feed-quick.json").read_text())
    rows = {r["case"]: r for r in saved["summary"] if r["model"] == "idle"}
    floor = rows["floor"]["step_ms"]
    assert floor >= 4.0, f"the idle step sleeps 4 ms, yet took {floor} ms"
    for case in ("streamwin:0", "webdataset:1"):
        assert rows[case]["data_wait"] == pytest.approx(1 - floor / rows[case]["step_ms"])
    assert rows["floor"]["cpu_us"] < 0.5 * 4000, "the idle step sleeps 4 ms: its CPU per step is small"
    for case in CASES[1:]:  # every case: the trainer's CPU per batch beside a bare loop, and its workers'
        assert rows[case]["trainer_cpu_us"] is not None and rows[case]["workers_cpu_us"] is not None
    for case in ("streamwin:0", "streamwin-device:0"):  # in-process: the gather is the trainer's own CPU
        assert rows[case]["trainer_cpu_us"] > 50, rows[case]
    runs = [r for r in saved["runs"] if r.get("model") == "idle" and r.get("case") in CASES]
    assert runs and all(r["trainer_cpu_us"] == pytest.approx(r["cpu_us"] - r["bare_cpu_us"]) for r in runs)
    assert (out / "gpu_feed-quick.png").read_bytes()[:4] == b"\x89PNG"
    print(f"smoke run took {elapsed:.1f}s")


def test_default_cases_follow_the_cores():
    few = gpu_feed.default_cases(cpus=2)
    assert few.run == ["floor", "streamwin:0", "streamwin:1", "streamwin:2", "streamwin:4", "streamwin-device:0",
                       "streamwin-device:1", "webdataset:2"]
    assert few.skipped == ["streamwin:8", "webdataset:8"]
    assert few.loader == ["streamwin:0", "streamwin:1", "streamwin:2", "webdataset:2"]
    many = gpu_feed.default_cases(cpus=16)
    assert many.run == ["floor", "streamwin:0", "streamwin:1", "streamwin:2", "streamwin:4", "streamwin:8",
                        "streamwin-device:0", "streamwin-device:1", "webdataset:8"]
    assert many.skipped == []
    assert many.loader == ["streamwin:0", "streamwin:1", "streamwin:2", "streamwin:8", "webdataset:2"]


@pytest.mark.parametrize("typed", ["streamwin:x", "tfdata:2", "floor:2", "webdataset:-1"])
def test_a_bad_case_names_what_was_typed(typed, capsys):
    with pytest.raises(SystemExit):
        gpu_feed.parse_args(["--cases", typed])
    assert typed in capsys.readouterr().err


def test_summary_is_medians_and_data_wait_against_the_floor():
    steps = {"floor": [5.0, 5.4, 5.2], "streamwin:0": [5.5, 7.0, 5.3], "webdataset:2": [9.0, 8.0, 12.0]}
    records = [{"model": "simulated", "case": case, "step_ms": ms, "windows_per_s": 256e3 / ms,
                "next_wait_ms": ms / 10, "cpu_us": 100 * ms}
               for case, values in steps.items() for ms in values]
    records.append({"model": "simulated", "case": "streamwin-device:0", "na": "TypeError: device"})
    rows = {r["case"]: r for r in gpu_feed.summarize(records)}
    floor = statistics.median(steps["floor"])
    for case in ("streamwin:0", "webdataset:2"):
        step = statistics.median(steps[case])
        assert rows[case]["step_ms"] == step
        assert rows[case]["data_wait"] == pytest.approx(1 - floor / step)
        assert rows[case]["next_wait_ms"] == pytest.approx(step / 10)
        assert rows[case]["trainer_cpu_us"] == pytest.approx(100 * step - 100 * floor)  # against the floor run's
    assert rows["streamwin-device:0"]["na"] == "TypeError: device"
    verdict = gpu_feed.simulated_verdict(list(rows.values()))
    best = 1 - floor / statistics.median(steps["streamwin:0"])
    assert verdict["best_case"] == "streamwin:0"
    assert verdict["best_wait"] == pytest.approx(best)
    assert verdict["met"] is (best <= 0.05)


@pytest.mark.parametrize("model", ["mlp", "small", "medium"])
def test_the_models_train_on_cpu_through_the_gpu_step(model):
    """The CUDA step (autocast bf16, fused AdamW, non_blocking copy) on CPU: loss falls on one batch."""
    import torch

    p = gpu_feed.Params(batch_size=2, window=16, device="cpu")  # the smallest batch that trains: same step path
    step = gpu_feed.model_step(model, p)
    x = torch.randn(p.batch_size, p.window, p.features, generator=torch.Generator().manual_seed(1))
    losses = [step(x).item() for _ in range(5)]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses


SIMULATED_STEP = """
import json, resource, sys, time
import torch
sys.path.insert(0, sys.argv[1])
from benchmarks import gpu_feed
x = torch.ones(2, 16, 8)
before = resource.getrusage(resource.RUSAGE_THREAD)
wall, cpu = time.perf_counter(), time.process_time()
touched = gpu_feed.simulated_step(x)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
after = resource.getrusage(resource.RUSAGE_THREAD)
print(json.dumps([touched, wall, cpu, after.ru_nvcsw - before.ru_nvcsw, after.ru_nivcsw - before.ru_nivcsw]))
"""


def test_the_simulated_step_holds_then_sleeps():
    """4 ms with the interpreter held, then 1 ms asleep: at least 5 ms of wall time; the hold spins (it gives the
    core up only for the 1 ms sleep), so >= 3.5 ms of CPU unless the machine took the core away meanwhile.

    Measured in a process of its own: in one with other Python threads (pytest-xdist's, a test server's), the
    thread waits for the interpreter after its sleep whenever one of them took it meanwhile, a third switch."""
    run = subprocess.run([sys.executable, "-c", SIMULATED_STEP, ROOT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    touched, wall, cpu, gave_up, preempted = json.loads(run.stdout)
    assert touched == 1.0 + 8 * 8  # x[0, 0, 0] plus the sum of x[0, :8] (8 steps x 8 features)
    assert wall >= 0.005 and gave_up <= 1, (wall, gave_up)  # a hold that slept would give the core up twice
    assert cpu >= 0.0035 or preempted, (cpu, preempted)  # on a busy machine, the spin's CPU is what it was given


def test_canonical_waits_prints_both_orders(corpus):
    """benchmarks/canonical_waits.py: ms per step of canonical=None and "auto", side by side, on the tiny corpus."""
    script = os.path.join(ROOT, "benchmarks", "canonical_waits.py")
    run = subprocess.run([sys.executable, script, "--data-dir", corpus, "--workers", "2", "--window", "64",
                          "--step-ms", "0.5", "--steps", "40", "--repeats", "1"], capture_output=True, text=True,
                         timeout=SMOKE_TIMEOUT, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    rows = [ln.split("|")[1].strip() for ln in run.stdout.splitlines() if ln.startswith("| ") and "ms" not in ln]
    assert rows == ["none", "auto"], run.stdout
    assert "| auto | shared batches |" in run.stdout, run.stdout  # 2 workers of 8 slots: each writes 4 slots' rows
    assert 'canonical="auto" steps take' in run.stdout, run.stdout
    mixed = subprocess.run([sys.executable, script, "--data-dir", corpus, "--workers", "2", "--window", "64",
                            "--step-ms", "0", "--steps", "40", "--repeats", "1", "--mix"], capture_output=True,
                           text=True, timeout=SMOKE_TIMEOUT, cwd=ROOT)
    assert mixed.returncode == 0, mixed.stdout + mixed.stderr[-3000:]
    auto = next(ln for ln in mixed.stdout.splitlines() if ln.startswith("| auto |")).split("|")
    assert auto[2].strip().startswith("chunks of") and float(auto[5].replace(",", "")) > 50, mixed.stdout  # PSS MB
