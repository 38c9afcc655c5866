"""pack writes the same bytes as before the redesign: every file of a small corpus in every input format.

The digests in ``pack_digests.json`` were first recorded at the start of the pack redesign (branch
redesign-pack, from b381173), before any packing code moved, and recorded anew when packing
became a function of one unit of input (branch cluster-pack): each unit writes its own shards,
named from a generation and the unit's number (``shard-g000001-u000003-000000.tar``), so shards
no longer span input files; the members' bytes are unchanged. Recorded anew when the chunk
checksums moved from index.json (or its columns file) into a sums file beside each shard
(branch checks): every shard's bytes unchanged, index files changed, ``.sums`` files added. Each case packs one input
(npy files with a big-endian one and an empty one, stored and compressed npz with a cast,
long and row parquet, csv, jsonl with metadata, text, an iterable with NaN, metadata and
long zstd members, two workers, parts then merge, a columnar manifest) and every file the
pack wrote, shards and index, must have the recorded sha256. Rerun with ``--record`` only
where a change of the bytes on disk is intended (and say so in the commit).
"""
from __future__ import annotations

import gzip
import hashlib
import json
import sys
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streamwin as sw

DIGESTS = Path(__file__).with_name("pack_digests.json")


def write_inputs(root: Path) -> dict[str, Path]:
    """One small input per format, from a seeded generator (the same bytes of values every run)."""
    rng = np.random.default_rng(19)
    out = {}
    npy = out["npy"] = root / "npy"
    for i in range(30):
        (npy / f"d{i % 3}").mkdir(parents=True, exist_ok=True)
        arr = rng.normal(size=(int(rng.integers(1, 300)), 2)).astype("f4")
        np.save(npy / f"d{i % 3}" / f"s.{i:02d}.npy", arr.astype(">f4") if i == 7 else arr)
    np.save(npy / "d0" / "empty.npy", np.zeros((0, 2), "f4"))
    np.save(npy / "d1" / "long.npy", rng.normal(size=(140_000, 2)).astype("f4"))  # over a record, over frames
    npz = out["npz"] = root / "npz"
    npz.mkdir()
    np.savez(npz / "a.npz", **{f"x{i}": rng.integers(0, 99, size=(int(rng.integers(0, 50)), 3)).astype("i2")
                                for i in range(40)})
    np.savez(npz / "b.npz", **{f"y.{i}": rng.normal(size=(int(rng.integers(1, 50)), 3)) for i in range(5)})
    np.savez_compressed(npz / "c.npz", **{f"z{i}": rng.normal(size=(9, 3)).astype("f4") for i in range(4)})
    out["long_parquet"] = _long_table(root / "long.parquet", rng, ids=60, rows=2000)
    out["columnar"] = _long_table(root / "columnar.parquet", rng, ids=100_005, rows=150_000)
    rows = root / "rows.parquet"
    lists = [rng.integers(0, 1000, size=int(rng.integers(0, 40))).tolist() for _ in range(50)]
    pq.write_table(pa.table({"doc": [f"doc.{i}" for i in range(50)], "tokens": lists}), rows)
    out["row_parquet"] = rows
    csv = out["csv"] = root / "series.csv"
    lines = ["series,t,a,b,note"] + [f"s{i % 7},{(i * 5) % 11},{rng.normal():.6f},{i % 4},n{i}" for i in range(300)]
    csv.write_text("\n".join(lines) + "\n")
    jsonl = out["jsonl"] = root / "jsonl"
    jsonl.mkdir()
    docs = [json.dumps({"id": f"doc{i}", "tokens": rng.integers(0, 5000, size=int(rng.integers(1, 90))).tolist(),
                        "lang": ["en", "de"][i % 2], "score": i / 7}) for i in range(40)]
    (jsonl / "a.jsonl").write_text("\n".join(docs[:25]) + "\n")
    (jsonl / "b.jsonl.gz").write_bytes(gzip.compress(("\n".join(docs[25:]) + "\n").encode(), mtime=0))
    text = out["text"] = root / "text"
    (text / "src").mkdir(parents=True)
    for i in range(12):
        (text / "src" / f"f{i}.c").write_bytes(rng.integers(32, 127, size=int(rng.integers(0, 3000))).astype("u1").tobytes())
    return out


