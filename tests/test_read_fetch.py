"""What a block fetches, without I/O: pieces, byte runs, zstd units and ranges, where windows land.

Random datasets (members laid out in shards with tar headers and json members between them)
and random blocks (runs of consecutive windows, overlapping and repeated ones too) are cut
by streamwin.read's pure functions; each result is checked against a naive per-window
computation written here, and against simulated shard bytes copied the way a reader would.
"""
from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamwin.formats.manifest import ShardEntry, build_manifest
from streamwin.read import frames as frames_mod
from streamwin.read import runs as runs_mod
from streamwin.read.frames import compressed_ranges, compressed_runs, raw_batches, unit_span, units
from streamwin.read.pieces import land, pieces
from streamwin.read.runs import packed, paged, plain_runs
from streamwin.storage.mapped import PAGE

TAR = 512
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Case:
    """A dataset's manifest, its windows (global index -> sequence, start, end) and a block of them."""

    m: object
    seq: np.ndarray  # per window of the dataset
    start: np.ndarray
    end: np.ndarray
    g: np.ndarray  # the block: sorted global window indices (repeats allowed)
    member: list  # per sequence: its member's bytes as stored (plain) or its array data (zstd)


@st.composite
def cases(draw, zstd: bool = False) -> Case:
    """A dataset of 1-3 shards and a block of its windows."""
    features = draw(st.integers(1, 3))
    dtype = np.dtype(draw(st.sampled_from(["u1", "<f4"])))
    sb = dtype.itemsize * features
    lengths = draw(st.lists(st.lists(st.integers(1, 400), min_size=1, max_size=6), min_size=1, max_size=3))
    gaps = st.sampled_from([0, 0, TAR, 3 * TAR, 6_000, 70_000])  # json members, of all sizes
    span, stride = draw(st.integers(1, 40)), draw(st.integers(1, 50))
    pad = draw(st.booleans())
    rows = draw(st.integers(2, 64))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    cols = {c: [] for c in ("length", "offset", "size", "hlen")}
    shards, keys, member, framed_seq, frame_ends = [], [], [], [], []
    i = 0
    for k, shard in enumerate(lengths):
        at = 0
        for t in shard:
            at += draw(gaps) + TAR
            hlen = draw(st.sampled_from([64, 128]))
            data = rng.integers(0, 256, size=hlen + t * sb, dtype=np.uint8)
            if zstd:  # compressed: frames of ``rows`` steps (some members listed as such), random sizes
                nframes = -(-t // rows)
                listed = nframes > 1 and draw(st.booleans())
                ends = np.cumsum(rng.integers(1, 300, size=nframes if listed else 1))
                if listed:
                    framed_seq.append(i)
                    frame_ends.extend(ends.tolist())
                size = int(ends[-1])
                member.append(data[hlen:])
            else:
                size = len(data)
                member.append(data)
            cols["length"].append(t), cols["offset"].append(at), cols["size"].append(size), cols["hlen"].append(hlen)
            keys.append(f"s{i}")
            at += size
            i += 1
        shards.append(ShardEntry(f"shard-{k}.tar", at + 2 * TAR, "0" * 64, len(shard), sum(shard)))
    m = build_manifest(dtype, (features,), "zstd" if zstd else None, shards, keys, cols,
                       frames=(rows, framed_seq, frame_ends) if zstd else None)
    seq, start, end = windows(np.asarray(cols["length"]), span, stride, pad)
    if not len(seq):
        seq, start, end = np.zeros(1, np.int64), np.zeros(1, np.int64), np.minimum(m.length[:1], span)
    n = len(seq)
    runs = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(1, 25)), min_size=1, max_size=5))
    g = np.sort(np.concatenate([np.arange(a, min(a + k, n)) for a, k in runs]))
    return Case(m, seq, start, end, g, member)


