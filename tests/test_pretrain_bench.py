"""benchmarks/pretrain.py: each case's loader runs on a small corpus, and its verdicts are the medians' arithmetic,
recomputed here from records made up for the test (no timing is asserted: targets live in the benchmark)."""
from __future__ import annotations

import os
import statistics
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import data, pretrain  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    spec = data.CorpusSpec(n_seqs=40, min_len=600, max_len=3000, shard_bytes=1 << 20)
    return str(data.write_corpus(tmp_path_factory.mktemp("pretrain_bench") / "corpus", spec, log=lambda _: None))


@pytest.mark.parametrize("case", ["fixed:0", "packed:0", "packed-p1:0"])
def test_each_loader_case_delivers_its_steps(corpus, case):
    import torch

    job = {"kind": "loader", "case": case, "repeat": 0, "data": corpus, "batches": 5, "warmup": 2,
           "steps_per_batch": 8192}
    threads = torch.get_num_threads()
    try:
        rec = pretrain.run_child(job)  # a child sets one torch thread
    finally:
        torch.set_num_threads(threads)
    assert rec["steps_per_s"] > 0 and rec["batches_per_s"] > 0
    # packed: this corpus of ~280 windows over canonical streams leaves a partly filled row a stream (~89%)
    assert rec["fill"] == 1.0 if case.startswith("fixed") else 0.8 < rec["fill"] < 1.0


def test_the_verdicts_are_the_medians_arithmetic():
    step = {"floor": [5.0, 5.2, 5.1], "fixed:1": [5.2, 5.6, 5.3], "packed:1": [5.4, 9.0, 5.35]}
    records = [{"kind": "step", "case": c, "step_ms": ms, "next_wait_ms": 0.1} for c, v in step.items() for ms in v]
    loader = {"fixed:0": 100.0, "packed:0": 50.0, "packed-p1:0": 40.0, "fixed:1": 90.0, "packed:1": 60.0,
              "packed-p1:1": 30.0}
    records += [{"kind": "loader", "case": c, "steps_per_s": v, "batches_per_s": v / 10, "fill": 0.99}
                for c, v in loader.items()]
    lines = "\n".join(pretrain.report(records))
    floor, fixed, packed = (statistics.median(step[c]) for c in ("floor", "fixed:1", "packed:1"))
    assert f"(one worker): {fixed / packed:.2f} (target >= 0.8: met)" in lines
    assert f"one worker: {100 * (1 - floor / packed):.1f}% (target <= 5%: NOT MET)" in lines
    assert "row fill: 99.0% (target >= 97%: met)" in lines
    assert "packed / fixed steps/s: workers 0: 0.50, workers 1: 0.67" in lines
    assert "packed-p1 / fixed steps/s: workers 0: 0.40, workers 1: 0.33" in lines