def _long_table(path: Path, rng: np.random.Generator, ids: int, rows: int) -> Path:
    """A long-layout parquet file: ``ids`` sequences (every id at least once) over ``rows`` rows, shuffled."""
    series = np.concatenate([np.arange(ids), rng.integers(0, ids, size=rows - ids)])
    rng.shuffle(series)
    pq.write_table(pa.table({"series": [f"s.{i}" for i in series.tolist()], "t": rng.permutation(rows),
                             "v": rng.normal(size=rows).astype("f4"), "w": rng.integers(0, 9, size=rows)}), path)
    return path


def iterable(rng_seed: int = 5):
    """Sequences with metadata, NaN and inf values, and zstd members long enough for several frames."""
    rng = np.random.default_rng(rng_seed)
    for i in range(25):
        arr = rng.normal(size=(int(rng.integers(1, 500)) if i % 6 else 70_000, 4)).astype("f4")
        if i % 5 == 0:
            arr[:: 97 + i] = np.nan
            arr[3 % len(arr)] = np.inf
        yield f"it{i}", arr, ({"i": i, "name": f"n{i}"} if i % 3 == 0 else None)


def cases(inputs: dict[str, Path], dest: Path) -> dict[str, Path]:
    """Pack every case; returns case name -> dataset root."""
    done = {}

    def run(name: str, source, **kw) -> None:
        done[name] = dest / name
        sw.pack(source, str(done[name]), progress=False, **kw)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # NaN counted
        run("npy", inputs["npy"], shard_bytes=1 << 16)
        run("npy_zstd", inputs["npy"], shard_bytes=1 << 16, compression="zstd")
        run("npy_workers", inputs["npy"], shard_bytes=1 << 16, workers=2)
        run("npz_cast", inputs["npz"], shard_bytes=4000, cast="float32")
        run("long_parquet", inputs["long_parquet"], shard_bytes=8000, id_column="series", order_column="t")
        run("row_parquet", inputs["row_parquet"], shard_bytes=8000, id_column="doc")
        run("csv", inputs["csv"], id_column="series", order_column="t", value_columns=["a", "b"], cast="float64")
        run("jsonl", inputs["jsonl"], shard_bytes=10_000, dtype="int16")
        run("text", inputs["text"], shard_bytes=10_000, format="text")
        run("iterable_zstd", iterable(), shard_bytes=1 << 18, compression="zstd")
        run("iterable", iterable(), shard_bytes=1 << 18)
        run("columnar", inputs["columnar"], shard_bytes=1 << 24, id_column="series", value_columns=["v"])
        for i in range(3):
            sw.pack(inputs["npy"], str(dest / "parts"), part=f"{i}/3", shard_bytes=1 << 15, progress=False)
        sw.merge(str(dest / "parts"))
        done["parts"] = dest / "parts"
        run("npy_32k", inputs["npy"], shard_bytes=1 << 15)
    return done


def digests(inputs_root: Path, dest: Path) -> dict[str, dict[str, str]]:
    """sha256 of every file each case wrote, by case and file name."""
    done = cases(write_inputs(inputs_root), dest)
    return {name: {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}
            for name, root in done.items()}


def test_pack_writes_the_recorded_bytes(tmp_path):
    want = json.loads(DIGESTS.read_text())
    got = digests(tmp_path / "in", tmp_path / "out")
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], f"case {name!r}: files differ from the bytes recorded"
    # independent of how the units ran: in 2 worker processes, or in 3 parts merged, as in one process
    assert got["npy_workers"] == got["npy"] and got["parts"] == got["npy_32k"]


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/test_pack_bytes.py --record  (rewrites pack_digests.json)")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        recorded = digests(Path(tmp) / "in", Path(tmp) / "out")
    DIGESTS.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    print(f"recorded {sum(map(len, recorded.values()))} files of {len(recorded)} cases in {DIGESTS}")
