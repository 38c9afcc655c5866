"""Elastic resume: a state taken on one rank, loaded into a job of another world, worker count or batch size.

Ranks are simulated in one process (explicit rank/world_size) and stepped in lockstep. Every
property is checked against windows computed from the corpus in the test (``reference_windows``)
and against what the runs actually yielded, never against the plan.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import streamwin as sw
from conftest import lockstep as step_ranks, make_sequences, reference_windows

W, S, H = 16, 8, 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    seqs = make_sequences(120, seed=3, max_len=500)
    url = str(tmp_path_factory.mktemp("elastic") / "ds")
    sw.pack(list(seqs.items()), url, shard_bytes=60_000, progress=False)
    return url, seqs


OPEN: list[sw.WindowLoader] = []


@pytest.fixture(autouse=True)
def close_loaders():
    """Every loader a test made is closed after it: no worker process outlives its test."""
    yield
    while OPEN:
        OPEN.pop().close()


def loaders(url, world, workers, batch, **kw):
    args = dict(window=W, stride=S, horizon=H, batch_size=batch, shuffle_buffer=64, seed=7) | kw
    group = [sw.WindowLoader(sw.WindowDataset(url, rank=r, world_size=world, **args), num_workers=workers)
             for r in range(world)]
    OPEN.extend(group)
    return group


def windows(batch) -> list[tuple[str, int]]:
    """(key, start) of the real windows of a batch (repeats that equalize steps weigh 0)."""
    weight = batch.get("weight")
    keep = [True] * len(batch["key"]) if weight is None else (weight > 0).tolist()
    return [(k, s) for k, s, real in zip(batch["key"], batch["start"].tolist(), keep) if real]


def lockstep(group, take=None, check=None):
    """Per rank, (windows, x, rows) of each batch of one job's ranks stepped together."""
    return step_ranks(group, lambda b: (windows(b), b["x"].clone(), len(b["key"])), take, check)


def flat(per_rank) -> list[tuple[str, int]]:
    return [w for batches in per_rank for ws, _, _ in batches for w in ws]


def content_check(seqs):
    def check(b):
        for i, (key, start) in enumerate(zip(b["key"], b["start"].tolist())):
            ref = seqs[key][start : start + W]
            assert len(ref) == W and np.array_equal(b["x"][i].numpy(), ref), (key, start)
    return check


def interrupted(url, old, take, **kw):
    """Run the old job for ``take`` steps: (windows yielded, the state of every rank)."""
    group = loaders(url, *old, **kw)
    before = lockstep(group, take)
    states = [json.loads(json.dumps(x.state_dict())) for x in group]  # a checkpoint is plain data
    for x in group:
        x.close()
    return before, states


@pytest.mark.parametrize("old,new", [((2, 2, 16), (3, 1, 16)), ((4, 0, 16), (1, 2, 16)), ((2, 1, 16), (2, 1, 24))],
                         ids=["2x2-to-3x1", "4x0-to-1x2", "batch16-to-24"])
def test_elastic_resume_yields_the_rest_of_the_epoch_once(corpus, old, new):
    url, seqs = corpus
    reference = reference_windows(seqs, W, S, H)
    full_old = flat(lockstep(loaders(url, *old)))  # what the old job yields over a whole epoch
    old_dropped = reference - set(full_old)
    take = len(loaders(url, *old)[0]) // 2 + 1
    before, states = interrupted(url, old, take)
    assert all(s == states[0] for s in states), "ranks in lockstep must hold the same state"

    group = loaders(url, *new)
    for x in group:
        x.load_state_dict(states[-1])  # any rank's state will do
        x.set_epoch(0)
    lengths = {len(x) for x in group}
    after = lockstep(group, check=content_check(seqs))
    steps = {len(r) for r in after}
    assert len(steps) == 1 and lengths == {take + steps.pop()}, "equal steps, and len() = taken + the rest"
    assert all(n == new[2] for r in after for _, _, n in r)

    seen_before, seen_after = flat(before), flat(after)
    assert len(set(seen_before)) == len(seen_before) and len(set(seen_after)) == len(seen_after)
    assert not set(seen_before) & set(seen_after), "a window yielded before the interruption came again"
    assert set(seen_before) | set(seen_after) <= reference
    missing = reference - set(seen_before) - set(seen_after)
    streams = new[0] * max(1, new[1])
    assert old_dropped <= missing and len(missing) - len(old_dropped) <= streams * new[2]

    again = loaders(url, *new)  # deterministic, whichever old rank's state is loaded
    for x in again:
        x.load_state_dict(states[0])
        x.set_epoch(0)
    assert [[w for w, _, _ in r] for r in lockstep(again)] == [[w for w, _, _ in r] for r in after]

    for x in group:  # the next epoch is a normal epoch of the new world
        x.set_epoch(1)
    fresh = loaders(url, *new)
    for x in fresh:
        x.set_epoch(1)
    nxt, ref = lockstep(group), lockstep(fresh)
    assert [[w for w, _, _ in r] for r in nxt] == [[w for w, _, _ in r] for r in ref] and len(nxt[0]) == len(fresh[0])


