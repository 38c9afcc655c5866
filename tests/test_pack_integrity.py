"""pack never damages what is at its destination (issue 20, item 1; issue 22, item 6), through real parts.

Foreign files are refused by name; two packs racing for one destination cannot both commit;
a pack killed with SIGKILL at any moment (local disk and the S3 server on loopback) leaves
the old dataset readable and unchanged or the new one complete, and the next pack cleans
what it left; a reader of the old index mid-epoch finishes its epoch; a killed
``pack --workers 2`` leaves no process and nothing in /dev/shm; object storage that cannot
be reached fails within seconds, and pack never creates a bucket unless asked.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import streamwin as sw
from conftest import make_sequences
from streamwin.errors import PackError
from streamwin.packing import lock as packlock

REPO = Path(__file__).resolve().parent.parent

# packs `n` sequences of `seed` from a generator that touches <progress>/<i> before item i and sleeps `pause` s
SLOW_PACK = """
import json, sys, time, pathlib
import numpy as np
import streamwin as sw
dest, seed, n, pause, progress, options = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), \\
    pathlib.Path(sys.argv[5]), json.loads(sys.argv[6])
def items():
    rng = np.random.default_rng(seed)
    for i in range(n):
        (progress / str(i)).touch()
        time.sleep(pause)
        yield f"s{seed}_{i:04d}", np.full((int(rng.integers(50, 400)), 2), seed * 1000 + i, np.float32)
    (progress / "done").touch()
go = progress / "go"
(progress / "ready").touch()
while not go.exists():
    time.sleep(0.005)
sw.pack(items(), dest, shard_bytes=8 << 10, progress=False, storage_options=options or None)
print("committed")
"""


def expected(seed: int, n: int) -> dict[str, np.ndarray]:
    """What SLOW_PACK packs, computed here."""
    rng = np.random.default_rng(seed)
    return {f"s{seed}_{i:04d}": np.full((int(rng.integers(50, 400)), 2), seed * 1000 + i, np.float32) for i in range(n)}


def start_pack(dest: str, seed: int, n: int, progress: Path, pause: float = 0.002, options: dict | None = None,
               go: bool = True) -> subprocess.Popen:
    progress.mkdir(parents=True, exist_ok=True)
    if go:
        (progress / "go").touch()
    return subprocess.Popen([sys.executable, "-c", SLOW_PACK, dest, str(seed), str(n), str(pause), str(progress),
                             json.dumps(options or {})], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))


def read_all(url: str, options: dict | None = None) -> dict[str, np.ndarray]:
    """Every sequence of the dataset at ``url``, read through its manifest (shards checked by verify first)."""
    sw.verify(url, storage_options=options, progress=False)
    ds = sw.WindowDataset(url, window=1, stride=1, batch_size=1, read=sw.Read(storage_options=options))
    m = ds.manifest
    out = {}
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    for i in range(m.num_sequences):
        shard = m.shards[m.shard_of(i)]
        data = fs.cat_file(f"{root}/{shard.name}", start=int(m.offset[i]) + int(m.hlen[i]),
                           end=int(m.offset[i]) + int(m.size[i]))
        out[m.key(i)] = np.frombuffer(data, dtype=m.dtype).reshape((-1, *m.step_shape))
    return out


def same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> bool:
    return list(got) == list(want) and all(np.array_equal(got[k], want[k]) for k in want)


def wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.002)


# ---- foreign files ----------------------------------------------------------------------------

def test_foreign_files_are_refused_by_name_and_replaced_only_when_asked(tmp_path):
    """Before: a folder of another tool's shard-00000N.tar lost 9 of its 10 files without a word."""
    dest = tmp_path / "dest"
    dest.mkdir()
    theirs = {f"shard-{i:06d}.tar": os.urandom(100 + i) for i in range(10)}
    for name, data in theirs.items():
        (dest / name).write_bytes(data)
    seqs = list(make_sequences(12, seed=1).items())
    with pytest.raises(PackError, match=r"holds 10 file\(s\) that are not this dataset's: shard-000000.tar, "
                                        r"shard-000001.tar.* and 5 more.*overwrite=True"):
        sw.pack(seqs, str(dest), shard_bytes=4 << 10, progress=False)
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == theirs  # untouched, and no lock left behind
    m = sw.pack(seqs, str(dest), shard_bytes=4 << 10, progress=False, overwrite=True)
    assert sorted(os.listdir(dest)) == sorted([s.name + x for s in m.shards for x in ("", ".sums")] + ["index.json"])
    assert same(read_all(str(dest)), dict(seqs))
    # a streamwin dataset is not foreign: re-packing it needs no overwrite
    sw.pack(seqs[:5], str(dest), shard_bytes=4 << 10, progress=False)


