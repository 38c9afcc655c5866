"""benchmarks/peers.py: a --quick run on a tiny corpus prints one JSON line per case and a table whose
check columns hold verdicts the run reached; peers this venv lacks are skipped with an install line."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import data  # noqa: E402

SCRIPT = os.path.join(ROOT, "benchmarks", "peers.py")
SYSTEMS = ["streamwin", "webdataset", "tutorial", "torchdata-nodes"]
ABSENT = "mosaic"  # not in the dev extras (hf-arrow is: datasets comes with [hf]): skipped with its install line
CHECKS = ("exact_resume", "elastic_resume", "equal_steps")
SMOKE_TIMEOUT = 120  # seconds; ~25-35 s on 2 cores


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """60 sequences of the benchmark recipe in 1 MB shards (about 8 MB, ~2,800 windows)."""
    spec = data.CorpusSpec(n_seqs=60, shard_bytes=1 << 20)
    return str(data.write_corpus(tmp_path_factory.mktemp("peers") / "corpus", spec, log=lambda _: None))


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory) -> tuple[subprocess.CompletedProcess, str]:
    """One quick run of four systems (plus one that may be absent): rates in-process, the feed with 1 worker."""
    out = tmp_path_factory.mktemp("peers-out")
    cmd = [sys.executable, SCRIPT, "--quick", "--data", corpus, "--check-data", corpus,
           "--store", str(out / "store"), "--out", str(out / "peers.json"), "--systems", *SYSTEMS, ABSENT,
           "--workers", "0", "--batch-size", "64", "--seconds", "1", "--steps", "20"]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=SMOKE_TIMEOUT, cwd=ROOT)
    print(f"smoke run took {time.perf_counter() - started:.1f}s")
    return done, str(out)


def records(stdout: str) -> list[dict]:
    """The JSON lines the run printed."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_every_case_prints_a_json_line(run):
    done, _ = run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    recs = records(done.stdout)
    for system in SYSTEMS:
        for workers in (0,):
            rate = [r for r in recs if (r["kind"], r["system"], r["workers"]) == ("rate", system, workers)]
            assert len(rate) == 1 and rate[0]["windows_per_s"] > 0, (system, workers, rate)
            assert rate[0]["peak_pss_mb"] > 0
        feed = [r for r in recs if (r["kind"], r["system"]) == ("feed", system)]
        assert len(feed) == 1 and feed[0]["step_ms"] > 0, feed
    assert any(r["kind"] == "feed" and r["system"] == "floor" for r in recs)


def test_each_check_holds_a_verdict_it_reached(run):
    done, _ = run
    recs = {r["system"]: r for r in records(done.stdout) if r["kind"] == "checks"}
    assert set(SYSTEMS) <= set(recs), recs.keys()
    for system in SYSTEMS:
        for check in CHECKS:
            verdict = recs[system][check]
            assert verdict.split(":")[0].split(" (")[0] in ("yes", "no", "n/a"), (system, check, verdict)
    assert recs["streamwin"]["exact_resume"].startswith("yes"), recs["streamwin"]
    # webdataset has no state: the check must see the restart, not take it on trust
    assert recs["webdataset"]["exact_resume"].startswith("no: no state_dict"), recs["webdataset"]


def test_a_missing_peer_is_skipped_with_its_install_line(run):
    done, _ = run
    if importlib.util.find_spec("streaming") is not None:  # MosaicML Streaming's module
        pytest.skip(f"{ABSENT} is installed in this venv")
    line = [ln for ln in done.stdout.splitlines() if ln.startswith(f"SKIP {ABSENT}")]
    assert line and "pip install" in line[0], done.stdout[:2000]


def test_the_table_and_files(run):
    done, out = run
    rows = [ln for ln in done.stdout.splitlines() if ln.startswith("| ")]
    assert rows[0].startswith("| system | windows/s w=0 | data-wait w=1 |"), rows[:1]
    for system in SYSTEMS:
        assert any(ln.startswith(f"| {system} |") for ln in rows), system
    saved = json.loads(open(os.path.join(out, "peers.json")).read())
    assert {r["system"] for r in saved["summary"]} == set(SYSTEMS)
    for row in saved["summary"]:  # each feed paired with the floor measured just before it
        assert row["data_wait"] is not None and row["floor_ms"] >= 5.0, row
    with open(os.path.join(out, "peers.png"), "rb") as png:
        assert png.read(4) == b"\x89PNG"


