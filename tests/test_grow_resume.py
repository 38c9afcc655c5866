"""Checkpoints across growth (issue 44, item 3): a state saved before an append resumes its epoch on the data it was
planned on, exactly; the next epoch plans over the grown dataset; an elastic resume deals the rest of the old epoch.

The references are runs over a copy of the dataset that never grew (what the uninterrupted job saw), and the
corpus itself (tests/grow_cases.py): every window is compared with its steps.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest

import grow_cases as gc
import streamwin as sw
from conftest import opened
from streamwin.errors import StateMismatchError

W, S = 16, 8
KW = dict(window=W, stride=S, shuffle_buffer=48, seed=4)


def first_pack(url: str, full: dict) -> None:
    sw.pack([(k, a, m) for k, a, m in gc.stages(full)[0]], url, shard_bytes=6000, progress=False)


def grow(url: str, full: dict) -> None:
    for items in gc.stages(full)[1:]:
        sw.pack([(k, a) if m is None else (k, a, m) for k, a, m in items], url, shard_bytes=6000, progress=False,
                mode="extend")


def summary(b) -> tuple:
    return list(b["key"]), b["start"].tolist(), b["x"].numpy().tobytes()


def run(url: str, world: int, workers: int = 0, take: int | None = None, state=None, epoch: int = 0, **kw):
    """(per step, every rank's batch summaries; rank 0's state after ``take`` steps) of one epoch."""
    loaders = [opened(sw.WindowLoader(sw.WindowDataset(url, rank=r, world_size=world, batch_size=8 // world,
                                                       **KW | kw), num_workers=workers)) for r in range(world)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
        else:
            loader.set_epoch(epoch)
    steps, saved = [], None
    for batches in zip(*loaders, strict=True):
        steps.append([summary(b) for b in batches])
        if take is not None and len(steps) == take:
            saved = loaders[0].state_dict()
            break
    return steps, saved, loaders


@pytest.mark.parametrize("world,workers", [(1, 0), (2, 0), (1, 2)])
def test_a_state_saved_before_an_append_resumes_its_epoch_exactly(tmp_path, world, workers):
    full = gc.corpus(seed=9)
    url, before = str(tmp_path / "ds"), str(tmp_path / "never-grown")
    first_pack(url, full)
    shutil.copytree(url, before)
    whole, _, _ = run(before, world, workers)  # what the uninterrupted job yields
    taken, state, _ = run(url, world, workers, take=5)
    assert taken == whole[:5]
    grow(url, full)
    assert "view" not in state["inputs"]  # saved before the dataset grew: its first view
    rest, _, loaders = run(url, world, workers, state=state)
    assert rest == whole[5:], "the rest of the epoch, bitwise, on the data it was planned on"
    assert len(loaders[0]) == len(whole)
    loaders[0].set_epoch(1)
    grown = gc.windows(loaders[0], full, W) if world == 1 else None
    if grown is not None:  # the next epoch: the grown dataset (its new sequences, its extended steps)
        ends = {k: len(a) for k, a, _ in gc.stages(full)[0]}
        assert {k for k, _, _ in grown} - set(ends) and any(s + n > ends.get(k, 1 << 30) for k, s, n in grown)


def test_a_state_resumed_on_a_grown_dataset_saves_and_resumes_again(tmp_path):
    full = gc.corpus(seed=10)
    url, before = str(tmp_path / "ds"), str(tmp_path / "never-grown")
    first_pack(url, full)
    shutil.copytree(url, before)
    whole, _, _ = run(before, 1)
    _, state, _ = run(url, 1, take=3)
    grow(url, full)
    part, again, _ = run(url, 1, state=state, take=4)
    assert part == whole[3:7]
    assert again["inputs"].get("view") and again["rest_of"][0]["batches"] == 0  # it names the data of its epoch
    rest, _, _ = run(url, 1, state=again)
    assert rest == whole[7:]


def test_an_elastic_resume_onto_the_grown_dataset_deals_the_rest_of_the_old_epoch(tmp_path):
    """Saved on 2 ranks before the append, resumed on 1 after it: every window of the old epoch not taken yet,
    once, and none of the new data; equal steps; then the next epoch over the grown dataset."""
    full = gc.corpus(seed=11)
    url = str(tmp_path / "ds")
    first_pack(url, full)
    taken_steps, state, loaders = run(url, 2, take=4, order=sw.Order(equalize="pad"))
    taken = []
    # every window of the old epoch: an uninterrupted 2-rank epoch with equalize="pad" covers all of them
    every = set()
    for step in run(url, 2, order=sw.Order(equalize="pad"))[0]:
        for keys, starts, _ in step:
            every |= set(zip(keys, starts))
    for step in taken_steps:
        for keys, starts, _ in step:
            taken += list(zip(keys, starts))
    grow(url, full)
    # another global batch: an elastic resume
    ds = sw.WindowDataset(url, batch_size=6, order=sw.Order(equalize="pad"), **KW)
    loader = opened(sw.WindowLoader(ds))
    loader.load_state_dict(state)
    counted = []
    got = [(k, s) for k, s, _ in gc.windows((counted.append(1) or b for b in loader), full, W)]
    assert len(loader) == 4 + len(counted)  # the batches taken, then the rest dealt over this world
    assert len(set(got)) == len(got) and not set(got) & set(taken)
    assert set(got) | set(taken) == every, "the rest of the old epoch, every window once, no new data"
    loader.set_epoch(1)
    nxt = {k for k, _, _ in gc.windows(loader, full, W)}
    assert nxt == {k for k in full if len(full[k]) >= W}


@pytest.mark.parametrize("start", ["spawn", "fork"])
def test_workers_plan_on_their_trainers_view_when_the_dataset_grows_between_passes(tmp_path, start):
    """The loader's workers start anew each pass (spawned, they load index.json themselves): grown since, they
    plan on the view the loader's dataset holds (its trainer's), so the pass yields what it would have without
    the append."""
    full = gc.corpus(seed=12)
    url, before = str(tmp_path / "ds"), str(tmp_path / "never-grown")
    first_pack(url, full)
    shutil.copytree(url, before)
    want = [summary(b) for b in opened(sw.WindowLoader(sw.WindowDataset(before, batch_size=8, **KW), num_workers=2))]
    loader = opened(sw.WindowLoader(sw.WindowDataset(url, batch_size=8, **KW), num_workers=2,
                                    multiprocessing_context=start))
    grow(url, full)  # before the first pass: its workers load the grown manifest
    got = [summary(b) for b in loader]
    assert got == want


def test_a_state_of_another_dataset_or_a_later_view_is_refused(tmp_path):
    full = gc.corpus(seed=13)
    url = str(tmp_path / "ds")
    first_pack(url, full)
    ds_old = sw.WindowDataset(url, batch_size=8, **KW)
    ds_old.manifest
    grow(url, full)
    _, state, _ = run(url, 1, take=2)  # on the grown dataset's last view
    loader = opened(sw.WindowLoader(ds_old))  # a loader that loaded the dataset before it grew
    with pytest.raises(StateMismatchError, match="cannot plan on view"):
        loader.load_state_dict(state)
    sw.pack([(k, a) for k, a in full.items()], url, progress=False)  # packed anew: another dataset
    with pytest.raises(StateMismatchError, match="dataset: in checkpoint"):
        opened(sw.WindowLoader(sw.WindowDataset(url, batch_size=8, **KW))).load_state_dict(state)
    assert np.all(sw.load_manifest(url).length > 0)


def test_a_mix_whose_one_dataset_grew_resumes_its_epoch_exactly(tmp_path):
    full = gc.corpus(seed=14)
    url, other, before = str(tmp_path / "ds"), str(tmp_path / "other"), str(tmp_path / "never-grown")
    first_pack(url, full)
    sw.pack([(f"o{i}", np.full((60, 2), -i, np.float32)) for i in range(10)], other, progress=False)
    shutil.copytree(url, before)
    mix = dict(mix=sw.Mix(weights=[0.7, 0.3]), batch_size=8, **KW)

    def loader(a):
        return opened(sw.WindowLoader(sw.WindowDataset([a, other], **mix)))
    whole = [summary(b) for b in loader(before)]
    first = loader(url)
    it = iter(first)
    taken = [summary(next(it)) for _ in range(4)]
    state = first.state_dict()
    assert taken == whole[:4]
    grow(url, full)
    again = loader(url)
    again.load_state_dict(state)
    assert [summary(b) for b in again] == whole[4:]
    assert again.state_dict()["inputs"]["view"][1] is None  # the source that never grew names no view
