"""benchmarks/longseq.py: a run on a small long sequence prints a row per case, with no error."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_small_run_prints_every_case(tmp_path):
    out = tmp_path / "data"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "longseq.py"), "--sizes", "2",
                          "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| 2 MB")]
    assert len(rows) == 6 and not any("error" in r for r in rows), run.stdout
    for r in rows:
        ratio = float(r.split("|")[6])
        assert 0.9 <= ratio <= 1.25, r
    assert not out.exists()  # the datasets are removed
