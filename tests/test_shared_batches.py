"""Shared batches: a rank's workers each write the rows of their share of its canonical slots into one shared
slot, every batch (plan/canon.py ``shares_batches``; feed/pool.py), instead of taking chunks of steps in turn.

Every batch must hold the corpus's own steps (checked against the sequences as written), no window may come
twice in an epoch, and the batches must be one process's, bit for bit: over whole epochs, after a resume
mid-epoch (into 2, 4 or no workers), with batches kept past the slots, with batches held across the next pass
(a slot nothing may write while a batch of it is held), after a pass abandoned midway, and in device mode.
A worker killed mid-epoch is named, and nothing of ours outlives the loader.
"""
from __future__ import annotations

import collections
import os
import warnings

import numpy as np
import pytest
import torch

import streamwin as sw
from conftest import expect_killed_worker_named, make_sequences, opened, our_children
from streamwin.feed.slots import leftovers
from streamwin.plan import canon

W, S, B = 16, 8, 32  # window, stride, batch per rank
SLOTS = (8, 1)  # canonical: 8 rank slots, one phase


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    seqs = make_sequences(150, seed=5, max_len=400)
    url = str(tmp_path_factory.mktemp("shared") / "ds")
    sw.pack(list(seqs.items()), url, shard_bytes=40_000, progress=False)
    return url, seqs


def test_workers_share_batches_where_each_can_write_rows_of_every_batch(corpus):
    """One source, no more workers than a rank has slots, no slot of no item; else chunks of steps."""
    def cfg(workers, world=1, batch=32):
        return sw.WindowDataset(corpus[0], window=W, stride=S, batch_size=batch, rank=0,
                                world_size=world, order=sw.Order(canonical=SLOTS)).config(workers, world)
    assert canon.shares_batches(cfg(2), 1) and canon.shares_batches(cfg(8), 1) and canon.shares_batches(cfg(2, 4), 1)
    assert not canon.shares_batches(cfg(9), 1) and not canon.shares_batches(cfg(3, 4), 1)  # more workers than slots
    assert not canon.shares_batches(cfg(2), 2)  # a mix
    assert not canon.shares_batches(cfg(2, batch=4), 1)  # a global batch of 4 < 8 slots
    assert not canon.shares_batches(cfg(1), 1)  # one worker: it takes every step of every slot


def make(url, workers, *, rank=0, world=1, device=None, persistent=False, **kw):
    ds = sw.WindowDataset(url, window=W, stride=S, batch_size=B, shuffle_buffer=96, seed=7, rank=rank, world_size=world,
                          order=sw.Order(canonical=SLOTS), **kw)
    return opened(sw.WindowLoader(ds, num_workers=workers, device=device, persistent_workers=persistent and workers > 0))


def rows(b) -> list[tuple[str, int]]:
    return list(zip(list(b["key"]), b["start"].tolist()))


def summary(b) -> tuple:
    return rows(b), b["x"].numpy().tobytes()


def check(seqs, batches) -> None:
    """Independent of streamwin: each window holds its sequence's steps as written; none twice in the epoch."""
    seen = []
    for b in batches:
        x = b["x"].numpy()
        for i, (key, start) in enumerate(rows(b)):
            assert np.array_equal(x[i], seqs[key][start : start + W]), (key, start)
            seen.append((key, start))
    assert len(seen) == len(set(seen)), "a window twice in one epoch"


def epoch(loader, n=None) -> list:
    out = []
    for b in loader:
        out.append(summary(b))
        if n is not None and len(out) == n:
            break
    return out


@pytest.fixture(scope="module")
def reference(corpus):
    """One process's epochs 0 and 1, no workers (the batches every worker count must give)."""
    loader = make(corpus[0], 0)
    assert not loader._plan().shared
    first = epoch(loader)
    loader.set_epoch(1)
    return first, epoch(loader)


