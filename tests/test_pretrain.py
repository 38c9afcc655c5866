"""Pretraining crops (issue 21): jitter, drawn lengths, k crops per sequence, packed rows, missing values.

Every property is checked against what the test computes from the sequences themselves (their
lengths and values), never against the planner: which crops a sequence may give (its stride
grid, or its distinct starts), that each crop's steps are the sequence's, at most once per
epoch, lengths in range, rows full. Ranks are simulated in one process and stepped in lockstep.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import warnings
from collections import Counter

import numpy as np
import pytest
import torch

import streamwin as sw
from conftest import lockstep, make_sequences, two_corpora

W, S = 16, 8
OPEN: list[sw.WindowLoader] = []


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    seqs = make_sequences(80, seed=5, max_len=300)
    url = str(tmp_path_factory.mktemp("pretrain") / "ds")
    sw.pack(list(seqs.items()), url, shard_bytes=30_000, progress=False)
    return url, seqs


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    return two_corpora(tmp_path_factory.mktemp("pretrain_mix"))


@pytest.fixture(autouse=True)
def close_loaders():
    yield
    while OPEN:
        OPEN.pop().close()


def loader(url, workers=0, device=None, *, rank=0, world=1, batch=4, horizon=0, select=None, mix=None,
           **crops) -> sw.WindowLoader:
    """A loader of ``url`` cutting ``sw.Crops(**crops)``."""
    ds = sw.WindowDataset(url, window=W, stride=S, horizon=horizon, batch_size=batch, shuffle_buffer=48, seed=11,
                          rank=rank, world_size=world, crops=sw.Crops(**crops), select=select, mix=mix)
    ld = sw.WindowLoader(ds, num_workers=workers, device=device)
    OPEN.append(ld)
    return ld


def batches(ld, epoch=0, take=None) -> list[dict]:
    """The loader's batches of ``epoch`` (tensors cloned, keys as lists)."""
    ld.set_epoch(epoch)
    out = []
    for b in ld:
        out.append({k: v.clone() if torch.is_tensor(v) else list(v) for k, v in b.items()})
        if take is not None and len(out) == take:
            break
    return out


def crops_of(b: dict) -> list[tuple]:
    """(source, key, start, length) of every real crop of a batch (windows: length = window unless drawn)."""
    n = len(b["key"])
    source = b["source"].tolist() if "source" in b else [0] * n
    length = b["length"].tolist() if "length" in b else [W] * n
    weight = b["weight"].tolist() if "weight" in b else [1] * n
    return [(s, k, st, ln) for s, k, st, ln, w in zip(source, b["key"], b["start"].tolist(), length, weight) if w]


def grid(t: int, span: int, stride: int, pad: bool = False) -> int:
    """Windows of the stride grid in a sequence of t steps (one padded window if short and padding)."""
    return (t - span) // stride + 1 if t >= span else int(pad and t > 0)


def assert_same(a: list[dict], b: list[dict]) -> None:
    """The same batches, field by field, bit for bit, dtype and device aside."""
    assert len(a) == len(b) > 0
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), i
        for k in x:
            if k == "key":
                assert x[k] == y[k], i
            else:
                assert x[k].dtype == y[k].dtype and torch.equal(x[k].cpu(), y[k].cpu()), (i, k)


def check_windows(seqs: dict, got: list[dict], horizon: int = 0) -> None:
    """Each window's steps are its sequence's from its start: x up to its length (zeros after), y after the crop."""
    for b in got:
        n = len(b["key"])
        length = b["length"].tolist() if "length" in b else [W] * n
        for i, (key, st, ln) in enumerate(zip(b["key"], b["start"].tolist(), length)):
            seq = seqs[key]
            ref = np.zeros((W,) + seq.shape[1:], seq.dtype)
            ref[:ln] = seq[st : st + ln]
            assert np.array_equal(b["x"][i].numpy(), ref), (key, st, ln)
            if horizon:
                yref = np.zeros((horizon,) + seq.shape[1:], seq.dtype)
                part = seq[st + ln : st + ln + horizon]
                yref[: len(part)] = part
                assert np.array_equal(b["y"][i].numpy(), yref), (key, st, ln)


