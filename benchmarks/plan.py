"""Planner scale and shuffle quality, from the plan alone (no I/O).

1. Time to plan one epoch for 1M and 10M sequences at 1, 64 and 4096 ranks x 8 workers.
2. Mixing: distinct sequences per batch (and the largest share of one sequence in a batch)
   for streamwin's block shuffle at several shuffle_buffer sizes, against a perfect global
   shuffle of all windows and against no shuffle, on the perf-notes corpus shape
   (10,963 sequences, lengths log-uniform 200..20,000, W=256, stride 64, batch 256).
3. Mixing of the ways a worker-independent (canonical) order can deal an epoch (docs/performance.md,
   "What it would take to be the default"): distinct sequences per global batch of 256 and the
   windows a process in one process holds, each from the same epoch order of slices.

    python benchmarks/plan.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from streamwin.plan import PlanConfig, WindowSpec, make_plan


def plan_timing(n_seqs: int, world: int, workers: int, repeats: int) -> float:
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 4000, size=n_seqs)
    shard_starts = np.arange(0, n_seqs + 1, max(1, n_seqs // 1000))
    if shard_starts[-1] != n_seqs:
        shard_starts = np.append(shard_starts, n_seqs)
    cfg = PlanConfig(WindowSpec(256, 64), batch_size=256, world_size=world, num_workers=workers)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        make_plan(lengths, shard_starts, cfg, epoch=1)
        best = min(best, time.perf_counter() - t)
    return best


def mixing(lengths: np.ndarray, shard_starts: np.ndarray, buffer: int | None, batches: int) -> dict:
    """Distinct sequences per batch over the first ``batches`` batches of stream 0."""
    b = 256
    spec = WindowSpec(256, 64)
    if buffer is None:  # perfect global shuffle of every window
        counts = spec.counts(lengths)
        seq_of_window = np.repeat(np.arange(len(lengths)), counts)
        order = np.random.default_rng(0).permutation(len(seq_of_window))
        seqs = seq_of_window[order][: batches * b].reshape(batches, b)
    else:
        shuffle = buffer > 0
        cfg = PlanConfig(spec, batch_size=b, shuffle=shuffle, block_windows=max(buffer, b),
                         slice_windows=max(1, buffer // 8) if shuffle else 1250)
        plan = make_plan(lengths, shard_starts, cfg, epoch=0).sources[0]
        rows, k = [], 0
        while sum(len(r) for r in rows) < batches * b and k < plan.num_blocks(0):
            g, _ = plan.block(0, k)
            rows.append(plan.locate(g)[0])
            k += 1
        seqs = np.concatenate(rows)[: batches * b].reshape(-1, b)
    distinct = [len(np.unique(r)) for r in seqs]
    top = [np.bincount(r).max() / b for r in seqs]
    return {"distinct_per_batch": float(np.mean(distinct)), "max_share_of_one_sequence": float(np.mean(top))}


def canonical_mixing(lengths: np.ndarray, shard_starts: np.ndarray, buffer: int, batches: int,
                     slots: int = 8, phases: int = 8) -> dict[str, dict]:
    """Distinct sequences per global batch (G = 256) over ``batches`` global batches, per design.

    Every design cuts the same epoch order (slices of buffer // 8 windows, permuted) into ranges,
    one per stream, and permutes each stream's blocks; they differ in streams and block sizes:
    one stream (today, one process), phases with full blocks (``canonical=(A, P)`` today), chunks
    (A streams, blocks of Q micro-batches, Q = buffer / G), stripes (``canonical=(A, 1)`` as built: chunk j of
    Q steps is one range of the order, cut slot after slot), and phases with blocks aligned to the
    step (A x P streams, blocks of Q micro-batches, Q = buffer / (P G)). ``held``: windows of the
    blocks one process holds at a time (without read-ahead).
    """
    g = 256
    spec = WindowSpec(256, 64)
    cfg = PlanConfig(spec, batch_size=g, block_windows=buffer, slice_windows=max(1, buffer // 8))
    source = make_plan(lengths, shard_starts, cfg, epoch=0).sources[0]
    total = source.total_windows
    seq = source.space.locate(source.order.at(np.arange(total, dtype=np.int64)))[0]
    rng = np.random.default_rng(1)

    def stream(lo: int, hi: int, block: int, need: int) -> np.ndarray:
        """The first ``need`` sequences a stream over order positions [lo, hi) yields, blocks permuted."""
        out, at = [], lo
        while sum(len(x) for x in out) < need and at < hi:
            part = seq[at : min(at + block, hi)]
            out.append(part[rng.permutation(len(part))])
            at += block
        return np.concatenate(out)[:need]

    def interleave(streams: int, micro: int, block: int, phase_count: int) -> np.ndarray:
        """Global batch k: stream (a, k mod phase_count)'s micro-batch k // phase_count, slot after slot."""
        edges = np.arange(streams + 1) * total // streams
        per = -(-batches // phase_count) * micro
        lanes = [stream(int(edges[c]), int(edges[c + 1]), block, per) for c in range(streams)]
        rows = []
        for k in range(batches):
            p, t = k % phase_count, k // phase_count
            rows.append(np.concatenate([lanes[a * phase_count + p][t * micro : (t + 1) * micro]
                                        for a in range(slots)]))
        return np.stack(rows)

    def striped(micro: int, steps: int) -> np.ndarray:
        """canonical=(A, 1) as built: chunk j of the order (``steps`` global batches) cut into the slots' stripes,
        slot after slot, each permuted; global batch k takes each slot's next micro-batch of its stripe."""
        rows, at = [], 0
        for _ in range(-(-batches // steps)):
            lanes = []
            for _a in range(slots):
                part = seq[at : at + steps * micro]
                lanes.append(part[rng.permutation(len(part))])
                at += steps * micro
            rows += [np.concatenate([lane[t * micro : (t + 1) * micro] for lane in lanes]) for t in range(steps)]
        return np.stack(rows[:batches])

    m = g // slots
    q_chunk, q_phase = max(1, buffer // g), max(1, round(buffer / (phases * g)))
    designs = {
        "one stream (canonical=None)": (stream(0, total, buffer, batches * g).reshape(-1, g), buffer),
        f"phases, full blocks (canonical=({slots}, {phases}))": (interleave(slots * phases, m, buffer, phases),
                                                                  slots * phases * buffer),
        f"chunks, {slots} slots, blocks of {q_chunk} steps": (interleave(slots, m, q_chunk * m, 1), slots * q_chunk * m),
        f"stripes of one chunk, {slots} slots, {q_chunk} steps (canonical=({slots}, 1))": (striped(m, q_chunk),
                                                                                       slots * q_chunk * m),
        f"phases, blocks of {q_phase} steps": (interleave(slots * phases, m, q_phase * m, phases),
                                               slots * phases * q_phase * m),
    }
    out = {}
    for name, (rows, held) in designs.items():
        out[name] = {"distinct_per_batch": float(np.mean([len(np.unique(r)) for r in rows])),
                     "max_share_of_one_sequence": float(np.mean([np.bincount(r).max() / g for r in rows])),
                     "windows_held": int(held)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    repeats = 1 if a.quick else 3
    sizes = [1_000_000] if a.quick else [1_000_000, 10_000_000]
    print("| sequences | ranks x workers | plan time (s) |\n|---:|---:|---:|")
    timing = {}
    for n in sizes:
        for world in (1, 64, 4096):
            t = plan_timing(n, world, 8, repeats)
            timing[f"{n}x{world}"] = t
            print(f"| {n:,} | {world} x 8 | {t:.3f} |")

    rng = np.random.default_rng(0)
    lengths = np.exp(rng.uniform(np.log(200), np.log(20_000), size=10_963)).astype(np.int64)
    shard_starts = np.append(np.arange(0, 10_963, 400), 10_963)
    print("\n| shuffle | distinct sequences per batch of 256 | largest share of one sequence |\n|---|---:|---:|")
    mix = {}
    for name, buf in [("none", 0), ("streamwin buffer 1,000", 1_000), ("streamwin buffer 10,000", 10_000),
                      ("streamwin buffer 100,000", 100_000), ("perfect global shuffle", None)]:
        r = mixing(lengths, shard_starts, buf, batches=50)
        mix[name] = r
        print(f"| {name} | {r['distinct_per_batch']:.1f} | {r['max_share_of_one_sequence']:.2f} |")
    print("\n| canonical design (shuffle_buffer 10,000) | distinct sequences per global batch of 256 | largest share "
          "of one sequence | windows held in one process |\n|---|---:|---:|---:|")
    canon = canonical_mixing(lengths, shard_starts, 10_000, batches=64)
    for name, r in canon.items():
        print(f"| {name} | {r['distinct_per_batch']:.1f} | {r['max_share_of_one_sequence']:.2f} | "
              f"{r['windows_held']:,} |")
    print(json.dumps({"plan_seconds": timing, "mixing": mix, "canonical_mixing": canon}))


if __name__ == "__main__":
    main()
