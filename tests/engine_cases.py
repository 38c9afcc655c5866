"""What the Ray and Dask tests share: inputs in several formats, and the checks every engine must pass.

Each check packs with ``engine=`` and compares against a pack on this machine (``engine=None``)
or against the sequences computed here: byte-identical shards and index for parquet (long
and row layouts), npz and jsonl; a task killed midway retried without a duplicate; a corrupt
input named, with the old dataset left intact.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streamwin as sw
from streamwin.errors import PackError


def write_inputs(root: Path) -> dict[str, tuple[Path, dict]]:
    """name -> (input path, pack options): several files each, so that there are several units."""
    rng = np.random.default_rng(22)
    out = {}
    long = root / "long"
    long.mkdir(parents=True)
    for f in range(3):
        ids = np.repeat([f"f{f}s{i}" for i in range(20)], 30)
        pq.write_table(pa.table({"id": ids, "t": np.tile(np.arange(30)[::-1], 20), "v": rng.normal(size=600)}),
                       long / f"p{f}.parquet")
    out["parquet_long"] = (long, {"id_column": "id", "order_column": "t", "shard_bytes": 4 << 10})
    rows = root / "rows"
    rows.mkdir()
    for f in range(3):
        pq.write_table(row_table(rng, 40, prefix=f"f{f}"), rows / f"r{f}.parquet")
    out["parquet_rows"] = (rows, {"id_column": "id", "list_column": "target", "shard_bytes": 4 << 10})
    npz = root / "npz"
    npz.mkdir()
    for f in range(3):
        np.savez(npz / f"z{f}.npz", **{f"a{i}": rng.normal(size=(int(rng.integers(5, 300)), 2)) for i in range(30)})
    out["npz"] = (npz, {"shard_bytes": 8 << 10})
    jsonl = root / "jsonl"
    jsonl.mkdir()
    for f in range(3):
        (jsonl / f"j{f}.jsonl").write_text("\n".join(json.dumps({"id": f"f{f}d{i}", "tokens": rng.integers(
            0, 999, size=int(rng.integers(1, 200))).tolist()}) for i in range(40)) + "\n")
    out["jsonl"] = (jsonl, {"shard_bytes": 4 << 10})
    return out


def row_table(rng: np.random.Generator, n: int, prefix: str = "s") -> pa.Table:
    """A Chronos-style table: one row per series, an ``id``, a ``target`` list of float32 and a timestamp list."""
    lengths = rng.integers(20, 400, size=n)
    start = np.datetime64("2020-01-01T00:00")
    return pa.table({
        "id": [f"{prefix}_{i}" for i in range(n)],
        "timestamp": [(start + np.arange(t) * np.timedelta64(1, "h")).astype("datetime64[ms]") for t in lengths],
        "target": pa.array([rng.normal(size=t).astype(np.float32) for t in lengths], type=pa.list_(pa.float32())),
    })


def files_of(root: Path) -> dict[str, str]:
    """sha256 of every file of a dataset folder."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


def sequences(url: str) -> dict[str, np.ndarray]:
    """key -> array of every sequence of the dataset at ``url``, read through its manifest."""
    m = sw.load_manifest(url)
    out = {}
    for i in range(m.num_sequences):
        data = (Path(url) / m.shards[m.shard_of(i)].name).read_bytes()
        body = data[int(m.offset[i]) + int(m.hlen[i]) : int(m.offset[i]) + int(m.size[i])]
        out[m.key(i)] = np.frombuffer(body, dtype=m.dtype).reshape((-1, *m.step_shape))
    return out


def check_byte_identical(engine: str, tmp_path: Path, **engine_options) -> None:
    """Every input format packed by ``engine`` gives the bytes of a pack on this machine."""
    for name, (path, options) in write_inputs(tmp_path / "in").items():
        local, remote = tmp_path / f"{name}-local", tmp_path / f"{name}-{engine}"
        sw.pack(str(path), str(local), progress=False, **options)
        m = sw.pack(str(path), str(remote), progress=False, engine=engine, **engine_options, **options)
        assert len({s.name.split("-")[2] for s in m.shards}) == 3, name  # three units, one per file
        assert files_of(local) == files_of(remote), f"{name}: {engine} wrote other bytes than a local pack"