# ---- re-packs and their readers ---------------------------------------------------------------

def test_a_reader_of_the_old_index_finishes_its_epoch_across_a_repack(tmp_path):
    """Before: re-packing in place while a job trained gave it new bytes through the old manifest."""
    dest = str(tmp_path / "ds")
    old = make_sequences(40, seed=2)
    sw.pack(list(old.items()), dest, shard_bytes=8 << 10, progress=False)
    loader = sw.WindowLoader(sw.WindowDataset(dest, window=8, stride=8, batch_size=4, shuffle_buffer=16, seed=0),
                             num_workers=0)
    seen = 0
    for step, batch in enumerate(loader):
        if step == 3:  # mid-epoch: the dataset is re-packed in place with other values, twice the same keys
            sw.pack([(k, -a) for k, a in old.items()], dest, shard_bytes=8 << 10, progress=False)
        for key, start, x in zip(batch["key"], batch["start"].tolist(), batch["x"].numpy()):
            np.testing.assert_array_equal(x, old[key][start : start + 8])  # the old bytes, to the end
            seen += 1
    assert step > 6 and seen == (step + 1) * 4
    assert same(read_all(dest), {k: -a for k, a in old.items()})  # a new reader sees the new dataset


def test_a_pack_that_lost_its_lock_does_not_commit(tmp_path):
    """The generation check: a pack whose lock was taken over (as stale) while it ran does not commit."""
    dest = str(tmp_path / "ds")
    other = list(make_sequences(6, seed=4).items())

    def hijacked():
        for i, item in enumerate(make_sequences(20, seed=3).items()):
            if i == 10:  # another pack takes the destination over: it removes our lock as if we had died
                os.remove(os.path.join(dest, packlock.LOCK_NAME))
                sw.pack(other, dest, progress=False)
            yield item

    with pytest.raises(PackError, match="lost its lock.*does not commit"):
        sw.pack(hijacked(), dest, shard_bytes=4 << 10, progress=False)
    assert same(read_all(dest), dict(other))
    assert not any(n.startswith("shard-g000001-") for n in os.listdir(dest))  # the loser's shards are gone


def test_two_packs_racing_for_one_destination_cannot_both_commit(tmp_path):
    """Before: the first "succeeded" holding the second's values; the second died with a raw FileNotFoundError."""
    dest = str(tmp_path / "ds")
    procs = [start_pack(dest, seed, 60, tmp_path / f"p{seed}", pause=0.01, go=False) for seed in (1, 2)]
    for seed in (1, 2):
        wait_for(tmp_path / f"p{seed}" / "ready")
    for seed in (1, 2):
        (tmp_path / f"p{seed}" / "go").touch()  # released together, each pack taking 0.6 s
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    codes = [r[0] for r in results]
    assert sorted(codes) == [0, 1], results
    winner = (1, 2)[codes.index(0)]
    loser_err = results[codes.index(1)][2]
    assert "is locked by another pack" in loser_err and "two packs cannot commit to one destination" in loser_err
    assert "Traceback" in loser_err and loser_err.strip().splitlines()[-1].startswith("streamwin.errors.PackError")
    assert same(read_all(dest), expected(winner, 60))


# ---- SIGKILL at any moment ---------------------------------------------------------------------

@pytest.mark.parametrize("where", ["local", "s3"])
def test_sigkill_at_any_moment_leaves_the_old_dataset_or_the_new_one(tmp_path, where, request):
    """Before: a killed re-pack left no index.json, and `streamwin index` then mixed old and new sequences."""
    if where == "s3":
        s3_server = request.getfixturevalue("s3_server")
        options = s3_server.storage_options()
        dest = f"{s3_server.make_bucket()}/corpus"
    else:
        options, dest = None, str(tmp_path / "ds")
    old = expected(7, 30)
    sw.pack(list(old.items()), dest, shard_bytes=8 << 10, progress=False, storage_options=options)
    new = expected(8, 80)
    # before any item, early, midway, at the commit (twice); on S3 (slower to start) early and at the commit
    moments = ["0", "5", "40", "done", "done"] if where == "local" else ["5", "done"]
    for k, moment in enumerate(moments):
        progress = tmp_path / f"kill{k}"
        proc = start_pack(dest, 8, 80, progress, options=options)
        wait_for(progress / moment)
        if moment == "done":
            time.sleep(0.02 * k)  # somewhere in the commit, or just after it
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        got = read_all(dest, options)
        assert same(got, old) or same(got, new), f"killed at {moment}: neither the old nor the new dataset"
        old = got  # a kill after the commit leaves the new dataset: from then on, that is the one there
    proc = start_pack(dest, 9, 10, tmp_path / "final", options=options)  # takes the dead packs' lock over at once
    assert proc.wait(timeout=120) == 0, proc.communicate()
    m = sw.load_manifest(dest, storage_options=options)
    import fsspec

    fs, root = fsspec.core.url_to_fs(dest, **(options or {}))
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    kept = json.loads(fs.cat_file(f"{root}/{[n for n in names if n.startswith('index-g')][0]}"))
    # what the killed packs left is gone: the new dataset, and the one it replaced (kept for its readers), only
    assert names == sorted([s.name + x for s in m.shards for x in ("", ".sums")]  # each shard, and its sums file
                           + [s["name"] + x for s in kept["shards"] for x in ("", ".sums")]
                           + ["index.json", [n for n in names if n.startswith("index-g")][0]])
    assert same(read_all(dest, options), expected(9, 10))


