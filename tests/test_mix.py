"""Weighted mixing of datasets (issue 14, item 2).

The pure part (streamwin.mix) is checked with hypothesis against arithmetic done here; the
loader is checked against windows computed naively from the two corpora in the test
(``reference_windows``), never against the plan. Ranks are simulated in one process
(explicit rank/world_size) and stepped in lockstep.
"""
from __future__ import annotations

import json
import math
import pickle
import re
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import streamwin as sw
from conftest import lockstep as step_ranks, make_sequences, reference_windows, two_corpora
from streamwin.plan import PlanConfig, WindowSpace, WindowSpec, make_plan, plan_epoch, rest_plan
from streamwin.plan.mix import batch_quotas, epoch_quotas, shares
from streamwin.plan.order import ShareOrder
from streamwin.plan.streams import RestOrder

W, S = 16, 8
B = 10
WEIGHTS = [0.5, 0.5]


# -- the pure part ------------------------------------------------------------------------------------
def fractions(weights):
    w = np.asarray(weights, dtype=np.float64)
    return w / w.sum()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(0, 100), min_size=1, max_size=6).filter(lambda w: sum(w) > 1e-3),
       st.integers(0, 10**7), st.data())
def test_shares_sum_to_the_epoch_each_within_one_of_its_weight(weights, total, data):
    windows = data.draw(st.lists(st.integers(0, 10**6), min_size=len(weights), max_size=len(weights)))
    got = shares(total, weights, windows)
    exact = fractions(weights) * total
    assert got.dtype == np.int64 and int(got.sum()) == total
    assert np.all(np.abs(got - exact) < 1 + 1e-6), (got, exact)


@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=6).filter(lambda n: sum(n) > 0))
def test_shares_without_weights_take_every_window_once(windows):
    assert shares(sum(windows), None, windows).tolist() == windows
    half = sum(windows) // 2  # another epoch size: in proportion to the windows
    got = shares(half, None, windows)
    assert int(got.sum()) == half and np.all(np.abs(got - np.asarray(windows) / sum(windows) * half) < 1 + 1e-6)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=6).filter(lambda w: sum(w) > 1e-3),
       st.integers(1, 300), st.integers(0, 1500))
def test_batch_quotas_are_floor_or_ceil_and_their_running_sums_stay_close(weights, batch, batches):
    q = batch_quotas(batch, weights, batches)
    target = fractions(weights) * batch  # windows of each source a batch should hold
    assert q.shape == (batches, len(weights)) and q.dtype == np.int64
    assert np.all(q.sum(axis=1) == batch)
    assert np.all((q >= np.floor(target - 1e-9)) & (q <= np.ceil(target + 1e-9)))
    run = np.cumsum(q, axis=0) - np.outer(np.arange(1, batches + 1), target)
    # a low-discrepancy offset per batch: the running count stays within O(log J) of w_i * B * j
    assert np.abs(run).max(initial=0) <= 1 + math.log(batches + 2), np.abs(run).max()


def slices_of(lengths, slice_windows):
    """Slices of a one-shard dataset of sequences whose window counts are ``lengths``: (first window, count)."""
    starts = np.concatenate([[0], np.cumsum(lengths)])
    lo = np.arange(0, starts[-1], slice_windows)
    n = np.minimum(lo + slice_windows, starts[-1]) - lo
    return lo.astype(np.int64), n.astype(np.int64)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300), st.integers(0, 2000), st.integers(1, 40), st.integers(0, 3), st.booleans())
def test_a_share_order_repeats_a_small_source_evenly_and_subsets_a_large_one(windows, total, slice_windows, epoch,
                                                                             shuffle):
    order = ShareOrder(*slices_of([windows], slice_windows), total, seed=1, epoch=epoch, source=0, shuffle=shuffle)
    got = order.at(np.arange(total))
    counts = np.bincount(got, minlength=windows)
    assert len(counts) == windows and counts.sum() == total
    assert counts.min() >= total // windows and counts.max() <= -(-total // windows)


def test_a_large_source_gives_another_subset_each_epoch():
    slices = slices_of([5000], 50)
    subsets = [frozenset(ShareOrder(*slices, 1000, seed=3, epoch=e, source=1, shuffle=True).at(np.arange(1000)).tolist())
               for e in range(3)]
    assert all(len(s) == 1000 for s in subsets) and len(set(subsets)) == 3


