"""Datasets that grow, for the tests of issue 44: one corpus, packed at once, or packed then appended to and extended.

The corpus is computed here, independently of streamwin: every value encodes (sequence, step),
so a step read from the wrong place never compares equal. ``grown`` packs its first part, then
appends twice with mode="extend": new sequences, and the next steps of sequences already packed
(some extended twice, so their steps lie in three members of three generations' shards). ``once``
packs the same sequences in the same order in one go.
"""
from __future__ import annotations

import numpy as np

import streamwin as sw

SITES = ("kobe", "osaka", "nara")  # the sites of the first pack; appends add "aomori" and "zama"
T0, FREQ = np.datetime64("2024-01-01T00:00", "ns"), np.timedelta64(15 * 60, "s").astype("timedelta64[ns]")


def corpus(n: int = 36, seed: int = 5, features: int = 2, max_len: int = 260) -> dict[str, np.ndarray]:
    """Sequences of uneven lengths (a few shorter than a window), values (sequence * 1000 + step) per feature."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(30, max_len, size=n)
    lengths[:3] = (9, 70, max_len * 3)
    out = {}
    for i, t in enumerate(lengths.tolist()):
        base = np.arange(t, dtype=np.float64)[:, None] * 1000 + i + np.arange(features)[None, :] / 10
        out[f"s{i:03d}"] = base.astype(np.float32)
    return out


def meta(i: int, key: str, start_step: int = 0) -> dict:
    """A sequence's meta from its number: a site, a label, when its first step (``start_step``) is, its step."""
    site = SITES[i % 3] if i < 24 else ("aomori" if i % 2 else "zama")
    return {"site": site, "label": i % 5, "start": T0 + start_step * FREQ + i * np.timedelta64(1, "h"),
            "freq": FREQ}


def stages(full: dict[str, np.ndarray], seed: int = 6) -> list[list[tuple]]:
    """The three packs of ``grown``: (key, steps, meta) items of the first pack, then of each extension."""
    rng = np.random.default_rng(seed)
    keys = list(full)
    first, second, third = [], [], []
    for i, key in enumerate(keys):
        arr = full[key]
        t = len(arr)
        if i < 24:  # packed first: its prefix; then extended once, twice or never
            a = int(rng.integers(1, t)) if t > 2 else t
            b = int(rng.integers(a, t + 1))
            first.append((key, arr[:a], meta(i, key)))
            how = i % 4
            if how == 0:  # extended twice: three members
                if b > a:
                    second.append((key, arr[a:b], {"start": meta(i, key, a)["start"], "freq": FREQ}))
                if t > b:
                    third.append((key, arr[b:], {"start": meta(i, key, b)["start"], "freq": FREQ}))
            elif how in (1, 2) and t > a:
                (second if how == 1 else third).append((key, arr[a:], {"start": meta(i, key, a)["start"],
                                                                       "freq": FREQ}))
            elif t > a:  # the rest in the third pack too, its start left out (not checked)
                third.append((key, arr[a:], None))
        elif i < 30:  # new in the second pack, extended in the third
            a = int(rng.integers(1, t))
            second.append((key, arr[:a], meta(i, key)))
            third.append((key, arr[a:], {"start": meta(i, key, a)["start"], "freq": FREQ}))
        else:  # new in the third pack
            third.append((key, arr, meta(i, key)))
    return [first, second, third]


def grown(url: str, full: dict[str, np.ndarray], **options) -> str:
    """``full`` packed, then appended to twice (mode="extend"), at ``url``."""
    for k, items in enumerate(stages(full)):
        sw.pack([(key, arr) if m is None else (key, arr, m) for key, arr, m in items], url, shard_bytes=6000,
                progress=False, mode=None if k == 0 else "extend", **options)
    return url


def once(url: str, full: dict[str, np.ndarray], **options) -> str:
    """``full`` packed at once, in the order ``grown`` holds the sequences."""
    order = [key for items in stages(full) for key, _, m in items if m is not None and "site" in m]
    sw.pack([(key, full[key], meta(int(key[1:]), key)) for key in order], url, shard_bytes=6000, progress=False,
            **options)
    return url


def windows(batches, full: dict[str, np.ndarray], window: int, horizon: int = 0) -> list[tuple[str, int, int]]:
    """(key, start, length) of every real window (weight > 0) of ``batches``, each checked against ``full``: its
    steps (and its horizon's, ``y``) are the sequence's, bit for bit (packed rows: each crop's steps in its row)."""
    out = []
    for b in batches:
        x = b["x"].numpy()
        n = len(b["key"])
        length = b["length"].tolist() if "length" in b else [window] * n
        real = b["weight"].numpy() > 0 if "weight" in b else np.ones(n, dtype=bool)
        if "segment_ids" in b:
            pos = 0
            for row in range(len(x)):
                seg = b["segment_ids"][row].numpy()
                for sid in range(1, int(seg.max(initial=0)) + 1):
                    key, start, k = b["key"][pos], int(b["start"][pos]), length[pos]
                    assert np.array_equal(x[row][seg == sid], full[key][start : start + k]), (key, start)
                    out.append((key, start, k))
                    pos += 1
            continue
        for i, (key, start) in enumerate(zip(b["key"], b["start"].tolist())):
            if not real[i]:  # a repeat (equalize="pad") or a window lost to damage (on_error="skip"): weight 0
                continue
            k = length[i]
            want = full[key][start : start + k]
            assert len(want) == k and np.array_equal(x[i][:k], want), (key, start)
            if horizon:
                assert np.array_equal(b["y"][i].numpy(), full[key][start + k : start + k + horizon]), (key, start)
            out.append((key, start, k))
    return out
