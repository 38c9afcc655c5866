"""Splits: by key hash (disjoint, complete, stable as the dataset grows) and temporal holdout."""
from __future__ import annotations

import numpy as np
import pytest

import streamwin as sw
from streamwin.plan.split import SplitSpec, key_hashes, split_views

W, S, B = 16, 8, 4


def seen(url, horizon=0, **select):
    """(key, start) of every real window of ``url`` with ``sw.Select(**select)``, each at least once."""
    loader = sw.WindowLoader(sw.WindowDataset(url, window=W, stride=S, horizon=horizon, batch_size=B,
                                              order=sw.Order(equalize="pad"), select=sw.Select(**select)))
    out = set()
    for b in loader:
        for k, s, w in zip(b["key"], b["start"].tolist(), b["weight"].tolist()):
            if w:
                out.add((k, s))
    return out


def test_key_split_is_disjoint_complete_and_seeded(tiny):
    url, seqs = tiny
    parts = {s: seen(url, split=s, split_fractions=(0.6, 0.2, 0.2)) for s in ("train", "val", "test")}
    keys = {s: {k for k, _ in p} for s, p in parts.items()}
    assert not (keys["train"] & keys["val"]) and not (keys["train"] & keys["test"]) and not (keys["val"] & keys["test"])
    everything = seen(url)
    assert parts["train"] | parts["val"] | parts["test"] == everything
    assert len(keys["train"]) > len(keys["val"]) > 0
    other_seed = {k for k, _ in seen(url, split="train", split_fractions=(0.6, 0.2, 0.2), split_seed=1)}
    assert other_seed != keys["train"]


def test_key_hash_is_stable_as_the_dataset_grows():
    keys = [f"k{i}" for i in range(500)] + ["a", "bb", "x" * 90]
    more = ["new1", "zz"] + keys[::-1] + ["new2"]

    def hashes(ks):
        blob = "".join(ks).encode()
        ends = np.cumsum([len(k) for k in ks])
        return dict(zip(ks, key_hashes(blob, ends, seed=3).tolist()))

    a, b = hashes(keys), hashes(more)
    assert all(a[k] == b[k] for k in keys)
    assert len(set(a.values())) == len(a)  # no collisions on a small set
    # independent reference: the polynomial hash before mixing, computed per key in Python
    h0 = hashes(["ab"])["ab"]
    assert h0 == hashes(["zzzz", "ab"])["ab"]


def holdout_reference(t: int, holdout: int, window: int, horizon: int, stride: int) -> dict[str, list[int]]:
    """Window starts of each split of one sequence of length ``t``, enumerated by hand from the rule.

    train: the full-data grid (0, stride, ...) whose windows, horizon included, end before t - 2*holdout;
    val / test: from the first start whose last target step reaches the split's range, every
    ``stride`` steps while that step stays inside [t - 2*holdout, t - holdout) / [t - holdout, t).
    """
    span = window + horizon
    out = {"train": [s for s in range(0, t, stride) if s + span <= t - 2 * holdout]}
    for name, lo, hi in (("val", t - 2 * holdout, t - holdout), ("test", t - holdout, t)):
        fits = [s for s in range(t) if lo <= s + span - 1 < hi]
        out[name] = list(range(fits[0], fits[-1] + 1, stride)) if fits else []
    return out


def view_starts(first: int, steps: int, span: int, stride: int) -> list[int]:
    """The window starts a (first step, steps) view gives, as the design defines windows."""
    return [first + k for k in range(0, steps - span + 1, stride)] if steps >= span else []


@pytest.mark.parametrize("window,horizon,stride,holdout", [(4, 0, 1, 3), (4, 2, 1, 3), (5, 3, 2, 4), (3, 1, 3, 10),
                                                           (6, 0, 4, 1), (2, 5, 1, 2)])