def test_elastic_resume_with_padding_yields_every_window(corpus):
    url, seqs = corpus
    kw = dict(order=sw.Order(equalize="pad"))
    before, states = interrupted(url, (2, 2, 16), 5, **kw)
    group = loaders(url, 3, 0, 8, **kw)
    for x in group:
        x.load_state_dict(states[1])
    after = lockstep(group)
    real = flat(before) + flat(after)
    assert sorted(real) == sorted(reference_windows(seqs, W, S, H)), "pad: every window once, repeats weigh 0"


def test_elastic_resume_twice_and_an_exact_resume_within_it(corpus):
    url, seqs = corpus
    reference = reference_windows(seqs, W, S, H)
    before, states = interrupted(url, (2, 2, 16), 4)
    second = loaders(url, 3, 1, 8)
    for x in second:
        x.load_state_dict(states[0])
    middle = lockstep(second, 6)
    state2 = json.loads(json.dumps(second[2].state_dict()))
    whole = loaders(url, 3, 1, 8)  # the same elastic epoch, uninterrupted
    for x in whole:
        x.load_state_dict(states[0])
    rest_uninterrupted = [r[6:] for r in lockstep(whole)]
    assert "rest_of" in state2 and len(state2["rest_of"]) == 1

    same_world = loaders(url, 3, 1, 8)  # same world within an elastic epoch: byte-exact, as always
    for x in same_world:
        x.load_state_dict(state2)
    exact = lockstep(same_world)
    assert all(torch.equal(a[1], b[1]) and a[0] == b[0] for ra, rb in zip(exact, rest_uninterrupted)
               for a, b in zip(ra, rb)) and len(exact[0]) == len(rest_uninterrupted[0])

    third = loaders(url, 1, 2, 12)  # and elastic once more
    for x in third:
        x.load_state_dict(state2)
    last = lockstep(third, check=content_check(seqs))
    seen = flat(before) + flat(middle) + flat(last)
    assert len(seen) == len(set(seen)) and set(seen) <= reference
    assert len(set(flat(last))) > 0


@pytest.mark.parametrize("change", [dict(window=12), dict(seed=8),
                                    dict(order=sw.Order(shuffle=False))])
def test_elastic_resume_refuses_another_order_or_window(corpus, change):
    url, _ = corpus
    _, states = interrupted(url, (2, 1, 16), 2)
    other = loaders(url, 3, 1, 16, **change)[0]
    with pytest.raises(sw.StateMismatchError, match="in checkpoint"):
        other.load_state_dict(states[0])


def test_state_at_an_epochs_end_loads_in_any_world(corpus):
    url, _ = corpus
    group = loaders(url, 2, 2, 16)
    lockstep(group)
    state = group[0].state_dict()
    new = loaders(url, 3, 1, 8)
    for x in new:
        x.load_state_dict(state)
        x.set_epoch(0)
    assert lockstep(new) == [[], [], []]
    for x in new:
        x.set_epoch(1)
    fresh = loaders(url, 3, 1, 8)
    for x in fresh:
        x.set_epoch(1)
    assert [[w for w, _, _ in r] for r in lockstep(new)] == [[w for w, _, _ in r] for r in lockstep(fresh)]


@pytest.mark.parametrize("workers", [0, 2])
def test_elastic_resume_in_device_mode_gives_the_same_batches(corpus, workers):
    url, _ = corpus
    _, states = interrupted(url, (2, 2, 16), 3)

    def rest(**kw):
        group = [sw.WindowLoader(sw.WindowDataset(url, window=W, stride=S, horizon=H, batch_size=8, shuffle_buffer=64,
                                                  seed=7, rank=0, world_size=1), num_workers=workers, **kw)]
        OPEN.extend(group)
        group[0].load_state_dict(states[0])
        return lockstep(group)[0]

    cpu, dev = rest(), rest(device="cpu")
    assert len(cpu) == len(dev) > 0
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(cpu, dev))
