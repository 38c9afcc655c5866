"""A transform's randomness is part of the order (issue 43): a function of (seed, epoch, window), never of the process.

The reference is computed here, one row at a time in plain Python integers, from the documented
definition (streamwin/window_random.py): a window's key is splitmix64 chained over (seed, epoch,
source, sequence index, start, length), its draw n a hash of (key, n), and a draw of up to 256
values a row is splitmix64 counters, else a numpy PCG64 generator whose state is hashed from that
key. Every row the loader yields must be its window (read from the corpus here) transformed with
exactly those draws; and the global batches after the transform must be the same bitwise for 1, 2
and 4 ranks with 0, 1 or 2 workers, and after exact and elastic resume.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

import streamwin as sw
from conftest import lockstep, opened, two_corpora

W, S, G = 16, 8, 16  # window, stride, global batch
MASK, GOLD, M1, M2 = (1 << 64) - 1, 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
SEED = 11
CASES = {
    "plain": dict(),
    "drawn lengths": dict(crops=sw.Crops(jitter=True, min_window=8)),
    "mix": dict(mix=sw.Mix(weights=[0.7, 0.3])),
    "pad repeats": dict(order=sw.Order(equalize="pad")),
    "packed": dict(crops=sw.Crops(pack_length=48, min_window=8, window_multiple=4)),
}


def augment(batch, rng):
    """Noise of each window's shape, a draw of 300 values a row (a generator a row), per-row scale and shift, a mask."""
    x = batch["x"]
    noise = rng.standard_normal(x.shape, dtype=np.float32)
    big = rng.random((len(x), 300))
    scale = rng.uniform(0.5, 1.5, size=(len(x), 1, 1))
    shift = rng.integers(0, 4, size=len(x))
    masked = rng.random(x.shape[:2]) < 0.15
    out = {"x": (x * scale).astype(x.dtype) + noise, "noise": noise, "big": big, "scale": scale, "shift": shift,
           "masked": masked}
    return out | {k: batch[k] for k in ("start", "length", "row", "weight", "segment_ids") if k in batch}


# -- the reference: the documented definition, one row at a time ----------------------------------------------
def mix64(z: int) -> int:
    z &= MASK
    z ^= z >> 30
    z = (z * M1) & MASK
    z ^= z >> 27
    z = (z * M2) & MASK
    return z ^ (z >> 31)


def window_key(epoch: int, *values: int) -> int:
    h = mix64(mix64(SEED + GOLD) ^ epoch)
    for v in values:
        h = mix64(((h + GOLD) & MASK) ^ (v & MASK))
    return h


def row_draw(key: int, n: int, method: str, per: int, dtype) -> np.ndarray:
    """Row ``key``'s draw number ``n`` of ``per`` values of ``method``."""
    k = mix64(key ^ mix64(n + GOLD))
    if per > 256:
        b = mix64(k + GOLD)
        c = mix64(b + GOLD)
        d = mix64(c + GOLD)
        bits = np.random.PCG64(0)
        bits.state = {"bit_generator": "PCG64", "state": {"state": (k << 64) | b, "inc": (c << 64) | d | 1},
                      "has_uint32": 0, "uinteger": 0}
        return getattr(np.random.Generator(bits), method)(per, dtype=dtype)
    out = []
    for j in range(1, per + 1):
        z = mix64(k + GOLD * j)
        if method == "random":
            out.append((z >> 40) / 2**24 if dtype == np.float32 else (z >> 11) / 2**53)
        else:  # standard_normal: Box-Muller, radius from the high 32 bits, angle from the low 32
            out.append(math.sqrt(-2.0 * math.log(((z >> 32) + 1) / 2**32)) * math.cos((z & 0xFFFFFFFF) * (2 * math.pi / 2**32)))
    return np.array(out, dtype=dtype)


def expected_row(x: np.ndarray, key: int) -> dict[str, np.ndarray]:
    """What ``augment`` makes of one row ``x`` whose key is ``key``."""
    per = x.size
    noise = row_draw(key, 0, "standard_normal", per, np.float32).reshape(x.shape)
    big = row_draw(key, 1, "random", 300, np.float64)
    scale = 0.5 + 1.0 * row_draw(key, 2, "random", 1, np.float64)
    shift = int(np.floor(row_draw(key, 3, "random", 1, np.float64)[0] * 4))
    masked = row_draw(key, 4, "random", x.shape[0], np.float64) < 0.15
    return {"x": (x * scale[0]).astype(x.dtype) + noise, "noise": noise, "big": big, "scale": scale, "shift": shift,
            "masked": masked}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return two_corpora(tmp_path_factory.mktemp("transform_random"))