def test_temporal_holdout_matches_the_rule(window, horizon, stride, holdout):
    """Every window of every split, for sequences of many lengths, against the hand-enumerated rule."""
    lengths = np.arange(0, 40)
    keys = [f"s{t}" for t in lengths]
    blob, ends = "".join(keys).encode(), np.cumsum([len(k) for k in keys])
    span = window + horizon
    got = {}
    for split in ("train", "val", "test"):
        first, steps = split_views(SplitSpec(split, holdout=holdout), lengths, blob, ends, window, span=span)
        assert np.all(first >= 0) and np.all(first + steps <= lengths)
        got[split] = [view_starts(int(f), int(n), span, stride) for f, n in zip(first, steps)]
    for i, t in enumerate(lengths.tolist()):
        ref = holdout_reference(t, holdout, window, horizon, stride)
        for split in ("train", "val", "test"):
            assert got[split][i] == ref[split], (t, split)
        train, val, test = (set(got[s][i]) for s in ("train", "val", "test"))
        assert not (train & val) and not (train & test) and not (val & test)
        # nothing leaks: the step a val or test window is judged on is past every training window
        last_train = max((s + span - 1 for s in train), default=-1)
        assert all(s + span - 1 > last_train for s in val | test)
        assert all(s + span - 1 < t - holdout for s in val)  # and val never reaches test's steps


def test_holdout_too_short_for_a_window_gives_none_even_padded():
    """A val/test range that cannot hold a full window gives no steps: no window, not even a padded one."""
    lengths = np.array([5, 10, 12, 30])
    blob, ends = b"abcd", np.array([1, 2, 3, 4])
    first, steps = split_views(SplitSpec("val", holdout=3), lengths, blob, ends, 8, span=8)
    assert steps.tolist() == [0, 0, 9, 10] and first.tolist()[2:] == [0, 17]
    first, steps = split_views(SplitSpec("test", holdout=3), lengths, blob, ends, 8, span=8)
    assert steps.tolist() == [0, 10, 10, 10] and first.tolist()[1:] == [0, 2, 20]


def test_temporal_holdout_end_to_end(tiny):
    """Through the loader (horizon 0: span = window): each split is the rule's set of windows."""
    url, seqs = tiny
    holdout = 20
    parts = {s: seen(url, split=s, holdout=holdout) for s in ("train", "val", "test")}
    for split, part in parts.items():
        ref = {(k, s) for k, a in seqs.items() for s in holdout_reference(len(a), holdout, W, 0, S)[split]}
        assert part == ref and part, split
    assert not (parts["val"] & parts["test"]) and not (parts["train"] & parts["val"])


def test_temporal_holdout_end_to_end_with_horizon(tiny):
    url, seqs = tiny
    holdout, horizon = 20, 6
    for split in ("train", "val", "test"):
        got = seen(url, split=split, holdout=holdout, horizon=horizon)
        ref = {(k, s) for k, a in seqs.items() for s in holdout_reference(len(a), holdout, W, horizon, S)[split]}
        assert got == ref, split


def test_padded_training_windows_never_see_holdout_values(tiny):
    url, seqs = tiny
    holdout = 15
    loader = sw.WindowLoader(sw.WindowDataset(url, window=W, stride=S, batch_size=B,
                                              crops=sw.Crops(pad=True),
                                              select=sw.Select(split="train", holdout=holdout)))
    for b in loader:
        for k, s, x, m in zip(b["key"], b["start"].tolist(), b["x"], b["mask"]):
            usable = len(seqs[k]) - 2 * holdout  # train ends where val's targets begin
            assert int(m.sum()) == min(W, usable - s)
            assert np.array_equal(x[m].numpy(), seqs[k][s : s + int(m.sum())])


@pytest.mark.parametrize("bad", [dict(split="dev"), dict(split="train", split_fractions=(0.5, 0.2)),
                                 dict(split="train", holdout=-1), dict(holdout=5)])
def test_bad_split_arguments(tiny, bad):
    with pytest.raises(ValueError):
        sw.WindowDataset(tiny[0], window=W, batch_size=B, select=sw.Select(**bad))
