"""Property tests of the pure planner against a naive enumeration of windows."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from streamwin.plan import PlanConfig, SourcePlan, WindowSpace, WindowSpec, make_plan


def naive_windows(lengths, spec):
    """(sequence, start) of every window, by the definition in the design."""
    out = []
    for i, t in enumerate(lengths):
        s = 0
        while s + spec.window + spec.horizon <= t:
            out.append((i, s))
            s += spec.stride
        if spec.pad and 0 < t < spec.window + spec.horizon:
            out.append((i, 0))
    return out


def all_streams(plan):
    """Per stream: list of (sequence, start, real) in yield order (of a plan's only source)."""
    plan = plan.sources[0]
    out = []
    for s in range(plan.config.num_streams):
        rows = []
        for k in range(plan.num_blocks(s)):
            g, real = plan.block(s, k)
            seq, start = plan.locate(g)
            rows += list(zip(seq.tolist(), start.tolist(), real.tolist()))
        out.append(rows)
    return out


@st.composite
def manifests(draw):
    n = draw(st.integers(1, 150))
    max_len = draw(st.sampled_from([10, 300, 5_000, 100_000]))
    lengths = draw(st.lists(st.integers(0, max_len), min_size=n, max_size=n))
    if draw(st.booleans()):  # one giant sequence among small ones
        lengths[draw(st.integers(0, n - 1))] = max_len
    shards = draw(st.integers(1, min(500, n + 5)))
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=shards - 1, max_size=shards - 1)))
    return np.array(lengths, dtype=np.int64), np.array([0] + cuts + [n], dtype=np.int64)


@st.composite
def configs(draw, max_len):
    window = draw(st.integers(1, 64))
    # keep the naive enumeration small: at most ~300 windows per sequence
    stride = draw(st.integers(max(1, max_len // 300), max(1, max_len // 300) + 64))
    spec = WindowSpec(window, stride, draw(st.integers(0, 8)), draw(st.booleans()))
    return PlanConfig(
        spec=spec, batch_size=draw(st.integers(1, 64)), world_size=draw(st.integers(1, 64)),
        num_workers=draw(st.integers(0, 8)), seed=draw(st.integers(0, 2**31)), shuffle=draw(st.booleans()),
        block_windows=draw(st.integers(1, 500)), slice_windows=draw(st.integers(1, 300)),
        equalize=draw(st.sampled_from(["drop", "pad"])))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_coverage_and_equal_steps(data):
    lengths, shard_starts = data.draw(manifests())
    cfg = data.draw(configs(int(lengths.max(initial=1))))
    epoch = data.draw(st.integers(0, 3))
    plan = make_plan(lengths, shard_starts, cfg, epoch)
    expected = naive_windows(lengths.tolist(), cfg.spec)
    n, s, b = len(expected), cfg.num_streams, cfg.batch_size
    assert plan.total_windows == n

    streams = all_streams(plan)
    # equal steps: every stream, hence every rank, yields the same whole number of batches
    assert all(len(rows) == plan.sources[0].windows_per_stream for rows in streams)
    assert plan.sources[0].windows_per_stream % b == 0
    assert plan.batches_per_rank == plan.batches_per_stream * max(1, cfg.num_workers)

    real = [(q, st_) for rows in streams for q, st_, r in rows if r]
    repeats = [(q, st_) for rows in streams for q, st_, r in rows if not r]
    assert len(set(real)) == len(real), "a window yielded twice as real"
    assert set(real) <= set(expected) and set(repeats) <= set(expected)
    if cfg.equalize == "drop":
        assert not repeats
        assert plan.dropped_windows == n - len(real)
        assert plan.dropped_windows < s * b  # the stated bound
        assert plan.dropped_windows <= n
    else:
        assert set(real) == set(expected), "pad must yield every window"
        assert plan.repeated_windows == len(repeats) < s * b if n else True


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10), st.integers(1, 8))
def test_order_is_deterministic_and_changes_with_epoch(seed, world):
    lengths = np.full(400, 100)
    cfg = PlanConfig(WindowSpec(10, 5), batch_size=4, world_size=world, seed=seed, block_windows=50, slice_windows=7)
    shard_starts = np.array([0, 100, 250, 400])
    a, b = make_plan(lengths, shard_starts, cfg, 0), make_plan(lengths, shard_starts, cfg, 0)
    assert all_streams(a) == all_streams(b)
    c = make_plan(lengths, shard_starts, cfg, 1)
    assert all_streams(a) != all_streams(c)


def test_unshuffled_streams_read_in_manifest_order():
    lengths = np.array([30, 5, 50, 0, 40])
    cfg = PlanConfig(WindowSpec(10, 10), batch_size=1, shuffle=False, equalize="pad")
    plan = make_plan(lengths, np.array([0, 2, 5]), cfg, 0)
    rows = all_streams(plan)[0]
    assert [(q, s) for q, s, _ in rows] == naive_windows(lengths, cfg.spec)


def test_fewer_windows_than_streams():
    lengths = np.array([12])  # 3 windows, 4 ranks x 2 workers = 8 streams
    base = PlanConfig(WindowSpec(4, 4), batch_size=2, world_size=4, num_workers=2)
    drop = make_plan(lengths, np.array([0, 1]), base, 0)
    assert drop.batches_per_rank == 0 and drop.dropped_windows == 3  # nothing to share: reported
    pad = make_plan(lengths, np.array([0, 1]), dataclasses.replace(base, equalize="pad"), 0)
    assert pad.batches_per_rank == 2  # 2 workers x 1 batch of 2, on every rank
    real = [(q, s) for rows in all_streams(pad) for q, s, r in rows if r]
    assert sorted(real) == [(0, 0), (0, 4), (0, 8)]


def test_4096_ranks_plan_equal_and_fast_enough():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 5000, size=1_000_000)
    shard_starts = np.arange(0, 1_000_001, 1000)
    cfg = PlanConfig(WindowSpec(256, 64), batch_size=32, world_size=4096, num_workers=8)
    plan = make_plan(lengths, shard_starts, cfg, 3)
    src = plan.sources[0]
    sizes = np.diff(src.stream_lo)
    assert sizes.max() - sizes.min() <= 1
    assert plan.dropped_windows < cfg.num_streams * cfg.batch_size
    g, real = src.block(32767, src.num_blocks(32767) - 1)
    assert real.all() and len(g) > 0