def windows(length: np.ndarray, span: int, stride: int, pad: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sequence, first step, end step) of every window of the dataset, in manifest order."""
    out = []
    for i, t in enumerate(length.tolist()):
        starts = list(range(0, t - span + 1, stride)) or ([0] if pad else [])
        out += [(i, s, min(s + span, t)) for s in starts]
    a = np.array(out, dtype=np.int64).reshape(-1, 3)
    return a[:, 0], a[:, 1], a[:, 2]


def naive_pieces(g, seq, start, end, gap):
    """[(first window, last window + 1, joined)]: a new piece where the windows stop being consecutive,
    the sequence changes, or the next window starts more than ``gap`` steps after the last one ends."""
    out = []
    for w in range(len(g)):
        consecutive = w > 0 and g[w] - g[w - 1] <= 1
        if consecutive and seq[w] == seq[w - 1] and start[w] - end[w - 1] <= gap:
            out[-1][1] = w + 1
        else:
            out.append([w, w + 1, consecutive])
    return out


def block(case: Case, gap: int):
    seq, start, end = case.seq[case.g], case.start[case.g], case.end[case.g]
    return seq, start, end, pieces(case.g, seq, start, end, gap)


def window_bytes(m, seq, start, end) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(shard, first byte, end byte) each plain window needs: from its member's tar header on (512 bytes before its
    npy header) if it starts at 0."""
    data0 = m.offset[seq] + m.hlen[seq]
    lo = np.where(start == 0, m.offset[seq] - 512, data0 + start * m.step_bytes)
    return np.searchsorted(m.shard_starts, seq, side="right") - 1, lo, data0 + end * m.step_bytes


# -- pieces ------------------------------------------------------------------------------------
@SETTINGS
@given(case=cases(), gap=st.sampled_from([0, 3, 40, 10**9]))
def test_pieces_are_the_runs_of_consecutive_windows_of_a_sequence(case, gap):
    seq, start, end, p = block(case, gap)
    want = naive_pieces(case.g, seq, start, end, gap)
    assert len(p.seq) == len(want)
    for u, (w0, w1, joined) in enumerate(want):
        assert (p.seq[u], p.s_lo[u], p.s_hi[u], p.joined[u]) == (seq[w0], start[w0], end[w0:w1].max(), joined)
        assert (p.index[w0:w1] == u).all()