@pytest.mark.parametrize("workers", [2, 3])  # 3: shares of 3, 3 and 2 slots
def test_workers_share_each_batch_and_give_one_processs_batches(corpus, reference, workers):
    url, seqs = corpus
    loader = make(url, workers, persistent=workers == 2)
    assert loader._plan().shared
    got, it = [], iter(loader)
    for b in it:
        assert loader._pool.slot_layout.shared
        check(seqs, [b])
        got.append(summary(b))
    assert got == reference[0]
    check(seqs, [{"key": [k for k, _ in r], "start": torch.tensor([s for _, s in r]),
                  "x": torch.from_numpy(np.frombuffer(x, np.float32).reshape(len(r), W, -1))} for r, x in got])
    loader.set_epoch(1)
    assert epoch(loader) == reference[1]
    loader.close()
    assert not our_children() and not leftovers(os.getpid())


def test_the_workers_rows_tile_each_ranks_batch(corpus):
    """Computed here from the slots' micro-batches (G(a+1)//A - Ga//A, slot after slot in a rank's batch)."""
    url, _ = corpus
    for world, workers in [(1, 2), (1, 3), (1, 4), (1, 8), (2, 2), (2, 3), (2, 4), (4, 2)]:
        ds = sw.WindowDataset(url, window=W, stride=S, batch_size=12, shuffle_buffer=96, rank=0, world_size=world,
                              order=sw.Order(canonical=SLOTS))
        plan = ds.plan(0, workers, world_size=world)
        assert plan.shared
        g, per = 12 * world, SLOTS[0] // world
        m = [g * (a + 1) // SLOTS[0] - g * a // SLOTS[0] for a in range(SLOTS[0])]
        for rank in range(world):
            at = 0
            for w in range(workers):
                mine = m[rank * per + w * per // workers : rank * per + (w + 1) * per // workers]
                assert plan.rows(rank * workers + w) == (at, at + sum(mine)), (world, workers, rank, w)
                at += sum(mine)
            assert at == 12
    ds = sw.WindowDataset(url, window=W, stride=S, batch_size=12, rank=0, world_size=1, order=sw.Order(canonical=SLOTS))
    assert not ds.plan(0, 9).shared and ds.plan(0, 9).rows(0) is None  # more workers than slots: chunks of steps
    tiny = sw.WindowDataset(url, window=W, stride=S, batch_size=4, rank=0, world_size=1,
                            order=sw.Order(canonical=SLOTS))
    assert not tiny.plan(0, 2).shared  # a global batch of 4 leaves slots of no item: a worker would write no row


@pytest.mark.parametrize("resume_workers", [2, 4, 0])
def test_a_resume_mid_epoch_continues_one_processs_batches(corpus, reference, resume_workers):
    url, _ = corpus
    loader = make(url, 2)
    head = epoch(loader, 7)
    state = loader.state_dict()
    loader = make(url, resume_workers)
    loader.load_state_dict(state)
    assert head + epoch(loader) == reference[0]


def test_batches_held_across_the_next_pass_are_not_written(corpus, reference):
    """The free slots each worker is told at a pass's start leave out every slot the training loop holds."""
    url, seqs = corpus
    loader = make(url, 2, persistent=True)
    held = collections.deque(loader, maxlen=3)  # the epoch's last batches, still referring to their slots
    in_slots = {state.fields["x"].ctypes.data for state in loader._pool.batches.slots[0]}
    assert all(h["x"].data_ptr() in in_slots for h in held), "the held batches are in the shared slots"
    copies = [{k: v.clone() for k, v in b.items() if isinstance(v, torch.Tensor)} for b in held]
    loader.set_epoch(1)
    again = [summary(b) for b in loader]
    assert again == reference[1]
    for b, c in zip(held, copies):
        assert all(torch.equal(b[k], v) for k, v in c.items()), "a held batch was overwritten"


def test_batches_kept_past_the_slots_are_copied_out_right(corpus, reference):
    url, seqs = corpus
    loader = make(url, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "batches are being kept" (one copy each)
        it = iter(loader)
        kept = [next(it)]
        slots = loader._pool.slot_layout.slots
        kept += list(it)
        assert len(kept) > slots
        check(seqs, kept)
        assert [summary(b) for b in kept] == reference[0]


def test_a_pass_abandoned_midway_leaves_the_next_ones_right(corpus, reference):
    url, _ = corpus
    loader = make(url, 2, persistent=True)
    assert epoch(loader, 3) == reference[0][:3]
    loader.set_epoch(1)  # abandons epoch 0 while the workers write ahead
    assert epoch(loader, 5) == reference[1][:5]
    loader.set_epoch(0)
    assert epoch(loader) == reference[0]


def test_device_mode_with_shared_workers_gives_one_processs_batches(corpus):
    url, _ = corpus
    loader = make(url, 0, device="cpu")
    want = epoch(loader)
    loader = make(url, 2, device="cpu")
    assert loader._plan().shared
    assert epoch(loader) == want


def test_ranks_of_shared_workers_take_equal_steps_and_each_window_once(corpus):
    url, seqs = corpus
    per_rank = []
    for rank in range(2):
        loader = make(url, 2, rank=rank, world=2)
        assert loader._plan().shared
        per_rank.append(list(loader))
        assert len(per_rank[-1]) == len(loader)
    assert len(per_rank[0]) == len(per_rank[1]) > 5
    check(seqs, per_rank[0] + per_rank[1])


def test_a_killed_worker_of_shared_batches_is_named(corpus):
    url, _ = corpus
    loader = make(url, 2)
    it = iter(loader)
    next(it)
    expect_killed_worker_named(loader, it)  # the other worker's parts alone never make a batch


def test_workers_under_a_transform_of_whole_batches_take_chunks_and_the_same_batches(corpus):
    """A transform sees whole batches, so its workers do not share them: they take chunks of steps in turn."""
    url, _ = corpus

    def scale(b, rng):
        return {**b, "x": b["x"] * 2}
    want = [summary(b) for b in sw.WindowLoader(make(url, 0).dataset, transform=scale)]
    loader = opened(sw.WindowLoader(make(url, 0).dataset, num_workers=2, transform=scale))
    assert not loader._plan().shared
    assert epoch(loader) == want


@pytest.mark.parametrize("mix,canonical", [(False, SLOTS), (True, SLOTS), (False, (8, 2)), (True, (8, 2))],
                         ids=["one source", "a mix", "one source, 2 phases", "a mix, 2 phases"])
def test_a_canonical_plan_keeps_no_table_a_slot_and_step(tmp_path, mix, canonical):
    """Each slot's quotas are a function of the step (mix.slot_quotas), so a canonical plan keeps their running sums
    a chunk of steps and makes a chunk's quotas when it is read, not a quota per slot, source and step (in every
    process: 18 bytes a step with one source, 420 with a mix of two, with 2 phases 65 and 257, against 13 and 25
    for one stream a process); measured with tracemalloc over a plan of ~37k steps (a mix: ~75k) and both workers'
    schedules."""
    import tracemalloc

    rng = np.random.default_rng(0)
    url = str(tmp_path / "long")
    sw.pack([(f"s{i}", rng.normal(size=(1000, 3)).astype(np.float32)) for i in range(300)], url, progress=False)
    mixed = {"url": {"a": url, "b": url}, "mix": sw.Mix(weights={"a": 0.7, "b": 0.3})} if mix else {"url": url}
    ds = sw.WindowDataset(**mixed, window=4, stride=1, batch_size=8, shuffle_buffer=2000, seed=1,
                          order=sw.Order(canonical=canonical))
    ds.plan(0, 2)  # the window index, built once
    tracemalloc.start()
    try:
        plan = ds.plan(0, 2)
        schedules = [plan.schedule(s) for s in range(2)]
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert plan.shared == (canonical == SLOTS and not mix) and plan.steps > 30_000
    assert len(schedules[0].plans) == (2 if mix else 1)
    assert held < 8 * plan.steps + (1 << 20), f"{held / plan.steps:.0f} bytes a step"