@pytest.mark.parametrize("bad", [dict(window=0), dict(stride=0), dict(horizon=-1)])
def test_window_spec_rejects_bad_values(bad):
    args = dict(window=4, stride=2, horizon=0) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        WindowSpec(**args)


def test_plan_config_rejects_bad_equalize():
    with pytest.raises(ValueError, match="equalize"):
        PlanConfig(WindowSpec(4, 4), batch_size=2, equalize="repeat")


def test_a_negative_seed_or_epoch_is_named_not_a_numpy_error():
    spec = WindowSpec(4, 4)
    with pytest.raises(ValueError, match=r"seed must be an integer >= 0, got -1"):
        PlanConfig(spec, batch_size=2, seed=-1)
    cfg = PlanConfig(spec, batch_size=2)
    lengths, shard_starts = np.array([10, 20]), np.array([0, 2])
    for epoch in (-1, 1.5):
        with pytest.raises(ValueError, match=rf"epoch must be an integer >= 0, got {epoch}"):
            make_plan(lengths, shard_starts, cfg, epoch)
    assert make_plan(lengths, shard_starts, cfg, np.int64(3)).epoch == 3


# -- the window index: window space built once per dataset, nothing per sequence in a plan ------

def naive_view_windows(lengths, spec, view_lo, view_len):
    """(sequence, start) of every window of each sequence's view [lo, lo + len), by the definition."""
    out = []
    for i, (lo, t) in enumerate(zip(view_lo, view_len)):
        s = 0
        while s + spec.span <= t:
            out.append((i, lo + s))
            s += spec.stride
        if spec.pad and 0 < t < spec.span:
            out.append((i, lo))
    return out


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 200), min_size=0, max_size=300), window=st.integers(1, 20),
       stride=st.integers(1, 20), pad=st.booleans(), chunk=st.sampled_from([1, 2, 3, 7, 64]),
       split=st.booleans(), seed=st.integers(0, 100))