# --------------------------------------------------------------------------- the parts, without a run

BENCH = os.path.join(ROOT, "benchmarks")


def peers_module(name: str):
    """benchmarks/<name>.py imported as the scripts import it (benchmarks/ on sys.path)."""
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    return importlib.import_module(name)


def test_peer_modules_import_one_way_and_stay_small():
    """peers -> peers_child -> peers_formats -> peers_systems (and peers_report): no module imports one
    above it, so no cycle; each <= 400 lines."""
    import ast

    order = ["peers_systems", "peers_report", "peers_formats", "peers_child", "peers"]
    for i, name in enumerate(order):
        src = open(os.path.join(BENCH, f"{name}.py")).read()
        assert src.count("\n") <= 400, (name, src.count("\n"))
        imported = set()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ImportFrom):
                imported.add((node.module or "").split(".")[-1])
            elif isinstance(node, ast.Import):
                imported |= {a.name.split(".")[-1] for a in node.names}
        above = imported & set(order[i:])
        assert not above, f"{name} imports {above}, which import it or come after it"


def test_window_pool_yields_every_window_once_shuffled_in_batches():
    """Every window of every sequence exactly once (by content, against starts computed here), in full
    batches but the last, not in read order; its state is the inner dataset's after the sequences taken."""
    import numpy as np

    systems = peers_module("peers_systems")
    p = data.WindowSetup(window=8, stride=3, batch_size=16, shuffle_buffer=40, seed=1)
    rng = np.random.default_rng(0)
    seqs = [rng.normal(size=(int(n), 2)).astype(np.float32) for n in rng.integers(5, 60, size=30)]
    expected = [s[start:start + 8].tobytes() for s in seqs for start in range(0, len(s) - 8 + 1, 3)]
    states = []
    pool = systems.WindowPool(seqs, p, None, lambda taken: {"taken": taken}, states.append)
    loader = systems.PoolLoader(pool, 0)
    batches = [b.numpy() for b in loader]
    got = [w.tobytes() for b in batches for w in b]
    assert sorted(got) == sorted(expected) and len(got) == len(expected)
    assert got != expected  # shuffled
    assert all(len(b) == 16 for b in batches[:-1]) and 0 < len(batches[-1]) <= 16
    assert loader.state_dict() == {"taken": len(seqs)}
    loader.load_state_dict({"taken": 3})
    assert states == [{"taken": 3}]


def test_the_table_shows_each_peers_faster_setup_and_lists_the_other():
    report = peers_module("peers_report")

    class Setup:
        def __init__(self, name, peer="", setup=""):
            self.name, self.peer, self.setup = name, peer, setup

    rates = {"streamwin": (500e3, 400e3), "mosaic-windows": (3e3, 12e3), "mosaic-seqs": (50e3, 30e3)}
    records = [{"kind": "rate", "system": s, "workers": w, "repeat": 0, "windows_per_s": r[i], "peak_pss_mb": 1.0,
                "first_batch_s": 0.1, "other_cpu_cores": 0.25} for s, r in rates.items() for i, w in enumerate((0, 2))]
    systems = [Setup("streamwin"), Setup("mosaic-windows", "mosaic", "windows"), Setup("mosaic-seqs", "mosaic", "seqs")]
    rows = report.summarize(records, systems, (0, 2), {}, {})
    assert [r["system"] for r in report.shown(rows)] == ["streamwin", "mosaic-seqs"]
    assert [r["system"] for r in report.others(rows)] == ["mosaic-windows"]
    table = report.markdown_table(report.shown(rows), (0, 2))
    assert "| mosaic-seqs | 50,000 | 30,000 |" in table and "mosaic-windows" not in table
    assert table.splitlines()[2].endswith("| 0.25 |")  # others' CPU