# -- jitter ----------------------------------------------------------------------------------------

def test_jitter_moves_each_grid_window_within_its_stride_keeping_every_sequences_count(corpus):
    url, seqs = corpus
    got = batches(loader(url, batch=1, jitter=True))  # one stream, batch 1: nothing dropped
    check_windows(seqs, got)
    per_seq = Counter(k for b in got for k in b["key"])
    assert dict(per_seq) == {k: grid(len(v), W, S) for k, v in seqs.items() if grid(len(v), W, S)}
    slots = set()
    for b in got:
        for key, st in zip(b["key"], b["start"].tolist()):
            assert 0 <= st and st + W <= len(seqs[key])
            slots.add((key, st // S))  # its grid slot: it moved by less than the stride
    assert len(slots) == sum(per_seq.values()), "two crops of one sequence share a slot"
    moved = sum(st % S != 0 for b in got for st in b["start"].tolist())
    assert moved > len(slots) // 2, "jitter moved almost no window"


def test_jitter_draws_new_offsets_each_epoch_independent_of_world_workers_and_batch(corpus):
    url, _ = corpus
    starts = {(k, s // S): s for b in batches(loader(url, batch=1, jitter=True)) for k, s in
              zip(b["key"], b["start"].tolist())}
    again = {(k, s // S): s for b in batches(loader(url, batch=1, jitter=True), epoch=1) for k, s in
             zip(b["key"], b["start"].tolist())}
    assert starts.keys() == again.keys() and starts != again, "a new epoch draws new offsets"
    group = [loader(url, 2, rank=r, world=2, batch=3, jitter=True) for r in range(2)]
    for ld in group:
        ld.set_epoch(0)
    other = {(k, s // S): s for rank in lockstep(group, lambda b: list(zip(b["key"], b["start"].tolist())))
             for batch in rank for k, s in batch}
    assert other and all(starts[slot] == s for slot, s in other.items()), "a crop moved with the world"


@pytest.mark.parametrize("opts", [dict(jitter=True), dict(windows_per_sequence=3)], ids=["jitter", "k"])
def test_crops_stay_inside_a_temporal_split(corpus, opts):
    url, seqs = corpus
    h = 20
    got = batches(loader(url, batch=1, select=sw.Select(split="train", holdout=h), **opts))
    check_windows(seqs, got)
    assert got and all(st + W <= len(seqs[k]) - 2 * h for b in got for k, st in zip(b["key"], b["start"].tolist()))


# -- drawn lengths ---------------------------------------------------------------------------------

@pytest.mark.parametrize("pad", [False, True])
def test_lengths_are_multiples_of_window_multiple_in_range_right_padded_with_a_mask(corpus, pad):
    url, seqs = corpus
    h = 3
    got = batches(loader(url, batch=1, horizon=h, min_window=5, window_multiple=4, pad=pad))
    check_windows(seqs, got, horizon=h)
    lengths = Counter()
    for b in got:
        (ln,), (key,), (st,) = b["length"].tolist(), b["key"], b["start"].tolist()
        t = len(seqs[key])
        assert b["mask"][0].tolist() == [i < ln for i in range(W)]
        if t >= W + h:
            assert ln % 4 == 0 and 8 <= ln <= W, ln  # multiples of 4 in [5, 16]: 8, 12, 16
            lengths[ln] += 1
        else:  # a padded short sequence: what it has, at most a drawn length
            assert pad and st == 0 and ln <= t
        if pad:
            assert b["y_mask"][0].tolist() == [i < t - st - ln for i in range(h)]
    assert set(lengths) == {8, 12, 16} and min(lengths.values()) > sum(lengths.values()) / 6


# -- k crops per sequence --------------------------------------------------------------------------

def test_windows_per_sequence_gives_k_stratified_distinct_crops_or_one_per_start(corpus):
    url, seqs = corpus
    k = 3
    got = batches(loader(url, batch=1, windows_per_sequence=k))
    check_windows(seqs, got)
    starts: dict[str, list[int]] = {}
    for b in got:
        starts.setdefault(b["key"][0], []).append(int(b["start"][0]))
    want = {key: min(k, len(v) - W + 1) for key, v in seqs.items() if len(v) >= W}
    assert {key: len(s) for key, s in starts.items()} == want
    for key, s in starts.items():
        room, n = len(seqs[key]) - W + 1, want[key]
        for j, st in enumerate(sorted(s)):  # crop j in stratum j of the room
            assert j * room // n <= st < (j + 1) * room // n, (key, j, st, room)
    again = [int(b["start"][0]) for b in batches(loader(url, batch=1, windows_per_sequence=k), epoch=1)]
    assert sorted(again) != sorted(st for s in starts.values() for st in s), "new crops each epoch"


# -- packed rows -----------------------------------------------------------------------------------

def check_rows(seqs_of, got: list[dict], length: int, shortest: int) -> set:
    """Rows hold whole crops side by side: segments 1..n in row order, positions 0.. within each crop, the
    crop's steps from its sequence, zeros (segment 0) elsewhere. Returns the crops seen (none twice)."""
    seen = set()
    for b in got:
        seg, pos, x = b["segment_ids"].numpy(), b["positions"].numpy(), b["x"].numpy()
        assert seg.dtype == np.int32 and pos.dtype == np.int32 and seg.shape == (len(x), length)
        ranks = Counter()
        source = b["source"].tolist() if "source" in b else [0] * len(b["key"])
        for src, key, st, ln, row in zip(source, b["key"], b["start"].tolist(), b["length"].tolist(),
                                         b["row"].tolist()):
            ranks[row] += 1
            where = np.flatnonzero(seg[row] == ranks[row])
            assert len(where) == ln and (np.diff(where) == 1).all() and (pos[row, where] == np.arange(ln)).all()
            assert shortest <= ln <= W or ln == len(seqs_of(src)[key]) < W
            assert np.array_equal(x[row, where], seqs_of(src)[key][st : st + ln]), (key, st, ln)
            assert (src, key, st) not in seen, "a crop came twice in an epoch"
            seen.add((src, key, st))
        assert (x[seg == 0] == 0).all() and (pos[seg == 0] == 0).all()
        for row in range(len(x)):  # ids run 1..n in row order, each crop one run
            ids = seg[row][seg[row] > 0]
            assert (np.diff(ids) >= 0).all() and (len(ids) == 0 or ids.max() == ranks[row])
    return seen


@pytest.mark.parametrize("opts, shortest", [(dict(min_window=5, window_multiple=2, jitter=True), 6),
                                            (dict(pad=True, min_window=3), 3), (dict(windows_per_sequence=2), W)],
                         ids=["drawn", "padded", "k"])
def test_packed_rows_hold_whole_crops_once_each(corpus, opts, shortest):
    url, seqs = corpus
    ld = loader(url, pack_length=48, **opts)
    got = batches(ld)
    assert len(got) == len(ld) > 5
    seen = check_rows(lambda s: seqs, got, 48, shortest)
    per_seq = Counter(key for _, key, _ in seen)
    for key, n in per_seq.items():
        t = len(seqs[key])
        most = min(2, t - W + 1) if "windows_per_sequence" in opts else grid(t, W, S, opts.get("pad", False))
        assert n <= most


def test_rows_are_97_percent_full_for_lengths_64_to_512_into_2048(tmp_path):
    rng = np.random.default_rng(0)
    url = str(tmp_path / "long")
    sw.pack([(f"s{i}", rng.standard_normal(int(n)).astype(np.float32)) for i, n in
             enumerate(rng.integers(600, 4000, 160))], url, progress=False)
    ds = sw.WindowDataset(url, window=512, stride=64, batch_size=8, seed=1,
                          rank=0, world_size=1, crops=sw.Crops(min_window=64, pack_length=2048))
    fill, lengths, spread, mean = [], [], [], []
    for b in sw.WindowLoader(ds, num_workers=0):
        fill.append((b["segment_ids"] > 0).float().mean().item())
        lengths += b["length"].tolist()
        spread.append(np.ptp(b["length"].numpy()))
        mean.append(b["length"].float().mean().item())
    # best fit fills rows largest crops first: unshuffled rows give batches of one length, longest first
    # (measured: 20-37% of batches spread over 256 steps, a correlation of -0.95 with the step; shuffled: 96-100%)
    assert np.mean(np.array(spread) > 256) >= 0.9, "batches of crops of one length: rows not shuffled"
    assert abs(np.corrcoef(np.arange(len(mean)), mean)[0, 1]) < 0.5, "rows longest first: not shuffled"
    assert min(lengths) >= 64 and max(lengths) <= 512 and len(set(lengths)) > 300
    assert np.mean(fill) >= 0.97, np.mean(fill)
    assert ds.summary()["rows_per_rank"] == 8 * len(fill)


def test_readme_pretraining_snippet_runs_as_pasted(tmp_path):
    from test_readme import code_blocks, section

    blocks = code_blocks(section("Pretraining a foundation model", "docs/pretraining.md"), "python")
    assert len(blocks) == 1
    r = subprocess.run([sys.executable, "-c", blocks[0]], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(pathlib.Path(__file__).resolve().parent.parent)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "'segment_ids': (8, 2048)" in r.stdout and "'source': (" in r.stdout, r.stdout
    # rows ~98% full on a large corpus; this small mix: a partly filled row per canonical stream and block
    assert float(re.search(r"rows ([\d.]+)% full", r.stdout).group(1)) > 80, r.stdout


def test_packing_refuses_horizon_and_padding_repeats(corpus):
    url, _ = corpus
    with pytest.raises(ValueError, match="horizon=0 with it"):
        sw.WindowDataset(url, window=W, horizon=2, crops=sw.Crops(pack_length=64))
    with pytest.raises(ValueError, match="equalize='pad'"):
        sw.WindowDataset(url, window=W, crops=sw.Crops(pack_length=64), order=sw.Order(equalize="pad"))


@pytest.mark.parametrize("kw, match", [
    (dict(min_window=17), "min_window must be <= window"),
    (dict(min_window=0), r"min_window must be an integer in 1\.\..*got 0"),
    (dict(pack_length=8), "pack_length must be >= window"),
    (dict(window_multiple=0), r"window_multiple must be an integer in 1\.\..*got 0"),
    (dict(window_multiple=5), "window must be a multiple of window_multiple"),
    (dict(windows_per_sequence=0), r"windows_per_sequence must be an integer in 1\.\..*got 0"),
    (dict(window_multiple=4, pack_length=50), "pack_length must be a multiple of window_multiple"),
    (dict(jitter=1), "jitter must be True or False"),
    (dict(missing="drop"), "missing must be None or 'mask'"),
])
def test_bad_pretraining_arguments_are_refused_naming_the_argument(corpus, kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        sw.WindowDataset(corpus[0], window=W, crops=sw.Crops(**kw))


# -- every delivery, the same batches; equal steps; resume ---------------------------------------

COMBOS = {"jitter": dict(jitter=True), "drawn": dict(min_window=4, window_multiple=4, horizon=3, pad=True),
          "k": dict(windows_per_sequence=3, jitter=True),
          "packed": dict(pack_length=64, min_window=4, window_multiple=4, jitter=True, missing="mask")}


@pytest.mark.parametrize("combo", sorted(COMBOS))
def test_workers_and_device_cpu_are_bitwise_in_process(corpus, combo):
    url, _ = corpus
    kw = COMBOS[combo]
    one = batches(loader(url, 0, **kw), epoch=1)
    assert_same(one, batches(loader(url, 1, **kw), epoch=1))
    assert_same(one, batches(loader(url, 0, "cpu", **kw), epoch=1))
    assert_same(batches(loader(url, 2, **kw), epoch=1), batches(loader(url, 2, "cpu", **kw), epoch=1))


@pytest.mark.parametrize("workers", [0, 2])
def test_mixed_packed_rows_follow_row_quotas_and_device_cpu_is_bitwise(mix, workers):
    urls, seqs = mix
    kw = dict(mix=sw.Mix(weights=[0.9, 0.1], epoch_windows=2000), pack_length=48, min_window=4, window_multiple=2,
              jitter=True)
    got = batches(loader(urls, workers, **kw))
    assert_same(got, batches(loader(urls, workers, "cpu", **kw)))
    seen = check_rows(lambda s: seqs[s], got, 48, shortest=4)
    assert {s for s, _, _ in seen} == {0, 1}
    for b in got:  # rows are grouped by source: a source's crops fill consecutive rows
        src, row = b["source"].tolist(), b["row"].tolist()
        assert src == sorted(src) and all(row[i] <= row[i + 1] for i in range(len(row) - 1))


@pytest.mark.parametrize("combo", sorted(COMBOS))
def test_equal_steps_on_every_rank_and_the_same_crops_run_after_run(corpus, combo):
    url, _ = corpus
    kw = COMBOS[combo]
    for world in (2, 3):
        group = [loader(url, rank=r, world=world, batch=3, **kw) for r in range(world)]
        for ld in group:
            ld.set_epoch(2)
        per_rank = lockstep(group, lambda b: crops_of(b))  # asserts the ranks end at the same step
        assert len({len(ld) for ld in group}) == 1 and len(per_rank[0]) == len(group[0]) > 0
        flat = [c for rank in per_rank for b in rank for c in b]
        assert len(flat) == len({c[:3] for c in flat}), "a crop came twice"
    again = [loader(url, rank=r, world=3, batch=3, **kw) for r in range(3)]
    for ld in again:
        ld.set_epoch(2)
    assert lockstep(again, lambda b: crops_of(b)) == per_rank


@pytest.mark.parametrize("workers, device", [(0, None), (2, None), (2, "cpu")])
def test_packed_resume_at_every_step_is_exact(corpus, workers, device):
    """In-process at every step; with workers (each a stream of its own), on the CPU and in device mode, at three."""
    url, _ = corpus
    kw = COMBOS["packed"] | dict(batch=16)
    whole = batches(loader(url, workers, **kw))
    assert 3 < len(whole) < 20
    for k in range(len(whole)) if not workers else (1, len(whole) // 2 + 1, len(whole) - 1):
        first = loader(url, workers, device, **kw)
        if k:
            batches(first, take=k)
        state = json.loads(json.dumps(first.state_dict()))
        again = loader(url, workers, device, **kw)
        again.load_state_dict(state)
        assert_same(whole[k:], batches(again))
        first.close()
        again.close()


@pytest.mark.parametrize("combo", ["packed", "drawn"])
def test_elastic_2_to_3_ranks_and_another_batch_size_keeps_every_crop_at_most_once_and_as_drawn(mix, combo):
    urls, _ = mix
    kw = COMBOS[combo] | dict(mix=sw.Mix(weights=[0.9, 0.1], epoch_windows=2000), batch=3)  # no source repeats
    full = {c[:3]: c[3] for b in batches(loader(urls, **(kw | dict(batch=1)))) for c in crops_of(b)}
    old = [loader(urls, rank=r, world=2, **kw) for r in range(2)]
    before = lockstep(old, crops_of, take=4)
    state = json.loads(json.dumps(old[0].state_dict()))
    new = [loader(urls, 1, rank=r, world=3, **(kw | dict(batch=2))) for r in range(3)]  # another batch size too
    for ld in new:
        ld.load_state_dict(state)
    after = lockstep(new, crops_of)
    assert len({len(ld) for ld in new}) == 1 and len(after[0]) == len(new[0]) - 4
    flat = [c for run in (before, after) for rank in run for b in rank for c in b]
    assert len(flat) == len({c[:3] for c in flat}), "a crop came twice in the epoch"
    both = [c for c in flat if c[:3] in full]  # a crop both runs yield (each drops a few, not the same)
    assert len(both) > 0.8 * len(full) and all(full[c[:3]] == c[3] for c in both), "a crop moved with the world"


# -- missing values --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def holes(tmp_path_factory):
    rng = np.random.default_rng(3)
    seqs = {}
    for i in range(30):
        x = rng.standard_normal((int(rng.integers(20, 120)), 2)).astype(np.float32)
        x[rng.random(x.shape) < 0.1] = np.nan
        x[rng.random(x.shape) < 0.02] = np.inf
        seqs[f"h{i:02d}"] = x
    url = str(tmp_path_factory.mktemp("holes") / "ds")
    with warnings.catch_warnings():  # pack counts them and says so
        warnings.simplefilter("ignore")
        sw.pack(list(seqs.items()), url, progress=False)
    return url, seqs


@pytest.mark.parametrize("packed", [False, True])
def test_missing_mask_gives_observed_and_zeroes_nan_and_inf(holes, packed):
    url, seqs = holes
    kw = dict(pack_length=32, min_window=4) if packed else dict(horizon=2)
    for b in batches(loader(url, missing="mask", **kw)):
        x, obs = b["x"].numpy(), b["observed"].numpy()
        assert obs.dtype == bool and obs.shape == x.shape and np.isfinite(x).all()
        n = len(b["key"])
        rows = b["row"].tolist() if packed else list(range(n))
        length = b["length"].tolist() if packed else [W] * n
        seg, ranks = (b["segment_ids"].numpy(), Counter()) if packed else (None, None)
        for key, st, ln, row in zip(b["key"], b["start"].tolist(), length, rows):
            ref = seqs[key][st : st + ln]
            if packed:
                ranks[row] += 1
                at = np.flatnonzero(seg[row] == ranks[row])
            else:
                at = np.arange(ln)
            assert np.array_equal(obs[row, at], np.isfinite(ref))
            assert np.array_equal(x[row, at], np.where(np.isfinite(ref), ref, 0))
        if packed:
            assert not obs[seg == 0].any()
            continue
        for i, (key, st) in enumerate(zip(b["key"], b["start"].tolist())):
            ref = seqs[key][st + W : st + W + 2]
            assert np.array_equal(b["y_observed"][i].numpy(), np.isfinite(ref))
            assert np.array_equal(b["y"][i].numpy(), np.where(np.isfinite(ref), ref, 0))


@pytest.mark.parametrize("kw", [dict(horizon=2, pad=True, min_window=4), dict(pack_length=32, min_window=4)],
                         ids=["windows", "packed"])
def test_missing_mask_in_device_mode_is_bitwise_the_cpu_path(holes, kw):
    url, _ = holes
    assert_same(batches(loader(url, missing="mask", **kw)), batches(loader(url, 0, "cpu", missing="mask", **kw)))


def test_nonfinite_data_without_missing_warns_once_when_iteration_starts(holes, corpus):
    ld = loader(holes[0])
    with pytest.warns(RuntimeWarning, match=r"NaN and .* inf values .* crops=sw\.Crops\(missing='mask'\)") as caught:
        batches(ld)
        batches(ld, epoch=1)
    assert sum("NaN and" in str(w.message) for w in caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batches(loader(holes[0], missing="mask"), take=2)
        batches(loader(corpus[0]), take=2)


# -- the pure parts, for any data --------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from streamwin.plan import PlanConfig, WindowSpec, make_plan  # noqa: E402
from streamwin.plan.rows import pack, rows_filled  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 120), min_size=1, max_size=40), st.integers(1, 12), st.integers(1, 6),
       st.booleans(), st.one_of(st.none(), st.integers(1, 4)), st.booleans(), st.integers(0, 3), st.data())
def test_every_crop_lies_in_its_sequence_in_slot_order_with_a_length_in_range(lengths, window, stride, pad, k, drawn,
                                                                             epoch, data):
    p = data.draw(st.sampled_from([d for d in range(1, window + 1) if window % d == 0]))
    m = data.draw(st.integers(1, window)) if drawn else None
    spec = WindowSpec(window, stride, pad=pad, jitter=True, min_window=m, window_multiple=p, windows_per_sequence=k)
    cfg = PlanConfig(spec, batch_size=1, seed=7, block_windows=50, slice_windows=5)
    source = make_plan(np.array(lengths), np.array([0, len(lengths)]), cfg, epoch).sources[0]
    g = np.arange(source.space.total)
    seq, start = source.locate(g)
    length = source.crop_lengths(g)
    for s, t in enumerate(lengths):  # the count of a sequence, from its length alone
        room = t - window + 1
        want = min(k, max(room, 0)) if k else (max(room - 1, -1) // stride + 1 if room > 0 else 0)
        assert (seq == s).sum() == (want if want or not (pad and t > 0) else 1)
    ends = np.array(lengths)[seq]
    short = ends < window
    assert (start >= 0).all() and ((start + window <= ends) | short).all() and (start[short] == 0).all()
    assert all((np.diff(start[seq == s]) > 0).all() for s in range(len(lengths)))  # slots in order, never twice
    low = -(-m // p) * p if m else window
    assert (((length % p == 0) & (length >= low) & (length <= window)) | (short & (length == ends))).all()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 16), max_size=60), st.integers(16, 40), st.integers(0, 30))
def test_packing_places_crops_whole_and_side_by_side_within_rows(sizes, row_units, rows):
    size = np.array(sizes, dtype=np.int64)
    order, row_ptr, offset = pack(size, rows, row_units, key=[1, 2])
    assert len(set(order.tolist())) == len(order) and len(row_ptr) == rows + 1
    for r in range(rows):
        mine = order[row_ptr[r] : row_ptr[r + 1]]
        assert (np.diff(mine) > 0).all(), "block order within a row"
        assert offset[row_ptr[r] : row_ptr[r + 1]].tolist() == (np.cumsum(size[mine]) - size[mine]).tolist()
        assert size[mine].sum() <= row_units
    if rows and size.sum() <= rows * row_units // 2 and (size <= row_units // 2).all():
        # a crop that fit nowhere would leave every row over half full: more than all the crops
        assert len(order) == len(size), "room for every crop at half the rows' room: none is left out"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=80), st.integers(40, 64), st.integers(0, 8))
def test_a_small_block_packed_into_the_rows_it_fills_places_every_crop_as_before(sizes, row_units, spare):
    """RowPlan counts a small block's rows by packing it (plan/rows.py): packed again into just those rows, best fit
    must place the same crops together, in the same order (only the rows' numbers may differ)."""
    size = np.array(sizes, dtype=np.int64)
    # what the plan's estimate gives (a crop over half a row takes one alone), or more
    roomy = max(int(np.ceil(size.sum() * 1.01 / row_units)) + 1, int((2 * size > row_units).sum())) + spare
    rows = rows_filled(size, roomy, row_units)  # (more than the estimate where it falls short: 22 + 23 > 44)
    roomy += max(0, rows - roomy)
    order, ptr, _ = pack(size, roomy, row_units)
    groups = sorted(tuple(order[ptr[r] : ptr[r + 1]].tolist()) for r in range(roomy) if ptr[r + 1] > ptr[r])
    assert sum(len(g) for g in groups) == len(size), "every crop found a row"
    assert len(groups) == rows
    again, ptr2, _ = pack(size, len(groups), row_units)
    assert sorted(tuple(again[ptr2[r] : ptr2[r + 1]].tolist()) for r in range(len(groups))) == groups
    assert (np.diff(ptr2) > 0).all(), "no row empty"
