"""Growth: what an append writes, what a manifest appended to 1,000 times costs, what continuations cost a reader.

  write     a dataset of --seqs sequences (--steps steps of --features float32 each), then an append of
            1% new sequences, then an extension of 1% of the old ones by --steps/10 steps: the bytes
            each wrote (its new files, and index.json with its columns file) beside the dataset's bytes.
  manifest  --manifest-seqs sequences, packed at once, and packed as --base of them then appended to
            --appends times (the rest, in equal appends): index.json and columns file bytes, and each
            loaded in a fresh process (benchmarks/scale.py's child_manifest): seconds, resident bytes
            per sequence. The appended manifest is laid out as ``grow`` lays out each append's (checked
            here against --check-appends real grow() calls at a small scale), over synthetic shards as
            scale.py's (no shard bytes behind it: loading reads only the manifest).
  reads     --read-seqs sequences of --read-steps steps, packed whole, and packed as a first part
            extended 1, 2, 4, 8 and 16 times (the same steps in all), then the 16 compacted: every block
            of an epoch's plan (shuffle on) read by one ShardReader on this thread, the best of
            --repeats passes (the datasets in turns): CPU and wall time per window, bytes read per
            window, reads per block (each a GET on object storage).

    python benchmarks/grow.py --quick          # small sizes, ~1 min on 2 cores
    python benchmarks/grow.py                  # 2M-sequence manifests, 1,000 appends (~4 min)

Prints a markdown table per part and one JSON line.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def files(root: str) -> dict[str, int]:
    return {n: os.path.getsize(os.path.join(root, n)) for n in os.listdir(root) if not n.startswith(".")}


def written(before: dict[str, int], after: dict[str, int]) -> tuple[int, int]:
    """(bytes of new shards and sums files, bytes of new or rewritten manifest files) between two listings."""
    data = sum(s for n, s in after.items() if n not in before and n.startswith("shard-"))
    index = sum(s for n, s in after.items() if n.startswith("index") and before.get(n) != s or
                (n.startswith("index") and n not in before))
    return data, index


def measure_write(root: Path, seqs: int, steps: int, features: int) -> dict:
    """Bytes written by a 1% append and a 1% extension, beside the dataset's bytes."""
    import streamwin as sw

    url = str(root / "write")
    rng = np.random.default_rng(0)

    def items(keys, n):
        for k in keys:
            yield k, rng.standard_normal((n, features)).astype(np.float32)
    sw.pack(items([f"s{i:07d}" for i in range(seqs)], steps), url, progress=False)
    base = files(url)
    dataset = sum(base.values())
    new = max(1, seqs // 100)
    sw.pack(items([f"n{i:07d}" for i in range(new)], steps), url, progress=False, mode="append")
    appended = files(url)
    a_data, a_index = written(base, appended)
    sw.pack(items([f"s{i:07d}" for i in range(0, seqs, 100)], steps // 10), url, progress=False, mode="extend")
    e_data, e_index = written(appended, files(url))
    added = new * steps * features * 4
    return {"dataset_bytes": dataset, "append_data_bytes": a_data, "append_manifest_bytes": a_index,
            "append_data_share": a_data / dataset, "append_values_share": added / dataset,
            "extend_data_bytes": e_data, "extend_manifest_bytes": e_index,
            "extend_values_bytes": len(range(0, seqs, 100)) * (steps // 10) * features * 4}


# -- manifests: packed at once, appended to ----------------------------------------------------------

PER_SHARD = 100_000


def _shard(name: str, rows: int, steps: int):
    from streamwin.formats.manifest import ShardEntry
    return ShardEntry(name, 1024 * rows + 1024, hashlib.sha256(name.encode()).hexdigest(), rows, steps)


def _columns(first: int, n: int, lengths: np.ndarray) -> dict:
    """The columns of sequences first.. (keys s<8 digits>, 1,024-byte members, as scale.py's), offsets from 0."""
    return {"length": lengths, "offset": np.arange(n, dtype=np.int64) * 1024 + 512, "size": 128 + 4 * lengths,
            "hlen": np.full(n, 128, dtype=np.int32)}


def _part(first: int, n: int, shards: list[tuple[str, int]]):
    """A manifest of sequences first..first+n-1 in the shards named (name, rows)."""
    from streamwin.formats.checks import Checks
    from streamwin.formats.manifest import Manifest, NonFinite

    lengths = np.random.default_rng(first).integers(8, 57, size=n).astype(np.int64)
    cols, at = _columns(first, n, lengths), 0
    entries = []
    for name, rows in shards:
        cols["offset"][at : at + rows] -= cols["offset"][at] - 512
        entries.append(_shard(name, rows, int(lengths[at : at + rows].sum())))
        at += rows
    keys = "".join(f"s{i:08d}" for i in range(first, first + n)).encode()
    digests = [(hashlib.sha256(e.name.encode()).hexdigest()[:16], hashlib.sha256(e.name.encode() + b"s").hexdigest())
               for e in entries]
    return Manifest(dtype=np.dtype("<f4"), step_shape=(), compression=None, shards=tuple(entries), key_blob=keys,
                    key_ends=np.arange(1, n + 1, dtype=np.int64) * 9, nonfinite=NonFinite(0, 0, (0,) * len(entries)),
                    checks=Checks.of_shards(digests, [e.bytes for e in entries]), **cols)


def at_once(n: int):
    return _part(0, n, [(f"shard-g000001-u{k:06d}-000000.tar", min(PER_SHARD, n - k * PER_SHARD))
                        for k in range(-(-n // PER_SHARD))])


def appended(base: int, appends: int, n: int, check: bool = False):
    """The manifest of ``base`` sequences appended to ``appends`` times up to ``n``: grown by grow() one append at a
    time (``check``), or laid out as grow() lays it out, in one go."""
    from streamwin.formats.growth import Growth, view_id
    from streamwin.formats.manifest import Manifest
    from streamwin.packing.grow import grow

    each = (n - base) // appends
    old = _part(0, base, [(f"shard-g000001-u{k:06d}-000000.tar", min(PER_SHARD, base - k * PER_SHARD))
                          for k in range(-(-base // PER_SHARD))])
    old = dataclasses.replace(old, digest=hashlib.sha256(b"first pack").hexdigest()[:16])  # as loaded from its file
    units = [(base + a * each, [(f"shard-g{a + 2:06d}-u000000-000000.tar", each)]) for a in range(appends)]
    if check:
        for first, shards in units:
            old = grow(old, _part(first, each, shards), None, extend=False, dest="bench")
        return old
    parts = [old] + [_part(first, each, shards) for first, shards in units]
    growth = Growth.first(old.digest, base)
    for a, p in enumerate(parts[1:]):
        growth = growth.grown(view_id(growth.views[-1], [s.sha256 for s in p.shards]), base + (a + 1) * each,
                              np.zeros(0, np.int64), np.zeros(0, np.int64))
    from streamwin.formats.checks import Checks
    from streamwin.formats.framed import NonFinite
    cols = {c: np.concatenate([np.asarray(getattr(p, c)) for p in parts]) for c in ("length", "offset", "size", "hlen")}
    ends, at = [], 0
    for p in parts:
        ends.append(np.asarray(p.key_ends) + at)
        at += len(p.key_blob)
    return Manifest(dtype=old.dtype, step_shape=(), compression=None, shards=tuple(s for p in parts for s in p.shards),
                    key_blob=b"".join(bytes(p.key_blob) for p in parts), key_ends=np.concatenate(ends),
                    nonfinite=NonFinite(0, 0, tuple(0 for p in parts for _ in p.shards)),
                    checks=Checks.concat([p.checks for p in parts]), growth=growth, **cols)


def load_child(url: str) -> dict:
    """benchmarks/scale.py's manifest measurement, in a fresh process."""
    code = f"import json,sys; sys.path.insert(0, {str(REPO)!r}); from benchmarks.scale import child_manifest; " \
           f"print(json.dumps(child_manifest({url!r})))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure_manifests(root: Path, n: int, base: int, appends: int, check_appends: int) -> dict:
    from streamwin.storage.manifests import write_manifest
    from streamwin.storage.urls import url_to_fs

    small = appended(200, check_appends, 200 + 10 * check_appends, check=True)
    laid = appended(200, check_appends, 200 + 10 * check_appends)
    same = small.to_json() == laid.to_json()
    out = {"layout_matches_grow": same, "sequences": n, "appends": appends}
    for name, make in (("at_once", lambda: at_once(n)), ("appended", lambda: appended(base, appends, n))):
        url = str(root / name)
        os.makedirs(url, exist_ok=True)
        t = time.perf_counter()
        m = make()
        write_manifest(*url_to_fs(url), m, columnar=True)
        built = time.perf_counter() - t
        sizes = files(url)
        got = load_child(url)
        out[name] = {"index_json_bytes": sizes["index.json"], "columns_bytes": sizes["index.columns"],
                     "shards": len(m.shards), "build_s": built, **{k: got[k] for k in
                     ("load_s", "rss_bytes_per_seq", "peak_bytes_per_seq", "anon_bytes_per_seq")}}
    return out


# -- reads across continuations ---------------------------------------------------------------------

def measure_reads(root: Path, seqs: int, steps: int, features: int, repeats: int, counts=(0, 1, 2, 4, 8, 16)
                  ) -> list[dict]:
    import streamwin as sw

    rng = np.random.default_rng(1)
    full = {f"r{i:05d}": rng.standard_normal((steps, features)).astype(np.float32) for i in range(seqs)}
    kw = dict(window=256, stride=128, batch_size=64, shuffle_buffer=2048, seed=0)
    urls = {}
    for c in (*counts, "compacted"):
        url = urls[c] = str(root / f"reads-{c}")
        k = 16 if c == "compacted" else c
        cut = np.linspace(0, steps, k + 2).astype(int)
        for j in range(k + 1):
            sw.pack([(key, a[cut[j] : cut[j + 1]]) for key, a in full.items()], url, progress=False,
                    shard_bytes=64 << 20, mode=None if j == 0 else "extend")
        if c == "compacted":
            sw.compact(url, progress=False)
    best = {}
    for _ in range(repeats):  # in turns, each dataset's best pass: the machine's load shared alike
        for c, url in urls.items():
            got = read_blocks(url, kw)
            best[c] = got if c not in best else {**got, "cpu_s": min(best[c]["cpu_s"], got["cpu_s"]),
                                                 "wall_s": min(best[c]["wall_s"], got["wall_s"])}
    return [{"continuations": c, "cpu_us_per_window": 1e6 * r["cpu_s"] / r["windows"],
             "wall_us_per_window": 1e6 * r["wall_s"] / r["windows"], "bytes_read_per_window": r["bytes"] / r["windows"],
             "reads_per_block": r["reads"] / r["blocks"]} for c, r in best.items()]


def read_blocks(url: str, kw: dict) -> dict:
    """Every block of an epoch's plan read by one ShardReader on this thread: its CPU and wall time (the reads of
    local shards run on the calling thread), windows, blocks, bytes and reads."""
    import streamwin as sw

    ds = sw.WindowDataset(url, **kw)
    plan = ds.plan(0)
    source = plan.sources[0]
    reader = ds.sources[0].reader()
    windows = blocks = 0
    wall, cpu = time.perf_counter(), time.thread_time()
    for stream in range(plan.config.num_streams):
        for k in range(source.num_blocks(stream)):
            block = reader.read_block(source, stream, k)
            windows, blocks = windows + len(block), blocks + 1
            reader.release(block)
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    stats = reader.stats
    reader.shutdown()
    return {"cpu_s": cpu, "wall_s": wall, "windows": windows, "blocks": blocks, "bytes": stats.bytes_read,
            "reads": stats.reads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parts", nargs="*", default=["write", "manifest", "reads"], choices=["write", "manifest", "reads"])
    ap.add_argument("--seqs", type=int, default=10_000)
    ap.add_argument("--steps", type=int, default=1_000)
    ap.add_argument("--features", type=int, default=2)
    ap.add_argument("--manifest-seqs", type=int, default=2_000_000)
    ap.add_argument("--base", type=int, default=1_000_000)
    ap.add_argument("--appends", type=int, default=1_000)
    ap.add_argument("--check-appends", type=int, default=100)
    ap.add_argument("--read-seqs", type=int, default=400)
    ap.add_argument("--read-steps", type=int, default=4096)
    ap.add_argument("--read-features", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5, help="epochs per dataset (its best counts)")
    ap.add_argument("--root", default=None, help="work folder (default: a temporary one)")
    a = ap.parse_args()
    if a.quick:
        a.seqs, a.manifest_seqs, a.base, a.appends, a.check_appends = 2_000, 200_000, 100_000, 100, 20
        a.read_seqs, a.read_steps = 100, 2048
    warnings.simplefilter("ignore")
    root = Path(a.root or tempfile.mkdtemp(prefix="grow-bench-"))
    out = {}
    try:
        if "write" in a.parts:
            w = out["write"] = measure_write(root, a.seqs, a.steps, a.features)
            print("\n| dataset | 1% appended: shards + sums | manifest | 1% extended by 10%: shards + sums | manifest |")
            print("|---|---|---|---|---|")
            print(f"| {w['dataset_bytes'] / 1e6:,.1f} MB | {w['append_data_bytes'] / 1e6:,.2f} MB "
                  f"({100 * w['append_data_share']:.2f}%; values {100 * w['append_values_share']:.2f}%) | "
                  f"{w['append_manifest_bytes'] / 1e6:,.2f} MB | {w['extend_data_bytes'] / 1e6:,.2f} MB (values "
                  f"{w['extend_values_bytes'] / 1e6:,.2f} MB) | {w['extend_manifest_bytes'] / 1e6:,.2f} MB |")
        if "manifest" in a.parts:
            m = out["manifest"] = measure_manifests(root, a.manifest_seqs, a.base, a.appends, a.check_appends)
            print(f"\n{m['sequences']:,} sequences (layout of {a.check_appends} real grow() calls matched: "
                  f"{m['layout_matches_grow']})\n")
            print("| manifest | shards | index.json | columns file | load s | resident B/seq (goal <= 40) | peak B/seq |")
            print("|---|---|---|---|---|---|---|")
            for name in ("at_once", "appended"):
                r = m[name]
                label = "packed at once" if name == "at_once" else f"appended to {a.appends:,} times"
                print(f"| {label} | {r['shards']:,} | {r['index_json_bytes'] / 1e3:,.0f} KB | "
                      f"{r['columns_bytes'] / 1e6:,.1f} MB | {r['load_s']:.3f} | {r['rss_bytes_per_seq']:.1f} | "
                      f"{r['peak_bytes_per_seq']:.1f} |")
        if "reads" in a.parts:
            r = out["reads"] = measure_reads(root, a.read_seqs, a.read_steps, a.read_features, a.repeats)
            print(f"\n{a.read_seqs} sequences x {a.read_steps} steps x {a.read_features} float32, window 256, stride 128, "
                  "the blocks of one epoch read on one thread\n")
            print("| continuations per sequence | read CPU us / window | vs none | wall us / window | bytes read / window "
                  "| reads / block |")
            print("|---|---|---|---|---|---|")
            for row in r:
                print(f"| {row['continuations']} | {row['cpu_us_per_window']:.2f} | "
                      f"{row['cpu_us_per_window'] / r[0]['cpu_us_per_window']:.2f} | {row['wall_us_per_window']:.2f} | "
                      f"{row['bytes_read_per_window']:,.0f} | {row['reads_per_block']:.1f} |")
    finally:
        if a.root is None:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
