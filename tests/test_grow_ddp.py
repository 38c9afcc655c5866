"""A dataset that grows under a real DDP job (issue 44): torchrun, 2 ranks, gloo, an all_reduce every step.

The job saves every rank's state mid-way through epoch 0 and goes on; the dataset is then appended
to and extended; a second job resumes from those states. Its rest of epoch 0 must be the first job's,
step for step (the data it was planned on), and its epoch 1 the grown dataset: every window one of
the corpus's (tests/grow_cases.py), at most once, new sequences and new steps among them.
"""
from __future__ import annotations

import grow_cases as gc
import streamwin as sw
from conftest import reference_windows
from test_ddp import torchrun, windows

W, S = 16, 8


def test_a_job_resumed_after_its_dataset_grew_finishes_its_epoch_then_reads_the_grown_one(tmp_path):
    full = gc.corpus(seed=31, n=40)
    first, *growth = gc.stages(full)
    url = str(tmp_path / "ds")
    sw.pack([(k, a, m) for k, a, m in first], url, shard_bytes=6000, progress=False)
    before = torchrun(2, url, tmp_path / "before", "--workers", "1", "--save-at", "3")
    n = before[0]["len"]
    for items in growth:
        sw.pack([(k, a) if m is None else (k, a, m) for k, a, m in items], url, shard_bytes=6000, progress=False,
                mode="extend")
    after = torchrun(2, url, tmp_path / "after", "--workers", "1", "--resume", str(tmp_path / "before" / "at3"))
    for b, a in zip(before, after):
        assert a["records"][: n - 3] == b["records"][3:n], "the rest of epoch 0, as the job that never saw growth"
    seen = windows(after, 1)
    assert len(seen) == len(set(seen)) and set(seen) <= reference_windows(full, W, S)
    ends = {k: len(a) for k, a, _ in first}
    assert {k for k, _ in seen} - set(ends), "the new sequences"
    assert any(k in ends and s + W > ends[k] for k, s in seen), "the new steps of extended ones"