def dataset(urls, case, world=1, rank=0, **kw):
    kw = CASES[case] | kw
    url = urls if "mix" in kw else urls[0]
    return sw.WindowDataset(url, window=W, stride=S, batch_size=G // world, rank=rank, world_size=world,
                            shuffle_buffer=64, seed=SEED, **kw)


def check_rows(b, seqs_by_source, index_of, epoch=0, packed=False):
    """Every row is its window (or packed row) of the corpus, transformed with the reference's draws for it."""
    n = len(b["x"])
    keys, source = list(b["key"]), b["source"].tolist() if "source" in b else [0] * len(b["key"])
    start = b["start"].tolist()
    length = b["length"].tolist() if "length" in b else [0] * len(keys)
    if packed:  # a row's key is its first crop's; its values are its crops', laid out by segment
        first = {}
        for c, r in enumerate(b["row"].tolist()):
            first.setdefault(r, c)
    for i in range(n):
        c = first.get(i) if packed else i
        if c is None:
            continue  # a row with no crop (none in these epochs)
        key = window_key(epoch, source[c], index_of[source[c]][keys[c]], start[c], length[c])
        if packed:
            x = np.zeros_like(b["x"][i].numpy())
            seg = b["segment_ids"][i].numpy()
            for sid, cc in enumerate([cc for cc, r in enumerate(b["row"].tolist()) if r == i], start=1):
                x[seg == sid] = seqs_by_source[source[cc]][keys[cc]][start[cc] : start[cc] + length[cc]]
        else:
            seq = seqs_by_source[source[c]][keys[c]]
            x = seq[start[c] : start[c] + W].copy()
            if length[c]:
                x[length[c]:] = 0
        want = expected_row(x, key)
        for name in ("big", "scale", "shift", "masked"):
            assert np.array_equal(b[name][i].numpy(), np.asarray(want[name]).reshape(b[name][i].shape)), (name, i)
        for name in ("noise", "x"):  # Box-Muller in numpy (the loader) and in math (here): within an ulp or two
            np.testing.assert_allclose(b[name][i].numpy(), want[name], rtol=1e-6, atol=1e-6, err_msg=name)


def indexes(seqs_by_source):
    return [{k: i for i, k in enumerate(seqs)} for seqs in seqs_by_source]


@pytest.mark.parametrize("case", list(CASES))
def test_every_row_is_its_window_with_its_own_draws(corpus, case):
    urls, seqs = corpus
    mixed = "mix" in CASES[case]
    by_source = seqs if mixed else seqs[:1]
    index_of = indexes(by_source)
    ds = dataset(urls, case)
    for m, s in zip(ds.manifests, by_source):  # pack keeps its input's order: sequence i is the i-th given
        assert m.keys(np.arange(len(s))) == list(s)
    loader = opened(sw.WindowLoader(ds, num_workers=0, transform=augment))
    batches = 0
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        for b in loader:
            check_rows(b, by_source, index_of, epoch, packed=case == "packed")
            batches += 1
    assert batches > 10


def summary(b) -> list[tuple]:
    """Per row: its windows (a packed row: its crops) and the bytes of every transformed field (a mix's rank batch is
    grouped by source)."""
    n = len(b["x"])
    keys, start = list(b["key"]), b["start"].tolist()
    source = b["source"].tolist() if "source" in b else [0] * len(keys)
    length = b["length"].tolist() if "length" in b else [0] * len(keys)
    row = b["row"].tolist() if "row" in b else list(range(n))
    windows: list[list] = [[] for _ in range(n)]
    for c, r in enumerate(row):
        windows[r].append((source[c], keys[c], start[c], length[c]))
    names = ("x", "noise", "big", "scale", "shift", "masked")
    return [tuple([tuple(windows[i])] + [b[k][i].numpy().tobytes() for k in names]) for i in range(n)]


def global_batches(group, take=None, sort=False) -> list[list[tuple]]:
    per_rank = lockstep(group, summary, take=take)
    out = [sum((r[k] for r in per_rank), []) for k in range(len(per_rank[0]))]
    return [sorted(g) for g in out] if sort else out