def test_window_index_numbers_windows_as_the_naive_enumeration(lengths, window, stride, pad, chunk, split, seed):
    spec = WindowSpec(window, stride, 0, pad)
    lengths = np.array(lengths, dtype=np.int64)
    rng = np.random.default_rng(seed)
    if split:  # a random view of each sequence: some empty, some a suffix
        view_lo = (rng.random(len(lengths)) * lengths).astype(np.int64)
        view_len = np.where(rng.random(len(lengths)) < 0.3, 0, lengths - view_lo)
        views = lambda seqs: (view_lo[seqs], view_len[seqs])  # noqa: E731
    else:
        view_lo, view_len, views = np.zeros_like(lengths), lengths, None
    expected = naive_view_windows(lengths.tolist(), spec, view_lo.tolist(), view_len.tolist())
    index = WindowSpace(lengths, spec, views, chunk=chunk)
    assert index.total == len(expected)
    seq, start = index.locate(np.arange(index.total))
    assert list(zip(seq.tolist(), start.tolist())) == expected
    firsts = [sum(1 for q, _ in expected if q < i) for i in range(len(lengths) + 1)]
    assert index.starts(np.arange(len(lengths) + 1)).tolist() == firsts
    assert index.ends(np.arange(len(lengths))).tolist() == (view_lo + view_len).tolist()
    g = rng.permutation(index.total)[: max(1, index.total // 3)] if index.total else np.arange(0)
    seq2, start2 = index.locate(g)  # any order, any subset: the same answers
    assert [(q, s) for q, s in zip(seq2.tolist(), start2.tolist())] == [expected[i] for i in g.tolist()]


def test_a_plan_holds_nothing_per_sequence():
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, 5000, size=1_000_000)
    cfg = PlanConfig(WindowSpec(256, 64), batch_size=32, world_size=8, num_workers=8)
    space = WindowSpace(lengths, cfg.spec)
    plan = make_plan(None, np.arange(0, 1_000_001, 1000), cfg, 2, space=space)
    held = [*vars(plan).values(), *vars(plan.sources[0]).values(), *vars(plan.sources[0].order).values()]
    arrays = [v for v in held if isinstance(v, np.ndarray)] + [space.coarse]
    assert sum(a.nbytes for a in arrays) < len(lengths)  # under one byte per sequence (was 16)
    again = make_plan(lengths, np.arange(0, 1_000_001, 1000), cfg, 2)
    assert again.sources[0].windows_per_stream == plan.sources[0].windows_per_stream


def test_a_dataset_builds_its_window_index_once_and_len_once(tiny, monkeypatch):
    import streamwin as sw
    import streamwin.dataset

    ds = sw.WindowDataset(tiny[0], window=16, stride=8, batch_size=4, select=sw.Select(split="train"))
    a, b = ds.plan(0, 0), ds.plan(3, 4)
    assert a.sources[0].space is b.sources[0].space and a.sources[0].space is ds.sources[0].space
    n = len(ds)
    monkeypatch.setattr(streamwin.dataset, "plan_epoch", lambda *a, **k: pytest.fail("len() planned again"))
    assert len(ds) == n


def test_a_pickled_dataset_carries_its_index_scan_not_the_manifest(tiny, monkeypatch):
    import pickle

    import streamwin as sw

    ds = sw.WindowDataset(tiny[0], window=16, stride=8, batch_size=4, select=sw.Select(split="val"))
    plan = ds.plan(1, 2)
    copy = pickle.loads(pickle.dumps(ds))
    assert all(s._manifest is None for s in copy.sources)
    monkeypatch.setattr(WindowSpace, "_scan", lambda self: pytest.fail("a worker rescanned the dataset"))
    mine, other = plan.sources[0], copy.plan(1, 2).sources[0]
    for s in range(plan.config.num_streams):
        for k in range(mine.num_blocks(s)):
            g, _ = mine.block(s, k)
            assert [x.tolist() for x in mine.locate(g)] == [x.tolist() for x in other.locate(g)]


def test_a_shipped_index_scan_of_another_manifest_is_not_used(tiny, monkeypatch):
    import pickle

    import streamwin as sw

    ds = sw.WindowDataset(tiny[0], window=16, stride=8, batch_size=4)
    source = ds.sources[0]
    assert source.space is not None
    state = source.__getstate__()
    assert state["_coarse"][0] == ds.manifest.digest
    state["_coarse"] = ("a manifest packed since", state["_coarse"][1] + 1)  # the dataset was rewritten meanwhile
    copy = pickle.loads(pickle.dumps(ds))
    copy.sources[0].__dict__.update(state)
    assert copy.sources[0].space.coarse.tolist() == source.space.coarse.tolist()  # rescanned, not taken


def yielded(plan, batches_per_rank):
    """(sequence, start) of the real windows each rank's streams yield in its first ``batches_per_rank`` batches,
    taken round robin over the rank's workers, and of the rest, walked from the blocks one window at a time."""
    cfg = plan.config
    w, b = cfg.workers_per_rank, cfg.batch_size
    before, after = [], []
    for s, rows in enumerate(all_streams(plan)):
        k = s % w
        took = (batches_per_rank // w + (k < batches_per_rank % w)) * b
        for i, (q, st_, real) in enumerate(rows):
            if real:
                (before if i < took else after).append((q, st_))
    return before, after


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_rest_of_an_epoch_dealt_over_another_world_yields_each_left_window_once(data):
    from streamwin.plan.epoch import rest_plan

    lengths, shard_starts = data.draw(manifests())
    old = data.draw(configs(int(lengths.max(initial=1))))
    new = dataclasses.replace(old, batch_size=data.draw(st.integers(1, 64)), world_size=data.draw(st.integers(1, 16)),
                              num_workers=data.draw(st.integers(0, 4)), block_windows=data.draw(st.integers(1, 500)),
                              equalize=data.draw(st.sampled_from(["drop", "pad"])))
    base = make_plan(lengths, shard_starts, old, 2)
    assume(old.num_streams * base.sources[0].num_blocks(0) <= 2000)  # the walk below costs ~0.1 ms a block
    taken = data.draw(st.integers(0, base.batches_per_rank))
    before, left = yielded(base, taken)
    rest = rest_plan(base, taken, new)
    assume(new.num_streams * rest.sources[0].num_blocks(0) <= 2000)
    streams = all_streams(rest)
    got = [(q, s) for rows in streams for q, s, r in rows if r]
    repeats = [(q, s) for rows in streams for q, s, r in rows if not r]
    assert all(len(rows) == rest.sources[0].windows_per_stream for rows in streams)  # equal steps
    assert rest.sources[0].windows_per_stream % new.batch_size == 0
    assert len(got) == len(set(got)) and not set(got) & set(before), "a window twice in one epoch"
    left_set = set(left)
    assert set(got) <= left_set and set(repeats) <= left_set
    if new.equalize == "pad":
        assert sorted(got) == sorted(left)
    else:
        assert not repeats and len(left) - len(got) < new.num_streams * new.batch_size
    assert rest.total_windows == len(left)
    again = rest_plan(rest, data.draw(st.integers(0, rest.batches_per_rank)), old)  # and elastic once more
    assert all(len(rows) == again.sources[0].windows_per_stream for rows in all_streams(again))


def test_rest_plan_refuses_another_order():
    lengths = np.full(50, 40)
    cfg = PlanConfig(WindowSpec(10, 5), batch_size=4, world_size=2)
    base = make_plan(lengths, np.array([0, 25, 50]), cfg, 0)
    from streamwin.plan.epoch import rest_plan
    with pytest.raises(ValueError, match="window spec, seed and shuffle"):
        rest_plan(base, 3, dataclasses.replace(cfg, seed=1))


def test_a_rest_read_in_smaller_blocks_shuffles_each_old_block_about_once(monkeypatch):
    """An elastic resume with a smaller shuffle buffer reads one old block over many new ones: it is shuffled
    about once per pass, not once per new block (a rest of a rest multiplied that: 68 s for 4,500 windows)."""
    from streamwin.plan.epoch import rest_plan

    old = PlanConfig(WindowSpec(8, 4), batch_size=4, world_size=2, block_windows=200, seed=3)
    base = make_plan(np.full(60, 400), np.array([0, 20, 40, 60]), old, 0)
    rest = rest_plan(base, 5, dataclasses.replace(old, block_windows=7, world_size=3))
    calls = []
    block = SourcePlan.block
    monkeypatch.setattr(SourcePlan, "block", lambda self, s, b: (calls.append(self is base.sources[0]), block(self, s, b))[1])
    streams = all_streams(rest)
    old_blocks = sum(base.sources[0].num_blocks(s) for s in range(old.num_streams))
    assert sum(len(rows) for rows in streams) > rest.total_windows - 3 * 4  # the rest, read in blocks of 7
    assert 0 < sum(calls) <= 2 * old_blocks, (sum(calls), old_blocks)