@pytest.mark.parametrize("world,workers,batch,taken", [(2, 2, 8, 5), (3, 0, 5, 7), (1, 3, 4, 10)])
def test_rest_order_of_windows_used_per_stream_equals_the_batch_form(world, workers, batch, taken):
    """The windows a plan says each stream used after ``taken`` batches are the batches' windows (round robin)."""
    cfg = PlanConfig(WindowSpec(4, 2), batch, world_size=world, num_workers=workers, seed=5, block_windows=7,
                     slice_windows=5)
    base = make_plan(np.full(40, 30), np.array([0, 13, 27, 40]), cfg, 1)
    n = cfg.workers_per_rank
    want = [min(taken // n + (s % n < taken % n), base.batches_per_stream) * batch for s in range(cfg.num_streams)]
    assert base.used(taken)[0].tolist() == want
    src = base.sources[0]
    a = RestOrder(src, want)  # what each stream would still yield: its real windows after the used ones
    assert a.total == sum(min(src.owned(s), src.windows_per_stream) for s in range(cfg.num_streams)) - sum(want)
    with pytest.raises(ValueError, match="used"):
        RestOrder(base.sources[0], [0])


# -- the loader over a large and a small dataset ------------------------------------------------------
@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """(urls, sequences per source): a large corpus and a small one (conftest.two_corpora)."""
    return two_corpora(tmp_path_factory.mktemp("mix"))


def loaders(urls, world, workers, batch=B, weights=WEIGHTS, epoch_windows=None, equalize="drop"):
    args = dict(window=W, stride=S, batch_size=batch, shuffle_buffer=64, seed=7, order=sw.Order(equalize=equalize),
                mix=sw.Mix(weights=weights, epoch_windows=epoch_windows))
    return [sw.WindowLoader(sw.WindowDataset(urls, rank=r, world_size=world, **args), num_workers=workers)
            for r in range(world)]


def lockstep(group, take=None, check=None):
    """Step one job's ranks together: per rank, a list of (windows, x, sources) per batch."""
    def summary(b):
        src = b["source"].tolist()
        return [(s, k, t) for s, k, t in zip(src, b["key"], b["start"].tolist())], b["x"].clone(), src
    return step_ranks(group, summary, take, check)


def flat(per_rank):
    return [w for batches in per_rank for ws, _, _ in batches for w in ws]


def content_check(seqs):
    def check(b):
        for i, (src, key, start) in enumerate(zip(b["source"].tolist(), b["key"], b["start"].tolist())):
            ref = seqs[src][key][start : start + W]
            assert len(ref) == W and np.array_equal(b["x"][i].numpy(), ref), (src, key, start)
    return check


def references(seqs):
    return [reference_windows(s, W, S) for s in seqs]


@pytest.mark.parametrize("workers", [0, 2])
def test_mixed_epochs_hold_each_sources_share_in_every_batch(corpora, workers):
    urls, seqs = corpora
    refs = references(seqs)
    n = [len(r) for r in refs]
    total = sum(n)
    share = [total * w for w in WEIGHTS]  # the independent reference: w_i * E
    streams = 2 * max(1, workers)
    group = loaders(urls, 2, workers)
    per_batch = [(math.floor(w * B), math.ceil(w * B)) for w in WEIGHTS]

    def check(b):
        content_check(seqs)(b)
        counts = np.bincount(b["source"].numpy(), minlength=2)
        assert all(lo <= c <= hi for c, (lo, hi) in zip(counts, per_batch)), counts

    epochs = []
    for epoch in range(2):
        for x in group:
            x.set_epoch(epoch)
        run = lockstep(group, check=check)
        assert len(run[0]) == len(run[1]) == len(group[0]) > 0, "equal steps on both ranks, as len() says"
        epochs.append(Counter(flat(run)))
    for seen in epochs:
        for i in range(2):
            mine = {w: c for w, c in seen.items() if w[0] == i}
            assert {(k, t) for _, k, t in mine} <= refs[i]
            got = sum(mine.values())
            # within 1 of w_i * E, less what equalize drops: fewer than streams * (ceil(w_i B) + 2 * log(J + 2) + 1)
            j = len(group[0]) // max(1, workers)
            drop = streams * (math.ceil(WEIGHTS[i] * B) + 2 * (1 + math.log(j + 2)) + 1)
            assert share[i] - 1 - drop <= got <= share[i] + 1, (i, got, share[i], drop)
        small = Counter({(k, t): c for (s, k, t), c in seen.items() if s == 1})
        reps = share[1] / n[1]
        assert max(small.values()) <= math.ceil(reps), "a small source's window repeats at most ceil(share / N)"
        assert sum(c < math.floor(reps) for c in small.values()) + (n[1] - len(small)) <= drop
        assert max(c for (s, _, _), c in seen.items() if s == 0) == 1, "a large source's window at most once"
    big = [{w for w in seen if w[0] == 0} for seen in epochs]
    assert big[0] != big[1], "a large source gives a different subset next epoch"


def test_mixed_same_seed_same_batches_and_a_dict_of_sources(corpora):
    urls, seqs = corpora
    a = lockstep(loaders(urls, 2, 0))
    named = loaders({"big": urls[0], "small": urls[1]}, 2, 0, weights={"small": 0.5, "big": 0.5})
    b = lockstep(named)
    assert [[w for w, _, _ in r] for r in a] == [[w for w, _, _ in r] for r in b]
    assert all(torch.equal(x[1], y[1]) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    keys = next(iter(named[0]))["key"]
    assert isinstance(list(keys), list) and pickle.loads(pickle.dumps(keys)) == list(keys)


@pytest.mark.parametrize("workers", [0, 2])
def test_mixed_resume_mid_epoch_is_byte_exact(corpora, workers):
    urls, seqs = corpora
    kw = dict(weights=[0.63, 0.37])  # quotas that vary from batch to batch (6/4, 7/3): the cursor must sum them
    whole = lockstep(loaders(urls, 2, workers, **kw))
    take = len(whole[0]) // 2 + 1
    first = loaders(urls, 2, workers, **kw)
    lockstep(first, take)
    states = [json.loads(json.dumps(x.state_dict())) for x in first]
    for x in first:
        x.close()
    again = loaders(urls, 2, workers, **kw)
    for x, s in zip(again, states):
        x.load_state_dict(s)
    rest = lockstep(again)
    assert [len(r) for r in rest] == [len(r) - take for r in whole]
    for ra, rb in zip(rest, whole):
        assert all(x[0] == y[0] and x[2] == y[2] and torch.equal(x[1], y[1]) for x, y in zip(ra, rb[take:]))


def test_mixed_elastic_resume_2x2_to_3x1_keeps_every_window_within_its_share(corpora):
    urls, seqs = corpora
    refs = references(seqs)
    reps = (sum(len(r) for r in refs) * WEIGHTS[1]) / len(refs[1])
    old = loaders(urls, 2, 2)
    take = len(old[0]) // 2 + 1
    before = lockstep(old, take)
    state = json.loads(json.dumps(old[1].state_dict()))
    for x in old:
        x.close()
    new = loaders(urls, 3, 1)
    for x in new:
        x.load_state_dict(state)
        x.set_epoch(0)
    lengths = {len(x) for x in new}
    after = lockstep(new, check=content_check(seqs))
    assert len({len(r) for r in after}) == 1 and lengths == {take + len(after[0])} and len(after[0]) > 0
    seen = Counter(flat(before) + flat(after))
    assert {(k, t) for s, k, t in seen if s == 0} <= refs[0] and {(k, t) for s, k, t in seen if s == 1} <= refs[1]
    assert max(c for (s, _, _), c in seen.items() if s == 0) == 1, "no window of the large source twice"
    assert max(c for (s, _, _), c in seen.items() if s == 1) <= math.ceil(reps), "the small one within its repeats"
    for _, _, src in (b for r in after for b in r):
        counts = np.bincount(src, minlength=2)
        assert counts.min() >= math.floor(B * 0.5) and counts.max() <= math.ceil(B * 0.5)


def test_sources_of_another_dtype_or_feature_shape_are_refused_naming_both(corpora, tmp_path):
    urls, _ = corpora
    for name, seqs in (("f64", make_sequences(6, seed=1, dtype=np.float64)), ("f2", make_sequences(6, features=(2,)))):
        other = str(tmp_path / name)
        sw.pack(list(seqs.items()), other, progress=False)
        with pytest.raises(ValueError, match="dtype|feature shape") as e:
            sw.WindowDataset([urls[0], other], window=W)
        assert urls[0] in str(e.value) and other in str(e.value)


@pytest.mark.parametrize("kw,match", [
    (dict(weights=[1.0]), "weights must be a list of 2"),
    (dict(weights=[1.0, -1.0]), "weights must be finite"),
    (dict(weights=[0, 0]), "not all 0"),
    (dict(weights={"a": 1}), "weights must be a list"),
    (dict(epoch_windows=-1), "epoch_windows must be an integer"),
])
def test_bad_mixing_arguments_are_named(corpora, kw, match):
    urls, _ = corpora
    with pytest.raises((ValueError, TypeError), match=match):
        sw.WindowDataset(urls, window=W, mix=sw.Mix(**kw))


def test_weights_need_several_urls(corpora):
    with pytest.raises(ValueError, match="weights=.*list or dict of URLs"):
        sw.WindowDataset(corpora[0][0], window=W, mix=sw.Mix(weights=[1.0]))


def test_a_state_of_other_weights_or_sources_is_refused(corpora):
    urls, _ = corpora
    group = loaders(urls, 2, 0)
    lockstep(group, 3)
    state = group[0].state_dict()
    for kw, name in ((dict(weights=[0.7, 0.3]), "weights"), (dict(epoch_windows=500), "epoch_windows")):
        with pytest.raises(sw.StateMismatchError, match=name):
            loaders(urls, 2, 0, **kw)[0].load_state_dict(state)
    with pytest.raises(sw.StateMismatchError, match="dataset"):
        loaders(urls[::-1], 2, 0)[0].load_state_dict(state)


def test_a_url_alone_is_a_mix_of_one_whose_states_name_it_as_before(corpora):
    """One URL is a mix of one (plan/mix.py ``Mixing``): plan_inputs takes what names the sources from it, with no
    branch on how the URL was given, and records exactly what states of today hold: a URL alone by its index.json
    digest only; a list or dict (even of one) by the digests, names, weights and epoch size, after split."""
    import hashlib
    import inspect
    import pathlib

    urls, _ = corpora
    digest = [hashlib.sha256(pathlib.Path(u, "index.json").read_bytes()).hexdigest()[:16] for u in urls]
    common = ["batch_size", "world_size", "num_workers", "seed", "shuffle", "block_windows", "slice_windows",
              "equalize", "canonical", "window", "stride", "horizon", "pad", "dataset", "split"]
    named = ["sources", "weights", "epoch_windows"]
    cases = [(urls[0], common, digest[0], None), ([urls[0]], common + named, digest[:1], [urls[0]]),
             ({"a": urls[0], "b": urls[1]}, common + named, digest, ["a", "b"])]
    for url, keys, dataset, sources in cases:
        inputs = sw.WindowDataset(url, window=W, rank=0, world_size=1).plan_inputs()
        assert list(inputs) == keys and inputs["dataset"] == dataset and inputs.get("sources") == sources
    inputs = sw.WindowDataset(urls, window=W, rank=0, world_size=1,
                              mix=sw.Mix(weights=[1, 3], epoch_windows=9)).plan_inputs()
    assert (inputs["dataset"], inputs["weights"], inputs["epoch_windows"]) == (digest, [1.0, 3.0], 9)
    source = inspect.getsource(sw.WindowDataset.plan_inputs)
    assert "isinstance" not in source and "self.url" not in source and "len(self.sources)" not in source


def test_epoch_windows_and_summary_per_source(corpora):
    urls, seqs = corpora
    n = [len(r) for r in references(seqs)]
    ds = sw.WindowDataset(urls, window=W, stride=S, batch_size=B, rank=0, world_size=1,
                          mix=sw.Mix(weights=[0.7, 0.3], epoch_windows=1001))
    out = ds.summary()
    assert [s["windows"] for s in out["sources"]] == n
    assert [s["share"] for s in out["sources"]] == [701, 300] and out["windows_per_epoch"] == 1001
    assert [s["repeat"] for s in out["sources"]] == [round(701 / n[0], 4), round(300 / n[1], 4)]
    got = Counter(s for b in sw.WindowLoader(ds, num_workers=0) for s in b["source"].tolist())
    assert got[0] + got[1] == len(ds) * B and abs(got[0] - 0.7 * len(ds) * B) <= 1 + math.log(len(ds) + 2)


def test_mixing_without_weights_takes_every_window_at_most_once(corpora):
    urls, seqs = corpora
    refs = references(seqs)
    group = loaders(urls, 2, 0, weights=None)
    seen = Counter(flat(lockstep(group, check=content_check(seqs))))
    assert max(seen.values()) == 1
    dropped = sum(len(r) for r in refs) - len(seen)
    assert 0 <= dropped < 2 * (B + 2 * (1 + math.log(len(group[0]) + 2)) + 1) * 2


def test_inspect_of_several_urls_shows_each_sources_windows_share_and_repeats(corpora, capsys):
    from streamwin.cli import main

    urls, seqs = corpora
    n = [len(r) for r in references(seqs)]
    code = main(["inspect", *urls, "--window", str(W), "--stride", str(S), "--batch-size", str(B),
                 "--weights", "0.25,0.75"])
    out = capsys.readouterr().out
    assert code == 0 and out.count("dataset ") == 2
    share = [round(0.25 * sum(n)), sum(n) - round(0.25 * sum(n))]
    for url, windows, sh in zip(urls, n, share):
        assert re.search(rf"{re.escape(url)}\s+{windows:,}\s+{sh:,}\s+{sh / windows:.3f}\n", out), out
    assert main(["inspect", *urls, "--weights", "1"]) == 2 and "--weights lists 1 numbers for 2" in capsys.readouterr().err


def test_train_ddp_example_mixes_two_datasets_by_weight(corpora, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    urls, seqs = corpora
    repo = Path(__file__).resolve().parent.parent
    rec = tmp_path / "rec"
    cmd = [sys.executable, str(repo / "examples" / "train_ddp.py"), "--data", ",".join(urls), "--weights", "0.7,0.3",
           "--ckpt", str(tmp_path / "ck.pt"), "--steps", "4", "--window", str(W), "--horizon", "4",
           "--batch-size", str(B), "--record", str(rec), "--log-every", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(repo)))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in (rec / "rank0.jsonl").read_text().splitlines()]
    assert len(lines) == 4
    for line in lines:
        got = Counter(line["source"])
        assert sorted(got) == [0, 1] and got[0] == 7 and got[1] == 3, got  # 0.7 * 10 and 0.3 * 10: exact
        assert all(k in seqs[s] for s, k in zip(line["source"], line["key"]))


def test_readme_mixing_snippet_runs_as_pasted(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    text = (repo / "docs" / "mixing.md").read_text()
    m = re.search(r"^# Mixing datasets\n(.*?)(?=^# |\Z)", text, flags=re.M | re.S)
    assert m, "docs/mixing.md has no 'Mixing datasets' section"
    blocks = re.findall(r"^```python\n(.*?)^```", m.group(1), flags=re.M | re.S)
    assert len(blocks) == 1, "the page has one python block"
    r = subprocess.run([sys.executable, "-c", blocks[0]], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(repo)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"ecg: \d+ windows", r.stdout) and "[35, 15]" in r.stdout, r.stdout


# -- the whole mixed plan, simulated for every stream (pure, no I/O) --------------------------------------
def simulate(plan, batches_per_rank=None):
    """Per source, the windows every stream yields (of the first ``batches_per_rank`` batches per rank)."""
    cfg = plan.config
    out = [Counter() for _ in plan.sources]
    for s in range(cfg.num_streams):
        j = plan.batches_per_stream if batches_per_rank is None else plan.taken(s, batches_per_rank)
        for i, p in enumerate(plan.sources):
            n = int(plan.quotas[:j, i].sum())
            blocks = [p.block(s, b) for b in range(p.num_blocks(s))]
            got = np.concatenate([g[real] for g, real in blocks]) if blocks else np.zeros(0, dtype=np.int64)
            out[i].update(got[:n].tolist())
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=3), st.lists(st.floats(0.05, 1), min_size=3, max_size=3),
       st.integers(1, 3), st.integers(0, 3), st.integers(1, 12), st.integers(0, 2), st.booleans())
def test_a_mixed_plan_gives_each_source_its_share_within_equal_streams(sizes, weights, world, workers, batch, epoch,
                                                                      shuffle):
    spec = WindowSpec(4, 2)
    cfg = PlanConfig(spec, batch, world_size=world, num_workers=workers, seed=3, shuffle=shuffle, block_windows=9,
                     slice_windows=4)
    lengths = [np.full(n, 4 + 2 * (k + 1)) for k, n in enumerate(sizes)]  # source k: n sequences of k + 2 windows
    windows = [int(n * (k + 2)) for k, n in enumerate(sizes)]
    w = weights[: len(sizes)]
    plan = plan_epoch(cfg, epoch, [WindowSpace(x, spec) for x in lengths],
                      [np.array([0, len(x) // 2, len(x)]) for x in lengths], w, None, [str(k) for k in range(len(sizes))])
    total = sum(windows)
    share = fractions(w) * total
    got = simulate(plan)
    streams, j = cfg.num_streams, plan.batches_per_stream
    assert plan.quotas.shape == (j, len(sizes)) and np.all(plan.quotas.sum(axis=1) == batch)
    for k in range(len(sizes)):
        n = sum(got[k].values())
        assert n == streams * int(plan.quotas[:, k].sum()) <= share[k] + 1
        assert set(got[k]) <= set(range(windows[k]))
        assert max(got[k].values(), default=0) <= math.ceil((share[k] + 1) / windows[k])
    # equal steps: J is the most batches every source fits; one more would overrun some stream of some source
    more = batch_quotas(batch, w, j + 1).sum(axis=0)
    per_stream_min = [int(p.stream_lo[1:].__sub__(p.stream_lo[:-1]).min()) for p in plan.sources]
    assert any(more[k] > per_stream_min[k] for k in range(len(sizes))) or j == 0 and total < streams * batch


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 40), st.integers(1, 3), st.integers(0, 2), st.integers(1, 3), st.integers(0, 2),
       st.integers(1, 8), st.data())
def test_a_mixed_elastic_rest_yields_nothing_twice_beyond_the_share(n, world, workers, world2, workers2, batch, data):
    spec = WindowSpec(4, 2)
    cfg = PlanConfig(spec, batch, world_size=world, num_workers=workers, seed=1, block_windows=7, slice_windows=3)
    lengths = [np.full(6 * n, 10), np.full(n, 8)]  # 4 and 3 windows per sequence: a large and a small source
    windows = [24 * n, 3 * n]
    plan = plan_epoch(cfg, 0, [WindowSpace(x, spec) for x in lengths], [np.array([0, len(x)]) for x in lengths],
                      [0.5, 0.5], None, ["big", "small"])
    taken = data.draw(st.integers(0, plan.batches_per_rank))
    before = simulate(plan, taken)
    cfg2 = PlanConfig(spec, data.draw(st.integers(1, 8)), world_size=world2, num_workers=workers2, seed=1, block_windows=5, slice_windows=3)
    rest = rest_plan(plan, taken, cfg2)
    after = simulate(rest)
    share = [sum(windows) / 2] * 2
    for k in range(2):
        seen = before[k] + after[k]
        assert max(seen.values(), default=0) <= math.ceil((share[k] + 1) / windows[k])
        assert sum(seen.values()) <= share[k] + 1
    assert max((before[0] + after[0]).values(), default=0) <= 1, "the large source: each window at most once"


def test_mixed_padding_yields_each_sources_share_exactly_repeats_weigh_zero(corpora):
    urls, seqs = corpora
    refs = references(seqs)
    total = sum(len(r) for r in refs)
    group = loaders(urls, 2, 0, equalize="pad")
    real = Counter()
    for rank in group:
        for b in rank:
            keep = (b["weight"] > 0).tolist()
            real.update(s for s, k in zip(b["source"].tolist(), keep) if k)
    # with "pad" nothing is dropped: each source gives exactly its share (largest remainder of 0.5 * E)
    assert sorted(real.values()) == sorted([total // 2, total - total // 2]), (real, total)
    assert len(group[0]) == len(group[1])


@pytest.mark.parametrize("weights,small", [([0.999, 0.001], 7), ([0.999, 0.001], 4), ([0.998, 0.002], 7),
                                           ([0.5, 0.5], 7), ([0.01, 0.99], 7)])
def test_padded_quotas_cover_every_streams_range_even_for_a_tiny_weight(weights, small):
    cfg = PlanConfig(WindowSpec(4, 2), 100, equalize="pad")
    sizes = [np.array([3000, 2999]), np.array([small, small - 1])]
    q = epoch_quotas(cfg, np.asarray(weights), sizes)
    cum = q.sum(axis=0)
    assert all(cum[k] >= sizes[k].max() for k in range(2)), cum  # every real window is yielded
    shorter = q[:-1].sum(axis=0)
    assert any(shorter[k] < sizes[k].max() for k in range(2)), "the fewest batches that cover"


def test_sources_blocks_are_shuffled_independently():
    """Two sources' blocks of one stream get different in-block permutations (not one RNG key for both)."""
    from streamwin.plan.epoch import deal

    spec = WindowSpec(4, 4)
    space = WindowSpace(np.full(100, 40), spec)
    order = lambda i: ShareOrder(np.arange(0, 1000, 100), np.full(10, 100), 1000, seed=0, epoch=0, source=i,
                                 shuffle=True)
    cfg = PlanConfig(spec, batch_size=8, block_windows=64)
    plan = deal(cfg, 0, [0.5, 0.5], [order(0), order(1)], [space, space])
    a, b = (p.block_parts(0, 0)[2] for p in plan.sources)
    assert len(a) == len(b) and not np.array_equal(a, b)


@given(st.lists(st.floats(0.05, 1.0), min_size=2, max_size=4), st.integers(8, 300), st.integers(1, 9),
       st.integers(0, 400), st.integers(0, 400))
@settings(max_examples=40, deadline=None)
def test_slot_quotas_made_a_run_of_steps_at_a_time_are_the_whole_tables(weights, batch, every, t0, t1):
    """A plan keeps a chunk's running sums and makes any run of micro-batches' quotas when it is read (SlotQuotas):
    the same integers as the table of the whole epoch made at once, and the running sums its prefix sums."""
    from streamwin.plan.canon import slot_sizes
    from streamwin.plan.mix import SlotQuotas, normalized, slot_quotas

    m, w, steps = slot_sizes(batch, 8), normalized(weights), 401
    whole = slot_quotas(m, w, steps)
    assert (whole.sum(axis=1) == batch_quotas(batch, w, steps)).all()  # each micro-row is the global batch's quotas
    from streamwin.plan import mix

    with pytest.MonkeyPatch.context() as patch:  # running sums made several spans of rows at a time
        patch.setattr(mix, "SPAN_STEPS", 3 * every + 1)
        spans = SlotQuotas(m, w, steps, every)
    table = SlotQuotas(m, w, steps, every)
    assert np.array_equal(spans.prefix, table.prefix)
    again = pickle.loads(pickle.dumps(table))  # a plan travels to workers started by spawn: its cache does not
    assert np.array_equal(again.chunk(1), whole[every : 2 * every]) and not again.chunk(1).flags.writeable
    lo, hi = min(t0, t1), max(t0, t1)
    assert np.array_equal(table.rows(lo, hi), whole[lo:hi])
    assert np.array_equal(table.before(hi), whole[:hi].sum(axis=0))
    assert np.array_equal(table.at(np.array([lo, hi, steps])), np.cumsum(
        np.concatenate([np.zeros((1, 8, len(w)), np.int64), whole]), axis=0)[[lo, hi, steps]])


@pytest.mark.parametrize("canonical", [(8, 1), (8, 2), (4, 4)])
def test_a_mix_dealt_again_walks_its_slots_quotas_once(monkeypatch, canonical):
    """A mix's ranges are dealt again in proportion to what each stream takes (canon_deal.REDEALS): each deal only
    counts its steps from one set of running sums of the slots' quotas, and the plan's SlotQuotas is built once,
    for the deal kept: about 2 micro-batches' quotas made per micro-batch of the epoch, not 2 a deal."""
    from streamwin.plan import canon_deal, mix

    made, built, real = [], [], mix.slot_quotas

    def counted(m, w, micro, first=0):
        made.append(micro)
        return real(m, w, micro, first)

    class Built(mix.SlotQuotas):
        def __init__(self, *args):
            built.append(args)
            super().__init__(*args)
    monkeypatch.setattr(mix, "slot_quotas", counted)
    monkeypatch.setattr(canon_deal, "slot_quotas", counted)
    monkeypatch.setattr(canon_deal, "SlotQuotas", Built)
    spec, rng = WindowSpec(4, 2), np.random.default_rng(0)
    spaces = [WindowSpace(rng.integers(4, 200, size=n), spec) for n in (300, 40)]
    cfg = PlanConfig(spec, batch_size=5, world_size=2, canonical=canonical, block_windows=64, slice_windows=50)
    plan = plan_epoch(cfg, 0, spaces, [np.array([0, 100, 200, 300]), np.array([0, 40])], [0.8, 0.2])
    micro = -(-plan.steps // canonical[1])
    assert len(built) == 1 and micro > 400
    assert sum(made) < 3 * micro, (sum(made), micro)
