"""benchmarks/elastic.py runs its three cases and reports an elastic resume's rest of the epoch."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_elastic_benchmark_prints_every_case(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "elastic.py"), "--sequences", "30000", "--workers", "1",
           "--root", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["case"]: r for r in json.loads(run.stdout.strip().splitlines()[-1])["rows"]}
    fresh, exact, elastic = rows["fresh epoch"], rows["exact resume (8x8)"], rows["elastic resume (8x8 -> 6x4)"]
    assert "| elastic resume (8x8 -> 6x4) | 6x1 |" in run.stdout
    # half of the 8x8 epoch was taken: the rest, over 6 ranks, is about half of a 6-rank epoch
    assert 0.4 * fresh["batches_left"] <= elastic["batches_left"] <= 0.6 * fresh["batches_left"]
    assert exact["batches_left"] < fresh["batches_left"] and all(r["first_batch_s"] > 0 for r in rows.values())