def held(psutil, path: Path) -> bool:
    """Whether a live process has ``path`` open or mapped (another job's shared memory on this machine), or it
    is gone already (a semaphore's name, unlinked once made); an entry that the killed pack left has no holder."""
    for proc in psutil.process_iter():
        try:
            if any(f.path == str(path) for f in proc.open_files()) or any(
                    m.path.startswith(str(path)) for m in proc.memory_maps()):
                return True
        except psutil.Error:
            continue
    return not path.exists()


def test_a_killed_pack_with_workers_leaves_no_process_and_nothing_in_dev_shm(tmp_path):
    """Before: a killed `pack --workers 2` left its spill files in /dev/shm."""
    psutil = pytest.importorskip("psutil")
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(40):
        np.save(src / f"a{i:03d}.npy", rng.normal(size=(60_000, 4)).astype(np.float32))
    shm = lambda: sorted(p.name for p in Path("/dev/shm").glob("*")) if Path("/dev/shm").is_dir() else []
    before = shm()
    dest = tmp_path / "ds"
    proc = subprocess.Popen([sys.executable, "-m", "streamwin.cli", "pack", str(src), str(dest), "--workers", "2",
                             "--shard-size", "2MB", "--no-progress"], env=dict(os.environ, PYTHONPATH=str(REPO)))
    deadline = time.monotonic() + 60
    while not (dest.is_dir() and any(".tar" in n for n in os.listdir(dest))):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.01)
    workers = psutil.Process(proc.pid).children(recursive=True)
    assert workers
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"workers outlived the killed pack: {alive}"
    orphans = [n for n in shm() if n not in before and not held(psutil, Path("/dev/shm") / n)]
    assert not orphans, f"left in /dev/shm by the killed pack: {orphans}"  # others' live entries are not ours
    assert not (dest / "index.json").exists()
    sw.pack(str(src), str(dest), shard_bytes=2 << 20, progress=False)  # the next pack cleans up after it
    assert not [n for n in os.listdir(dest) if ".tmp" in n or n == packlock.LOCK_NAME]


# ---- object storage: reachable fast or a clear error; no bucket created unless asked -------------

def test_unreachable_object_storage_fails_within_seconds_in_one_line(tmp_path, s3_server):
    """Before: 60-136 lines of botocore traceback after 26-28 s, exit 1."""
    import socket

    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src = tmp_path / "src"
    src.mkdir()
    np.save(src / "a.npy", np.ones((5, 2), np.float32))
    # the CLI's main timed in its process once its imports are done (they take seconds on a busy machine)
    timed = ("import sys, time, s3fs\nfrom streamwin.cli.main import main\nstart = time.monotonic()\ncode = main()\n"
             "print(f'{time.monotonic() - start:.3f}')\nsys.exit(code)")
    r = subprocess.run([sys.executable, "-c", timed, "pack", str(src), "s3://bucket/corpus", "--no-progress",
                        "--storage-option", f"client_kwargs.endpoint_url=http://127.0.0.1:{port}"],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert float(r.stdout.split()[-1]) < 10, r.stdout
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("streamwin pack: error: cannot reach s3://bucket/corpus: connection refused")


def test_pack_creates_no_bucket_unless_asked(s3_server):
    options = s3_server.storage_options()
    bucket = f"sw-absent-{os.getpid()}"
    seqs = list(make_sequences(4, seed=5).items())
    with pytest.raises(PackError, match=f"bucket '{bucket}' does not exist.*create_bucket=True"):
        sw.pack(seqs, f"s3://{bucket}/corpus", storage_options=options, progress=False)
    fs = s3_server.filesystem()
    assert not fs.exists(bucket)
    sw.pack(seqs, f"s3://{bucket}/corpus", storage_options=options, progress=False, create_bucket=True)
    assert same(read_all(f"s3://{bucket}/corpus", options), dict(seqs))