# -- plain members: runs ---------------------------------------------------------------------------
@SETTINGS
@given(case=cases(), merge_gap=st.sampled_from([0, 700, 5_000, 64 << 10]))
def test_plain_runs_merge_as_documented_and_cover_every_window(case, merge_gap):
    with mock.patch.object(runs_mod, "MERGE_GAP", merge_gap):
        m, sb = case.m, case.m.step_bytes
        seq, start, end, p = block(case, merge_gap // sb)
        r = plain_runs(m, p)
    # the naive merge: piece by piece, a new run at a new shard or a gap wider than the room allowed
    shard, w_lo, w_hi = window_bytes(m, seq, start, end)
    pcs = naive_pieces(case.g, seq, start, end, merge_gap // sb)
    lo = np.array([w_lo[w0] for w0, _, _ in pcs])
    hi = np.array([w_hi[w0:w1].max() for w0, w1, _ in pcs])
    runs = []  # [shard, lo, hi, pieces]
    for u, (w0, _, joined) in enumerate(pcs):
        small = [min(h - l, merge_gap * 8) // 8 for l, h in ((lo[u - 1], hi[u - 1]), (lo[u], hi[u]))] if u else [0]
        room = merge_gap if joined else min(small)
        if runs and runs[-1][0] == shard[w0] and lo[u] - hi[u - 1] <= room:
            runs[-1][2], runs[-1][3] = max(runs[-1][2], hi[u]), runs[-1][3] + [u]
        else:
            runs.append([shard[w0], lo[u], hi[u], [u]])
    assert [(s, a, b) for s, a, b, _ in runs] == list(zip(r.shard.tolist(), r.run_lo.tolist(), r.run_hi.tolist()))
    assert [us for *_, us in runs] == [list(range(a, b)) for a, b in zip(r.first[:-1], r.first[1:])]
    # every window's bytes lie in its piece's run; runs of a shard are sorted and disjoint
    run = r.run[p.index]
    assert (r.shard[run] == shard).all() and (r.run_lo[run] <= w_lo).all() and (w_hi <= r.run_hi[run]).all()
    same = r.shard[1:] == r.shard[:-1]
    assert (r.run_hi[:-1][same] < r.run_lo[1:][same]).all() and (np.diff(r.shard) >= 0).all()
    check_bytes_read(r, p, case.g, w_lo, w_hi, merge_gap)


def check_bytes_read(r, p, g, w_lo, w_hi, merge_gap):
    """The runs hold the windows' bytes and the holes between them, nothing more; no hole is wider than
    MERGE_GAP, and the holes between windows not consecutive in the plan (other blocks' data) come to at
    most 1/OTHER_GAP_RATIO of the bytes read for the windows themselves."""
    run = r.run[p.index]
    same = run[1:] == run[:-1]
    hole = np.where(same, np.maximum(w_lo[1:] - w_hi[:-1], 0), 0)  # window bytes rise with g: w_hi[w - 1] is the reach
    fresh = w_hi - np.concatenate([w_lo[:1], np.where(same, np.maximum(w_lo[1:], w_hi[:-1]), w_lo[1:])])
    assert int((r.run_hi - r.run_lo).sum()) == int(fresh.sum() + hole.sum())
    assert hole.max(initial=0) <= merge_gap
    other = np.diff(g) > 1
    assert hole[other].sum() * runs_mod.OTHER_GAP_RATIO <= (w_hi - w_lo).sum() + hole[~other].sum()


def shard_bytes(case: Case) -> list[np.ndarray]:
    """Each shard's bytes: its members at their offsets, random bytes between them."""
    m, rng = case.m, np.random.default_rng(0)
    out = [rng.integers(0, 256, size=s.bytes, dtype=np.uint8) for s in m.shards]
    for i, data in enumerate(case.member):
        k = m.shard_of(i)
        out[k][m.offset[i] : m.offset[i] + len(data)] = data
    return out


@SETTINGS
@given(case=cases(), mapped=st.booleans())
def test_plain_windows_land_on_their_bytes(case, mapped):
    """Runs copied into a buffer where ``packed`` / ``paged`` put them: each window's bytes are its
    sequence's steps, and each header a read covers is its member's."""
    m, sb = case.m, case.m.step_bytes
    seq, start, end, p = block(case, runs_mod.MERGE_GAP // sb)
    r = plain_runs(m, p)
    run_at, nbytes = paged(r.run_lo, r.run_hi) if mapped else packed(r.run_lo, r.run_hi)
    size = r.run_hi - r.run_lo
    assert (run_at[1:] >= run_at[:-1] + size[:-1]).all() and run_at[-1] + size[-1] <= nbytes
    if mapped:
        assert (run_at % PAGE == r.run_lo % PAGE).all()
    buf = np.zeros(nbytes, np.uint8)
    shards = shard_bytes(case)
    for j in range(len(r)):
        buf[run_at[j] : run_at[j] + size[j]] = shards[r.shard[j]][r.run_lo[j] : r.run_hi[j]]
    base, header_at = r.land(run_at)
    offs, lost = land(p, base, np.full(len(p.seq), np.iinfo(np.int64).max), start, end - start, sb, nbytes)
    assert not lost.any()
    for w, (i, s, e) in enumerate(zip(seq.tolist(), start.tolist(), end.tolist())):
        h = int(m.hlen[i])
        assert np.array_equal(buf[offs[w] : offs[w] + (e - s) * sb], case.member[i][h + s * sb : h + e * sb])
    assert np.array_equal(r.covers_header(), p.s_lo == 0)
    for u in np.flatnonzero(r.covers_header()).tolist():
        i, h = int(r.seq[u]), int(r.hlen[u])
        assert np.array_equal(buf[header_at[u] : header_at[u] + h], case.member[i][:h])


@SETTINGS
@given(case=cases(), data=st.data())
def test_lost_windows_are_those_needing_unread_steps(case, data):
    m, sb = case.m, case.m.step_bytes
    seq, start, end, p = block(case, runs_mod.MERGE_GAP // sb)
    good = np.array(data.draw(st.lists(st.integers(0, 401), min_size=len(p.seq), max_size=len(p.seq))), np.int64)
    base = np.arange(len(p.seq), dtype=np.int64) * 10_000
    offs, lost = land(p, base, good, start, end - start, sb, -1)
    for u, (w0, w1, _) in enumerate(naive_pieces(case.g, seq, start, end, runs_mod.MERGE_GAP // sb)):
        for w in range(w0, w1):
            assert lost[w] == (end[w] > good[u])  # a window needs steps [start, end) of its sequence
            assert offs[w] == (-1 if lost[w] else base[u] + start[w] * sb)


@SETTINGS
@given(case=cases(), data=st.data())
def test_steps_before_a_failing_byte_are_whole_steps_after_a_whole_header(case, data):
    m, sb = case.m, case.m.step_bytes
    _, _, _, p = block(case, runs_mod.MERGE_GAP // sb)
    r = plain_runs(m, p)
    u = data.draw(st.integers(0, len(p.seq) - 1))
    fail = data.draw(st.integers(int(r.lo[u]), int(r.hi[u])))
    i = int(r.seq[u])
    data0 = int(m.offset[i] + m.hlen[i])
    header_whole = r.s_lo[u] > 0 or fail >= data0
    want = sum(1 for s in range(int(m.length[i])) if data0 + (s + 1) * sb <= fail) if header_whole else 0
    assert r.steps_before(u, fail) == want


# -- zstd members: units, compressed ranges, runs and batches -----------------------------------
@SETTINGS
@given(case=cases(zstd=True), whole=st.sampled_from([0, 64, 1_000, 256 << 10]))
def test_zstd_units_lay_out_each_window_from_its_members_steps(case, whole):
    """Each owning piece laid out as ``units`` says (its steps, or the whole member): every window then
    reads its sequence's steps at ``base + start * step_bytes``."""
    m, sb = case.m, case.m.step_bytes
    seq, start, end, p = block(case, runs_mod.MERGE_GAP // sb)
    with mock.patch.object(frames_mod, "WHOLE_UNIT_BYTES", whole):
        u = units(m, p)
    listed = np.isin(p.seq, m.frames.seq)
    assert np.array_equal(u.framed, listed | (m.length[p.seq] * sb <= whole))
    assert np.array_equal(u.shared[1:], ~u.framed[1:] & (p.seq[1:] == p.seq[:-1])) and not u.shared[:1].any()
    buf = np.zeros(int(u.pos[-1]), np.uint8)
    for k in range(len(p.seq)):
        i = int(p.seq[k])
        a, b = (int(p.s_lo[k]), int(p.s_hi[k])) if u.framed[k] else (0, int(m.length[i]))
        assert (u.a[k], u.b[k]) == (a, b)
        if not u.shared[k]:
            assert u.owner[k] == k and u.pos[k + 1] - u.pos[k] == (b - a) * sb
            buf[u.pos[k] : u.pos[k + 1]] = case.member[i][a * sb : b * sb]
        else:
            assert u.owner[k] == u.owner[k - 1] and u.pos[k + 1] == u.pos[k]
    base = u.base(sb)
    for w, (i, s, e) in enumerate(zip(seq.tolist(), start.tolist(), end.tolist())):
        at = base[p.index[w]] + s * sb
        assert np.array_equal(buf[at : at + (e - s) * sb], case.member[i][s * sb : e * sb])


def unit_bytes(m, i: int) -> list[tuple[int, int]]:
    """[(first byte, end byte)] in the shard of each unit of member i, from the manifest's columns."""
    at = int(m.offset[i])
    if i not in m.frames.seq:
        return [(at, at + int(m.size[i]))]
    k = int(np.searchsorted(m.frames.seq, i))
    ends = m.frames.ends[m.frames.first[k] : m.frames.first[k + 1]].tolist()
    return [(at + a, at + b) for a, b in zip([0] + ends[:-1], ends)]


@SETTINGS
@given(case=cases(zstd=True), data=st.data())
def test_zstd_ranges_hold_exactly_the_units_of_the_steps(case, data):
    m, sb = case.m, case.m.step_bytes
    _, _, _, p = block(case, runs_mod.MERGE_GAP // sb)
    u = units(m, p)
    f0, f1 = np.zeros(len(p.seq), np.int64), np.ones(len(p.seq), np.int64)
    for k in np.flatnonzero(u.framed).tolist():
        i, a, b = int(p.seq[k]), int(u.a[k]), int(u.b[k])
        j0, j1 = unit_span(m, i, a, b)
        rows = m.frames.rows if i in m.frames.seq else int(m.length[i])
        assert j0 * rows <= a < (j0 + 1) * rows and (j1 - 1) * rows < b <= j1 * rows
        f0[k] = data.draw(st.integers(j0, j1 - 1))  # the cache may hold units at either end
        f1[k] = data.draw(st.integers(int(f0[k]) + 1, j1))
    lo, hi = compressed_ranges(m, p.seq, f0, f1, u.framed)
    for k in range(len(p.seq)):
        held = unit_bytes(m, int(p.seq[k]))[f0[k] : f1[k]]
        assert (lo[k], hi[k]) == (held[0][0], held[-1][1])


@SETTINGS
@given(case=cases(zstd=True), raw=st.sampled_from([1, 500, 4_000, 8 << 20]))
def test_compressed_runs_merge_close_ranges_and_batch_them(case, raw):
    m, sb = case.m, case.m.step_bytes
    _, _, _, p = block(case, runs_mod.MERGE_GAP // sb)
    u = units(m, p)
    own = np.flatnonzero(~u.shared)
    seq = p.seq[own]
    f0, f1 = np.zeros(len(seq), np.int64), np.ones(len(seq), np.int64)
    for n, k in enumerate(own.tolist()):
        if u.framed[k]:
            f0[n], f1[n] = unit_span(m, int(seq[n]), int(u.a[k]), int(u.b[k]))
    lo, hi = compressed_ranges(m, seq, f0, f1, u.framed[own])
    shard = np.searchsorted(m.shard_starts, seq, side="right") - 1
    runs = compressed_runs(shard, lo, hi)
    want = []  # naive: a new run at a new shard or past a gap wider than COMPRESSED_GAP
    for n in range(len(lo)):
        if want and want[-1][0] == shard[n] and lo[n] - hi[n - 1] <= frames_mod.COMPRESSED_GAP:
            want[-1][2] = max(want[-1][2], hi[n])
        else:
            want.append([shard[n], lo[n], hi[n]])
    assert [(a, b) for _, a, b in want] == list(zip(runs.run_lo.tolist(), runs.run_hi.tolist()))
    assert (runs.run_lo[runs.run] <= lo).all() and (hi <= runs.run_hi[runs.run]).all()
    assert np.array_equal(runs.first[:-1], np.flatnonzero(np.diff(np.concatenate([[-1], runs.run]))))
    with mock.patch.object(frames_mod, "RAW_BATCH", raw):
        batches = raw_batches(runs)
    size = (runs.run_hi - runs.run_lo).tolist()
    assert [r for r0, r1 in batches for r in range(r0, r1)] == list(range(len(runs)))
    for r0, r1 in batches:  # as many runs as fit, at least one
        assert r1 - r0 == 1 or sum(size[r0:r1]) <= raw
        assert r1 == len(runs) or sum(size[r0 : r1 + 1]) > raw