LONG_UNIT = 12_000  # lines of unit 1: long enough for the watcher (a scan of every process: ~0.1 s) to catch it


def check_killed_task_is_retried(engine: str, tmp_path: Path, **engine_options) -> None:
    """A worker killed while it writes a unit's shards: the task runs again, no sequence twice or lost."""
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(5)
    for f in range(3):  # unit 1 is long: 12,000 lines encoded one by one, into ~375 shards (~1.5 s of CPU)
        n = LONG_UNIT if f == 1 else 50
        (src / f"j{f}.jsonl").write_text("\n".join(json.dumps({"id": f"f{f}_{i}", "tokens": [i, i + 1, f]})
                                                   for i in range(n)) + "\n")
    dest = tmp_path / "killed"
    killed: list[int] = []

    def kill_the_writer_of_unit_1() -> None:
        """Once unit 1 has finished a shard, kill the process writing its next one (named by its temporary)."""
        import psutil

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not killed:
            names = os.listdir(dest) if dest.is_dir() else []
            if "shard-g000001-u000001-000000.tar" not in names:
                time.sleep(0.002)
                continue
            for proc in psutil.Process().children(recursive=True):  # ours only: not another job's writer
                try:
                    files = [f.path for f in proc.open_files()]
                except psutil.Error:
                    continue
                if any(os.path.basename(f).startswith("shard-g000001-u000001-") for f in files):
                    os.kill(proc.pid, signal.SIGKILL)
                    killed.append(proc.pid)
                    return

    watcher = threading.Thread(target=kill_the_writer_of_unit_1)
    watcher.start()
    m = sw.pack(str(src), str(dest), shard_bytes=32 << 10, progress=False, engine=engine, **engine_options)
    watcher.join()
    assert killed, "the task of unit 1 was never caught writing"
    local = tmp_path / "local"
    sw.pack(str(src), str(local), shard_bytes=32 << 10, progress=False)
    assert m.num_sequences == LONG_UNIT + 100
    assert files_of(local) == files_of(dest)  # every sequence once, and no temporary left


def check_corrupt_input_is_named(engine: str, tmp_path: Path, **engine_options) -> None:
    """A corrupt input file fails the pack naming it; the dataset already there stays intact and readable."""
    path, options = write_inputs(tmp_path / "in")["parquet_rows"]
    dest = tmp_path / "ds"
    sw.pack(str(path), str(dest), progress=False, engine=engine, **engine_options, **options)
    before, seqs = files_of(dest), sequences(str(dest))
    bad = path / "r1.parquet"
    bad.write_bytes(bad.read_bytes()[:200])
    with pytest.raises(PackError, match="r1.parquet"):
        sw.pack(str(path), str(dest), progress=False, engine=engine, **engine_options, **options)
    assert files_of(dest) == before
    got = sequences(str(dest))
    assert list(got) == list(seqs) and all(np.array_equal(got[k], seqs[k]) for k in seqs)
    sw.verify(str(dest), progress=False)


def check_dataset_object(read, units: int, tmp_path: Path, seed: int) -> None:
    """A dataset object made by ``read(folder)`` from two parquet files packs into ``units`` units (its blocks or
    partitions) and gives the sequences of a pack of the files themselves."""
    rng = np.random.default_rng(seed)
    (tmp_path / "src").mkdir()
    for f in range(2):
        pq.write_table(row_table(rng, 30, prefix=f"f{f}"), tmp_path / "src" / f"r{f}.parquet")
    sw.pack(str(tmp_path / "src"), str(tmp_path / "files"), id_column="id", list_column="target", progress=False)
    m = sw.pack(read(str(tmp_path / "src")), str(tmp_path / "object"), id_column="id", list_column="target",
                progress=False)
    assert len({s.name.split("-")[2] for s in m.shards}) == units
    want, got = sequences(str(tmp_path / "files")), sequences(str(tmp_path / "object"))
    assert list(got) == list(want) and all(np.array_equal(got[k], want[k]) for k in want)
