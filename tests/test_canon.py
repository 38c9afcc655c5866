"""One order of global batches, whatever the world size and worker count (issue 30, canonical streams).

Ranks are simulated in one process (explicit rank/world_size) and stepped in lockstep; global
batch k is every rank's batch k, in rank order. For each kind of batch (plain windows, jitter
crops, windows_per_sequence, packed rows, a weighted mix) the global batches of every
(world, workers) must equal those of one process without workers; independently of streamwin,
every window must be one the naive enumeration of the corpus gives (or, for drawn crops, lie
inside its sequence), hold exactly that sequence's steps, and come at most once. Unshuffled, the
order itself is computed here from the corpus alone (``reference_unshuffled``).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import numpy as np
import pytest

import streamwin as sw
from conftest import lockstep, make_sequences, opened, reference_windows, two_corpora

W, S, G = 16, 8, 16  # window, stride, global batch
CANON = (8, 8)  # rank slots x step phases: worlds of 1, 2, 4, 8 ranks, 0, 1, 2, 4, 8 workers
WORLDS = [(1, 0), (1, 2), (2, 0), (2, 1), (4, 1)]
CASES = {
    "plain": dict(),
    "jitter": dict(crops=sw.Crops(jitter=True)),
    "windows_per_sequence": dict(crops=sw.Crops(windows_per_sequence=3)),
    "packed": dict(crops=sw.Crops(pack_length=48, min_window=8, window_multiple=4)),
    "mix": dict(mix=sw.Mix(weights=[0.7, 0.3])),
}
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("canon")
    return two_corpora(root)


def job(url, world, workers, batch=G, canonical=CANON, shuffle=True, slice_windows=None, equalize="drop", **kw):
    """A job's loaders, one per rank; ``kw``: the dataset's other arguments (crops=, mix=, ...)."""
    order = sw.Order(canonical=canonical, shuffle=shuffle, slice_windows=slice_windows, equalize=equalize)
    kw = {"shuffle_buffer": 64, "seed": 11, **kw}
    return [opened(sw.WindowLoader(sw.WindowDataset(url, window=W, stride=S, batch_size=batch // world, rank=r,
                                                    world_size=world, order=order, **kw), num_workers=workers))
            for r in range(world)]


def crops(b) -> list[tuple]:
    """(source, key, start, length) of every window (crop) of a batch, in batch order."""
    n = len(b["key"])
    source = b["source"].tolist() if "source" in b else [0] * n
    length = b["length"].tolist() if "length" in b else [W] * n
    return list(zip(source, list(b["key"]), b["start"].tolist(), length))


def summary(b) -> tuple:
    return crops(b), hashlib.sha256(b["x"].numpy().tobytes()).hexdigest()[:16]


def global_batches(per_rank, grouped=False) -> list:
    """Step k: the ranks' batches of step k in rank order (crops; sorted where a batch of a mix is grouped by source)."""
    out = []
    for k in range(len(per_rank[0])):
        got = sum((r[k][0] for r in per_rank), [])
        out.append(sorted(got) if grouped else got)
    return out


def check_content(seqs_by_source, packed: bool):
    """Independent of streamwin: each crop's steps are its sequence's, as the corpus was written."""
    def check(b):
        x = b["x"].numpy()
        if packed:  # rows of crops: segment ids mark each crop's steps in its row
            pos, table = 0, crops(b)
            for row in range(len(x)):
                seg = b["segment_ids"][row].numpy()
                for sid in range(1, int(seg.max(initial=0)) + 1):
                    src, key, start, n = table[pos]
                    want = seqs_by_source[src][key][start : start + n]
                    assert len(want) == n and np.array_equal(x[row][seg == sid], want), (key, start)
                    pos += 1
            return
        for i, (src, key, start, n) in enumerate(crops(b)):
            want = seqs_by_source[src][key][start : start + n]
            assert len(want) == n and np.array_equal(x[i][:n], want), (key, start)
    return check