def job(urls, case, world, workers):
    return [opened(sw.WindowLoader(dataset(urls, case, world, r), num_workers=workers, transform=augment))
            for r in range(world)]


@pytest.mark.parametrize("case", ["plain", "mix", "drawn lengths", "packed"])
def test_global_batches_after_the_transform_are_the_same_in_every_world(corpus, case):
    urls, seqs = corpus
    sort = case == "mix"  # a rank's batch of a mix is grouped by source: the global batch is the same as a set
    ref = global_batches(job(urls, case, 1, 0), sort=sort)
    assert len(ref) > 10
    for world in (1, 2, 4):
        for workers in (0, 1, 2):
            got = global_batches(job(urls, case, world, workers), sort=sort)
            assert len(got) == len(ref), (world, workers)
            for k, (a, b) in enumerate(zip(got, ref)):
                assert a == b, f"{world} rank(s), {workers} worker(s): global batch {k} differs after the transform"


@pytest.mark.parametrize("old,new", [((2, 0), (2, 0)), ((2, 1), (2, 1)), ((4, 1), (2, 2)), ((1, 2), (4, 0))])
def test_exact_and_elastic_resume_continue_with_the_same_draws(corpus, old, new):
    urls, _ = corpus
    whole = global_batches(job(urls, "plain", 1, 0))
    first = job(urls, "plain", *old)
    before = global_batches(first, take=7)
    assert before == whole[:7]
    state = json.loads(json.dumps(first[-1].state_dict()))
    again = job(urls, "plain", *new)
    for loader in again:
        loader.load_state_dict(state)
        loader.set_epoch(0)
    assert global_batches(again) == whole[7:]


def test_draws_refuse_a_size_that_is_not_the_rows_and_name_row_generators():
    from streamwin.window_random import WindowRandom

    rng = WindowRandom(np.arange(4, dtype=np.uint64))
    with pytest.raises(ValueError, match=r"size's first dimension must be the batch's 4 rows .*rng.row\(i\)"):
        rng.random(5)
    with pytest.raises(ValueError, match="4 rows"):  # one value a batch (a Generator's habit) is per row now
        rng.normal()
    with pytest.raises(AttributeError, match=r"rng.choice: .*rng.row\(i\)"):
        rng.choice(3)
    g = rng.row(2)
    assert isinstance(g, np.random.Generator) and rng.row(2) is g
    assert rng.row(1).random() != g.random()
    with pytest.raises(IndexError, match="4 rows"):
        rng.row(4)


@pytest.mark.parametrize("per", [3, 2000])  # counter hashes (a few values a row), a generator a row (many)
def test_draws_have_their_distributions(per):
    from streamwin.window_random import WindowRandom

    rng = WindowRandom(np.arange(2000 * 3 // per + 64, dtype=np.uint64) * 7919)
    rows = rng.rows
    u = rng.random((rows, per))
    z = rng.standard_normal((rows, per), dtype=np.float32)
    e = rng.exponential(2.0, size=(rows, per))
    k = rng.integers(3, 9, size=(rows, per))
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01 and abs(u.var() - 1 / 12) < 0.005
    assert z.dtype == np.float32 and abs(z.mean()) < 0.03 and abs(z.std() - 1) < 0.03
    assert abs(e.mean() - 2) < 0.06 and e.min() > 0
    assert set(np.unique(k).tolist()) == set(range(3, 9))
    assert abs(np.corrcoef(u[:-1].ravel(), u[1:].ravel())[0, 1]) < 0.02  # neighbouring rows' streams are apart


def test_probe_rows_make_one_stream_each_and_later_rows_theirs(tmp_path):
    """Rows of the same window draw the same values, and other windows other values (within a batch too)."""
    url = str(tmp_path / "d")
    sw.pack([(f"s{i}", np.zeros((40, 2), np.float32)) for i in range(8)], url, progress=False)
    ds = sw.WindowDataset(url, window=8, stride=8, batch_size=8, seed=1, crops=sw.Crops(windows_per_sequence=1))

    def draws(b, rng):
        return {"u": rng.random((len(b["x"]), 4))}
    rows = [r.numpy().tobytes() for b in sw.WindowLoader(ds, num_workers=0, transform=draws) for r in b["u"]]
    assert len(set(rows)) == len(rows) > 4