# one phase: blocks aligned to the step, a process's slots' blocks read as one; workers take chunks of steps
ALIGNED, ALIGNED_WORLDS = (8, 1), [(1, 0), (1, 3), (2, 2), (4, 1), (8, 0)]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("canon", ["phases", "aligned"])
def test_global_batches_are_the_same_in_every_world_and_worker_count(corpus, case, canon):
    urls, seqs = corpus
    kw = dict(CASES[case]) | ({"canonical": ALIGNED} if canon == "aligned" else {})
    worlds = ALIGNED_WORLDS if canon == "aligned" else WORLDS
    mixed, packed = "mix" in kw, "crops" in kw and kw["crops"].pack_length is not None
    url = urls if mixed else urls[0]
    seqs_by_source = seqs if mixed else seqs[:1]
    check = check_content(seqs_by_source, packed)
    runs, xs = {}, {}
    for world, workers in worlds:
        group = job(url, world, workers, **kw)
        # one source of windows, 2+ workers, a share of the rank's slots each: the workers share every batch
        shares = canon == "aligned" and not (mixed or packed) and 2 <= workers <= 8 // world
        assert group[0]._plan().shared == shares
        per_rank = lockstep(group, summary, check=check)
        assert {len(x) for x in group} == {len(r) for r in per_rank}, "equal steps on every rank, as len() says"
        runs[world, workers] = global_batches(per_rank, grouped=mixed)
        xs[world, workers] = [[r[k][1] for r in per_rank] for k in range(len(per_rank[0]))]
    ref = runs[1, 0]
    assert len(ref) > 5
    for key, got in runs.items():
        assert len(got) == len(ref), f"{key}: {len(got)} global batches, one process made {len(ref)}"
        for k, (a, b) in enumerate(zip(got, ref)):
            assert a == b, f"{key}: global batch {k} differs from one process's"
        if key[0] == 1:  # one rank: the x bytes too, bitwise
            assert xs[key] == xs[1, 0], f"{key}: x differs"
    seen = [c[:3] for batch in ref for c in batch]
    once = [c for c in seen if c[0] == 0]  # the small source of the mix repeats by its weight, the large one not
    assert len(once) == len(set(once)), "a window twice in one epoch"
    if case in ("plain", "mix"):  # the stride grid: every window is one of the naive enumeration's
        ref_sets = [reference_windows(s, W, S) for s in seqs_by_source]
        assert all((key, start) in ref_sets[src] for src, key, start in seen)
        if case == "plain":
            total = len(ref_sets[0])
            assert total - len(seen) < 64 * G // 8, "less than a micro-batch per canonical stream dropped"
    if mixed:  # each global batch holds the weights' share of each source, within one window per slot
        for batch in ref:
            n0 = sum(c[0] == 0 for c in batch)
            assert abs(n0 - 0.7 * G) <= 8


def reference_unshuffled(seqs, shard_keys, slots, phases, g, shuffle_buffer=64):
    """The canonical order computed from the corpus alone (shuffle=False): the windows in manifest order cut into
    slices of at most ``slice_windows`` per shard, laid end to end; stream c = a*P + p owns range c (in proportion
    to its slot's micro-batch); global batch k = per slot a, micro-batch k // P of stream (a, k mod P). With one
    phase the ranges fix only the steps: the order is cut into chunks of Q steps, each the slots' micro-batches of
    its steps, slot after slot."""
    order = []
    for keys in shard_keys:  # shards in manifest order; each shard's windows in key order
        order += [(k, s) for k in keys for s in range(0, len(seqs[k]) - W + 1, S)]
    m = [g * (a + 1) // slots - g * a // slots for a in range(slots)]
    weights = np.repeat(m, phases)
    cw = np.concatenate([[0], np.cumsum(weights)])
    bounds = cw * len(order) // cw[-1]
    streams = [order[bounds[c]:bounds[c + 1]] for c in range(slots * phases)]
    steps = min(phases * min(len(streams[a * phases + p]) // m[a] for a in range(slots) if m[a]) + p
                for p in range(phases))
    if phases > 1:
        out = []
        for k in range(steps):
            p, t = k % phases, k // phases
            out.append([w for a in range(slots) for w in streams[a * phases + p][t * m[a]:(t + 1) * m[a]]])
        return out
    # one phase: chunks of Q = ceil(shuffle_buffer / g) steps lie end to end, each holding, slot after slot, the
    # slot's micro-batches of those steps (the streams' ranges fix only how many steps there are)
    q, pos, out = -(-shuffle_buffer // g), 0, [[] for _ in range(steps)]
    for t0 in range(0, steps, q):
        for a in range(slots):
            for t in range(t0, min(t0 + q, steps)):
                out[t] += order[pos:pos + m[a]]
                pos += m[a]
    return out


@pytest.mark.parametrize("world,workers,batch,canon", [(1, 0, 16, (4, 2)), (2, 1, 12, (4, 2)), (4, 2, 16, (4, 2)),
                                                       (1, 0, 16, (4, 1)), (2, 1, 12, (4, 1)), (4, 0, 16, (4, 1))])
def test_the_unshuffled_order_is_the_one_computed_from_the_corpus(tmp_path, world, workers, batch, canon):
    seqs = make_sequences(50, seed=5, max_len=300)
    keys = sorted(seqs)
    shards = [keys[:20], keys[20:]]  # pack writes its input in order; two calls would be two datasets
    url = str(tmp_path / "ds")
    sw.pack([(k, seqs[k]) for k in keys], url, shard_bytes=10**9, progress=False)
    group = job(url, world, workers, batch=batch, shuffle=False, slice_windows=10**6, canonical=canon)
    got = global_batches(lockstep(group, lambda b: (list(zip(list(b["key"]), b["start"].tolist())), None)))
    want = reference_unshuffled(seqs, [keys], *canon, batch)
    assert got == want
    assert shards  # (one shard: slices of 10**6 windows are whole shards)


def test_epochs_differ_and_runs_repeat(corpus):
    url = corpus[0][0]
    a = [lockstep(job(url, 2, 0), summary) for _ in range(2)]
    assert a[0] == a[1]
    group = job(url, 2, 0)
    for x in group:
        x.set_epoch(1)
    assert lockstep(group, summary) != a[0]


@pytest.mark.parametrize("old,new,canon,case", [((4, 1), (2, 0), CANON, "plain"), ((1, 0), (2, 2), CANON, "plain"),
                                                ((4, 1), (2, 0), ALIGNED, "plain"), ((1, 0), (8, 0), ALIGNED, "plain"),
                                                ((2, 2), (1, 3), ALIGNED, "plain"), ((1, 3), (2, 2), ALIGNED, "packed")])
def test_a_resume_in_another_world_continues_the_same_global_batches(corpus, old, new, canon, case):
    url, kw = corpus[0][0], CASES[case]
    whole = global_batches(lockstep(job(url, *old, canonical=canon, **kw), summary))
    first = job(url, *old, canonical=canon, **kw)
    before = global_batches(lockstep(first, summary, take=15))  # packed: within a chunk (of 2 steps), not at its start
    state = json.loads(json.dumps(first[-1].state_dict()))
    group = job(url, *new, canonical=canon, **kw)
    for x in group:
        x.load_state_dict(state)
    after = global_batches(lockstep(group, summary))
    assert before + after == whole
    assert {len(x) for x in group} == {len(whole)}


def test_a_resume_under_another_global_batch_deals_the_rest_once(corpus):
    """World x batch changed: the rest of the epoch is dealt anew over the canonical streams; no window twice."""
    url = corpus[0][0]
    first = job(url, 2, 0, batch=16)
    before = global_batches(lockstep(first, summary, take=5))
    state = first[0].state_dict()
    group = job(url, 2, 0, batch=8)
    for x in group:
        x.load_state_dict(state)
    after = global_batches(lockstep(group, summary))
    seen = [c for batch in before + after for c in batch]
    assert len(seen) == len(set(seen)) and len(after) > 5
    assert {len(x) for x in group} == {5 + len(after)}


def test_worlds_and_workers_the_canonical_streams_do_not_divide_are_refused(corpus):
    url = corpus[0][0]
    ds = sw.WindowDataset(url, window=W, rank=0, world_size=3, batch_size=4, order=sw.Order(canonical=CANON))
    with pytest.raises(ValueError, match=r"world_size=3 does not divide the 8 rank slots of canonical=\(8, 8\).*"
                                         r"canonical=\(9, 8\)"):
        len(ds)
    ds = sw.WindowDataset(url, window=W, rank=0, world_size=1, batch_size=4, order=sw.Order(canonical=CANON))
    with pytest.raises(ValueError, match=r"num_workers=3 does not divide the 8 step phases"):
        ds.plan(0, 3)
    with pytest.raises(ValueError, match=r'order=sw.Order\(canonical=8\): canonical must be "auto" \(the default\), '
                                         r'None or \(rank slots, step phases\)'):
        sw.WindowDataset(url, window=W, order=sw.Order(canonical=8))
    ds = sw.WindowDataset(url, window=W, rank=0, world_size=3, batch_size=4, order=sw.Order(canonical=None))
    assert len(ds) > 0  # the order of one stream per rank and worker


def test_a_state_of_another_order_loads_as_an_elastic_resume(corpus):
    """A state of one stream per rank and worker (no ``canonical`` in it) loads into canonical streams, and a
    canonical state into another order: the rest of the epoch is dealt anew, no window twice, none but a few lost."""
    url, seqs = corpus[0][0], corpus[1][0]
    every = reference_windows(seqs, W, S)
    for was, now in [(None, "auto"), ((8, 1), None), ((8, 1), (4, 2)), ((4, 2), "auto")]:
        old = job(url, 2, 0, canonical=was)
        before = global_batches(lockstep(old, summary, take=3))
        state = json.loads(json.dumps(old[0].state_dict()))
        assert ("canonical" in state["inputs"]) == (was is not None)
        group = job(url, 2, 1, canonical=now)
        for x in group:
            x.load_state_dict(state)
        after = global_batches(lockstep(group, summary))
        seen = [c[1:3] for batch in before + after for c in batch]
        assert len(seen) == len(set(seen)), f"{was} -> {now}: a window twice"
        assert set(seen) <= set(every) and len(every) - len(seen) < 2 * 8 * G, f"{was} -> {now}: windows lost"
        assert {len(x) for x in group} == {3 + len(after)}


def test_auto_is_8_slots_one_phase_where_8_is_divided_else_one_stream_a_process(corpus):
    url = corpus[0][0]
    want = global_batches(lockstep(job(url, 1, 0, canonical=(8, 1)), summary))
    for world, workers in [(1, 2), (4, 1), (8, 0)]:
        assert global_batches(lockstep(job(url, world, workers, canonical="auto"), summary)) == want
    mixed = dict(url=corpus[0], mix=sw.Mix(weights=[0.7, 0.3]))  # a mix too (its workers take chunks of steps)
    want = global_batches(lockstep(job(world=1, workers=0, canonical=(8, 1), **mixed), summary), grouped=True)
    for world, workers in [(1, 2), (2, 3), (4, 1)]:
        got = lockstep(job(world=world, workers=workers, canonical="auto", **mixed), summary)
        assert global_batches(got, grouped=True) == want, (world, workers)
    for world in (3, 16):  # worlds that do not divide 8 keep one stream per rank and worker
        ds = sw.WindowDataset(url, window=W, stride=S, batch_size=48 // world, rank=0, world_size=world)
        assert ds.plan_inputs().get("canonical") is None
        assert global_batches(lockstep(job(url, world, 0, batch=48, canonical="auto"), summary)) == \
            global_batches(lockstep(job(url, world, 0, batch=48, canonical=None), summary))
    packed = dict(CASES["packed"])  # packed rows too (their workers take chunks of steps), of one source or a mix
    for urls, extra in [(url, {}), (corpus[0], {"mix": sw.Mix(weights=[0.7, 0.3])})]:
        want = global_batches(lockstep(job(urls, 1, 0, canonical=(8, 1), **packed, **extra), summary), grouped=True)
        for world, workers in [(1, 2), (2, 3)]:
            got = lockstep(job(urls, world, workers, canonical="auto", **packed, **extra), summary)
            assert global_batches(got, grouped=True) == want, (extra, world, workers)


def test_padding_steps_take_every_window_once_in_every_world(corpus):
    """equalize="pad" with blocks aligned to the step: the repeats that cover the last steps weigh 0, the real
    windows are the stride grid's, each once, and the global batches are the same in every world."""
    urls, seqs = corpus
    runs = {}
    for world, workers in [(1, 0), (2, 1), (4, 0)]:
        group = job(urls[0], world, workers, equalize="pad", canonical=(4, 1))
        per_rank = lockstep(group, lambda b: (list(zip(list(b["key"]), b["start"].tolist(),
                                                       b["weight"].tolist())), None))
        runs[world, workers] = global_batches(per_rank)
    ref = runs[1, 0]
    assert all(got == ref for got in runs.values())
    real = [(k, s) for batch in ref for k, s, w in batch if w > 0]
    assert sorted(real) == sorted(reference_windows(seqs[0], W, S)), "every window once, repeats weigh 0"
    assert any(w == 0 for batch in ref for _, _, w in batch), "the corpus does not make pad repeat"


def test_the_worked_example_of_plan_canon_is_what_the_plan_serves():
    """plan/canon.py's docstring draws canonical=(4, 2), 2 ranks of batch 3, 2 workers, 48 windows unshuffled: its
    stream ranges and its table of which windows each slot serves at each step are read from the docstring (worked
    by hand) and must be what each process's schedule takes from its lanes, and the same in-process."""
    import re

    from streamwin.plan import PlanConfig, WindowSpace, WindowSpec, canon, plan_epoch

    doc = canon.__doc__
    ranges = next(line for line in doc.splitlines() if "its windows:" in line).split(":")[1].split()
    table = {int(m[1]): [[int(x) for x in m[2].split()], [int(x) for x in m[3].split()]]
             for m in re.finditer(r"^ +(\d+) +\d+ +\d+ +\|(.*)\|(.*)$", doc, re.M)}
    assert len(ranges) == 8 and sorted(table) == [0, 1, 2, 3]
    spec = WindowSpec(4, 4)
    space = WindowSpace(np.full(12, 16), spec)  # 12 sequences of 4 windows: windows 0..47 in order

    def served(world, workers) -> dict[int, list[list[int]]]:
        """Step -> each rank's windows, from the schedules of every process."""
        out: dict[int, list[list[int]]] = {}
        cfg = PlanConfig(spec, batch_size=6 // world, world_size=world, num_workers=workers, canonical=(4, 2),
                         shuffle=False, block_windows=64, slice_windows=4)
        plan = plan_epoch(cfg, 0, [space], [np.array([0, 12])])
        assert [f"{lo}-{hi - 1}" for lo, hi in zip(plan.sources[0].stream_lo, plan.sources[0].stream_lo[1:])] == \
            ranges
        for rank in range(world):
            for worker in range(max(1, workers)):
                schedule = plan.schedule(rank * max(1, workers) + worker)
                stands = [0] * len(schedule.lanes)
                for j in range(schedule.batches):
                    step = j * workers + worker if workers else j
                    for lane, n in schedule.parts(j)[0]:
                        windows = plan.sources[0].block(schedule.lanes[lane][1], 0)[0]
                        out.setdefault(step, [[] for _ in range(world)])[rank] += \
                            windows[stands[lane] : stands[lane] + n].tolist()
                        stands[lane] += n
        return out

    two = served(2, 2)
    assert len(two) == 8 and {k: two[k] for k in table} == table
    assert {k: v[0] for k, v in served(1, 0).items()} == {k: v[0] + v[1] for k, v in two.items()}


def test_striped_positions_are_a_permutation_with_each_chunk_one_run():
    """StripedOrder: every position of the streams' ranges lands once; chunk j holds, stream after stream, each
    stream's block j as one run (checked against a layout built here position by position)."""
    from streamwin.plan.order import StripedOrder

    class Identity:
        total = 0

        def at(self, v):
            return v

    lo = np.array([0, 7, 7, 20, 31])  # ranges of 7, 0, 13 and 11 positions
    bounds = [np.array([0, 3, 6, 7]), np.array([0, 0, 0, 0]), np.array([0, 5, 9, 15]), np.array([0, 4, 8, 9])]
    s = StripedOrder(Identity(), lo, bounds)  # stream 2's last block runs past its range: padding
    got = s.position(np.arange(31))
    want = {}
    at = 0
    for j in range(3):
        for a in range(4):
            for u in range(min(bounds[a][j], lo[a + 1] - lo[a]), min(bounds[a][j + 1], lo[a + 1] - lo[a])):
                want[lo[a] + u] = at
                at += 1
    for a in range(4):
        for u in range(min(bounds[a][-1], lo[a + 1] - lo[a]), lo[a + 1] - lo[a]):
            want[lo[a] + u] = at
            at += 1
    assert got.tolist() == [want[v] for v in range(31)]
    assert sorted(got.tolist()) == list(range(31))
    # runs placed by their first position (a block's items), or, crossing a segment, position by position
    for starts, counts in [([0, 7, 20], [3, 5, 4]), ([3, 12, 24], [3, 4, 4]), ([3, 25], [3, 4]), ([5, 18], [4, 6]),
                           ([30], [1]), ([], [])]:
        v = [x for a, n in zip(starts, counts) for x in range(a, a + n)]
        assert s.at_runs(np.array(starts, dtype=np.int64), np.array(counts, dtype=np.int64)).tolist() == \
            [want[x] for x in v], (starts, counts)


def test_a_process_block_is_each_slots_block_in_that_streams_own_order(corpus):
    """One phase: the block a process reads for its slots (GroupPlan: one pass over all of them) yields, per
    slot, the windows of that canonical stream's own block in its own order (SourcePlan, which an elastic rest
    reads), micro-batch by micro-batch: step after step, slot after slot."""
    url = corpus[0][0]
    ds = sw.WindowDataset(url, window=W, stride=S, batch_size=G, shuffle_buffer=64, seed=11, rank=0, world_size=1,
                          order=sw.Order(canonical=(4, 1)))
    plan = ds.plan(0)
    table = plan.slots.rows(0, plan.steps)  # [steps, slots, sources]
    group, slots = plan.schedule(0).plans[0], [table[:, a, 0] for a in range(table.shape[1])]
    step = 0
    for j in range(group.num_blocks(0)):
        g, _ = group.block(0, j)
        mine = [[] for _ in slots]
        at, steps = 0, int(group.edges[j + 1] - group.edges[j])
        for t in range(step, step + steps):
            for a, q in enumerate(slots):
                mine[a] += g[at : at + q[t]].tolist()
                at += q[t]
        assert at == len(g)
        for a in range(len(slots)):
            assert mine[a] == group.plan.block(a, j)[0].tolist(), (j, a)
        step += steps
    assert step == plan.steps > 4


def test_workers_of_chunked_canonical_streams_get_up_to_a_chunk_of_slots(corpus):
    """The loader takes a chunk's Q batches in a row from one worker: each worker gets up to Q spare slots for
    its next chunk, within CHUNK_BYTES for all of them; one worker, or one stream per rank and worker, as before."""
    from streamwin.feed.sizing import CHUNK_BYTES, MAX_SPARE, chunk_of, spare_slots

    mb = 1 << 20
    assert spare_slots(8 * mb, 2, chunk=40) == CHUNK_BYTES // (16 * mb) == 16
    assert spare_slots(mb, 2, chunk=40) == 40  # the whole chunk fits
    assert spare_slots(mb, 2) == spare_slots(mb, 2, chunk=1) == min(MAX_SPARE, (64 * mb) // (2 * mb))
    url = corpus[0][0]
    ds = sw.WindowDataset(url, window=W, stride=S, batch_size=G, shuffle_buffer=64, rank=0, world_size=1,
                          order=sw.Order(canonical=(4, 1)))
    assert chunk_of(ds, 5) == -(-64 // G) == 4 and chunk_of(ds, 1) == 1  # 5 workers, 4 slots: chunks of steps
    assert chunk_of(ds, 2) == chunk_of(ds, 3) == chunk_of(ds, 4) == 1  # 2 to 4 workers share each batch
    assert chunk_of(ds.transformed(lambda b, rng: b), 2) == 4  # a transform of whole batches: chunks
    assert chunk_of(sw.WindowDataset(url, window=W, stride=S, batch_size=G, rank=0, world_size=1), 2) == 1
    assert chunk_of(sw.WindowDataset(url, window=W, stride=S, batch_size=G, rank=0, world_size=1,
                                     order=sw.Order(canonical=(4, 2))), 2) == 1  # phases: workers take batches in turn


def test_a_packed_state_saved_before_small_blocks_were_counted_exactly_resumes_without_losing_crops(corpus,
                                                                                                monkeypatch):
    """A state of packed rows saved before plan.options.PACKING (no ``packing`` in its inputs) was planned with every
    block's rows estimated: its rest is dealt from that plan (an elastic resume), so no crop is seen twice or lost."""
    url = corpus[0][0]
    kw = dict(CASES["packed"], shuffle_buffer=16)  # small blocks: counted exactly, they fill other rows
    config = sw.WindowDataset.config
    with monkeypatch.context() as m:  # the code before: every block estimated, one stream a process by default
        m.setattr(sw.WindowDataset, "config", lambda self, *a, **k: replace(config(self, *a, **k), packing=1))
        whole = global_batches(lockstep(job(url, 2, 0, canonical=None, **kw), summary))
        first = job(url, 2, 0, canonical=None, **kw)
        before = global_batches(lockstep(first, summary, take=9))
        state = json.loads(json.dumps(first[0].state_dict()))
    del state["inputs"]["packing"], state["check"]  # as such a state was saved (before states carried a check)
    group = job(url, 2, 0, canonical="auto", **kw)
    for x in group:
        x.load_state_dict(state)
    seen = [c[1:3] for batch in before + global_batches(lockstep(group, summary)) for c in batch]
    assert len(seen) == len(set(seen)), "a crop twice"
    lost = {c[1:3] for batch in whole for c in batch} - set(seen)
    assert len(lost) < 32, f"{len(lost)} crops of the interrupted epoch lost"  # its rows counted anew: ~100
