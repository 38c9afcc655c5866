"""Races, orphans and foreign files at a pack's destination (issue 28, items 1-4), through real parts.

Real pack processes race for one destination (a local folder and the S3 server on loopback);
workers are SIGKILLed with their pack at chosen moments; every round is checked against data
computed here. Each race runs for a couple of rounds; ``python benchmarks/races.py --rounds 50``
runs them 50 times and more.
"""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import streamwin as sw
from conftest import make_sequences
from streamwin.errors import ManifestError, PackError
from streamwin.packing import lock as packlock

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks import races  # noqa: E402


def _dest(where: str, tmp_path: Path, request) -> tuple[str, dict | None]:
    if where == "s3":
        s3 = request.getfixturevalue("s3_server")
        return f"{s3.make_bucket()}/ds", s3.storage_options()
    return str(tmp_path / "ds"), None


def _wait_for(pred, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# ---- item 1: a part pack and a pack never share names or commit over each other -----------------

def test_a_part_pack_started_midway_through_a_pack_gives_way_and_leaves_the_dataset_whole(tmp_path):
    """Before: the part took no lock and wrote the pack's generation and unit numbers; verify failed."""
    dest = str(tmp_path / "ds")
    old = races.expected(7, 30)
    sw.pack(list(old.items()), dest, shard_bytes=8 << 10, progress=False)
    pack = races.Proc(tmp_path, dict(dest=dest, seed=8, n=60, pause=0.01)).ready()
    part = races.Proc(tmp_path, dict(dest=dest, seed=9, n=60, pause=0.0, part="0/2")).ready()
    pack.go()
    _wait_for(lambda: any(n.startswith("shard-g000002-u000000-000001") for n in os.listdir(dest)))
    part.go()  # the pack has written shards of unit 0 of generation 2: what the part would write
    code, _, err = part.result()
    assert code != 0 and races.clean_failure(err, dest), err
    assert "is locked by another pack" in err and f"pid {pack.p.pid}" in err, err
    assert pack.result()[0] == 0
    assert races.same(races.read_all(dest), races.expected(8, 60))


def test_a_pack_started_while_parts_run_refuses_and_the_parts_merge(tmp_path):
    dest = str(tmp_path / "ds")
    old = races.expected(7, 30)
    sw.pack(list(old.items()), dest, shard_bytes=8 << 10, progress=False)
    parts = [races.Proc(tmp_path, dict(dest=dest, seed=9, n=40, pause=0.08, part=f"{i}/2")).ready() for i in range(2)]
    for p in parts:
        p.go()
    _wait_for(lambda: len([n for n in os.listdir(dest) if packlock.PART_LOCK.fullmatch(n)]) == 2)
    with pytest.raises(PackError, match=r"is being packed in parts: part \d/2 is running.*streamwin merge"):
        sw.pack(list(races.expected(8, 10).items()), dest, progress=False)
    with pytest.raises(ManifestError, match="no part indexes"):  # none finished yet
        sw.merge(dest)
    assert races.same(races.read_all(dest), old)  # untouched meanwhile
    assert [p.result()[0] for p in parts] == [0, 0]
    with pytest.raises(PackError, match=r"2 finished part\(s\).*not merged.*streamwin merge.*--overwrite"):
        sw.pack(list(races.expected(8, 10).items()), dest, progress=False)
    sw.merge(dest)
    assert races.same(races.read_all(dest), races.expected(9, 40), ordered=False)


def test_a_pack_and_a_part_job_started_together_never_damage_the_dataset(tmp_path):
    damaged, _, outcome = races.part_vs_pack(tmp_path, str(tmp_path / "ds"), None, random.Random(1))
    assert not damaged, outcome


def test_merge_refuses_parts_of_different_inputs_that_name_one_shard(tmp_path):
    dest = str(tmp_path / "ds")
    for i, n in ((0, 3), (1, 3), (2, 3)):
        seqs = make_sequences(8, seed=i) if i < 2 else make_sequences(8, seed=5)
        sw.pack(list(seqs.items()), dest, part=f"{i}/{n}", progress=False)
    sw.merge(dest)  # iterables: part i is unit i, whatever the input
    for i in range(2):  # files: a contiguous run of units, so parts of different inputs can overlap
        src = tmp_path / f"src{i}"
        src.mkdir()
        for j in range(6 if i == 0 else 2):  # each over shard_bytes: a unit each
            np.save(src / f"f{j}.npy", np.full((200 + j, 2), i, np.float32))
        sw.pack(str(src), dest, part=f"{i}/2", progress=False, shard_bytes=1 << 10)
    with pytest.raises(ManifestError, match=r"parts 0 and 1 both name shard-g\d+-u000001-000000.tar.*different inputs"):
        sw.merge(dest)


def test_parts_of_another_count_are_refused_by_name(tmp_path):
    dest = str(tmp_path / "ds")
    sw.pack(list(make_sequences(6, seed=1).items()), dest, part="0/2", progress=False)
    with pytest.raises(PackError, match=r"finished parts of a job in 2 parts \(index.part00000-of-00002.json\); "
                                        r"this part is 1/3"):
        sw.pack(list(make_sequences(6, seed=1).items()), dest, part="1/3", progress=False)


def test_index_commits_under_the_lock(tmp_path, tiny):
    src = Path(tiny[0])
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in src.glob("*.tar"):
        (copy / p.name).write_bytes(p.read_bytes())
    with packlock.PackLock(*_local(copy), str(copy)):
        with pytest.raises(PackError, match=f"{copy} is locked by another pack \\(pid {os.getpid()}"):
            sw.index_shards(str(copy), progress=False)
    assert sw.index_shards(str(copy), progress=False).num_sequences == sw.load_manifest(str(src)).num_sequences
    assert not (copy / packlock.LOCK_NAME).exists()


def _local(path: Path):
    import fsspec

    return fsspec.filesystem("file"), str(path)


# ---- item 2: a stale lock has exactly one successor; a loser says who holds it -------------------

@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_dead_packs_lock_is_taken_over_by_exactly_one_of_many(tmp_path, where, request):
    """Before: of packs taking a dead pack's lock over at once, two held it in 13 of 60 tries."""
    dest, options = _dest(where, tmp_path, request)
    rng = random.Random(2)
    for k in range(5 if where == "local" else 1):
        damaged, _, outcome = races.takeover(tmp_path, f"{dest}{k}", options, rng, contenders=8 if where == "local" else 4)
        assert not damaged, f"round {k}: {outcome}"


def test_two_packs_taking_over_a_dead_packs_lock_leave_one_whole_dataset(tmp_path):
    """Before: index.json once named shards the loser's clean-up had deleted; the loser failed with a raw
    FileNotFoundError when the winner's clean-up removed its temporary files. (On S3: benchmarks/races.py --s3.)"""
    damaged, _, outcome = races.stale_pack(tmp_path, str(tmp_path / "ds"), None, random.Random(3))
    assert not damaged, outcome


def test_a_slow_reader_of_a_dead_packs_lock_never_takes_it_from_the_pack_that_took_it_over(s3_server):
    """The takeover race at a chosen moment: pack B reads the dead pack's lock through a link that delivers it
    5 s late; meanwhile pack A takes it over. Before, B then removed A's lock and took it too: both held it."""
    import multiprocessing as mp

    from servers import FaultPlan
    from streamwin.storage.urls import url_to_fs

    dest = f"{s3_server.make_bucket()}/ds"
    fs, root = url_to_fs(dest, s3_server.storage_options())
    races.dead_lock(fs, root)
    slow = s3_server.fault_proxy(FaultPlan(stall_seconds=5.0, stall_times=1, path_contains=packlock.LOCK_NAME))
    ctx = mp.get_context("fork")
    go_b, go_a, queue = ctx.Event(), ctx.Event(), ctx.Queue()
    b = ctx.Process(target=races._contend, args=(dest, slow.storage_options(), go_b, queue, 6.5))
    a = ctx.Process(target=races._contend, args=(dest, s3_server.storage_options(), go_a, queue, 6.5))
    b.start()
    a.start()
    try:
        go_b.set()
        _wait_for(lambda: slow.stats.stalls >= 1)  # B's read of the lock is on its way, late
        go_a.set()
        got = [queue.get(timeout=120) for _ in range(2)]
    finally:
        go_a.set()
        for p in (a, b):
            p.join(timeout=60)
            p.kill()
    assert sorted(kind for kind, *_ in got) == ["lost", "won"], got  # (A, unless B got there first under load)
    winner, lost = (next(msg for kind, _, _, msg in got if kind == k) for k in ("won", "lost"))
    assert f"{dest} is locked by another pack ({winner} on {socket.gethostname()}" in lost, got


def _lock_doc(pid: int, **extra) -> bytes:
    return json.dumps({"host": socket.gethostname(), "pid": pid, "token": uuid.uuid4().hex, "what": "pack",
                       "gen": 0, "beat": time.time(), **extra}).encode()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_taker_that_died_midway_is_succeeded_and_its_claim_removed(tmp_path):
    dest = tmp_path / "ds"
    dest.mkdir()
    dead = json.loads(_lock_doc(_dead_pid()))
    (dest / packlock.LOCK_NAME).write_text(json.dumps(dead))
    (dest / f"{packlock.LOCK_NAME}.takeover-{dead['token']}").write_bytes(_lock_doc(_dead_pid()))  # died claiming
    seqs = make_sequences(6, seed=1)
    sw.pack(list(seqs.items()), str(dest), progress=False)
    assert races.same(races.read_all(str(dest)), seqs)
    assert not [n for n in os.listdir(dest) if "takeover" in n or n == packlock.LOCK_NAME]


def test_a_live_taker_is_named_to_the_pack_that_loses_to_it(tmp_path):
    dest = tmp_path / "ds"
    dest.mkdir()
    dead = json.loads(_lock_doc(_dead_pid()))
    (dest / packlock.LOCK_NAME).write_text(json.dumps(dead))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (dest / f"{packlock.LOCK_NAME}.takeover-{dead['token']}").write_bytes(_lock_doc(sleeper.pid))
        with pytest.raises(PackError, match=rf"cannot lock {dest}: its stale lock is being taken over by another pack "
                                            rf"\(pid {sleeper.pid} on {socket.gethostname()}"):
            sw.pack(list(make_sequences(6, seed=1).items()), str(dest), progress=False)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_lock_whose_pid_now_belongs_to_another_process_is_stale(tmp_path):
    dest = tmp_path / "ds"
    dest.mkdir()
    # this very process under the pid, but started at another time: the pack that wrote the lock is gone
    (dest / packlock.LOCK_NAME).write_bytes(_lock_doc(os.getppid(), start=1, beat=0))
    sw.pack(list(make_sequences(6, seed=1).items()), str(dest), progress=False)


# ---- item 3: workers die with the pack, whatever moment it is killed -----------------------------

@pytest.mark.parametrize("how", ["child", "parent", "outside"])
def test_pack_workers_die_with_a_pack_killed_as_they_start(tmp_path, how):
    """Before: a worker forked just before its pack was killed lived on (parent 1), for good."""
    damaged, orphans, outcome = races.orphans(tmp_path, str(tmp_path / "ds"), None, random.Random(4), how=how)
    assert orphans == 0 and not damaged, outcome


# ---- item 4: nothing that is not provably ours is deleted or taken over ------------------------

def test_a_foreign_index_json_is_refused_by_name_and_never_kept_as_ours(tmp_path):
    """Before: another tool's index.json was taken over, kept as index-g000000.json, and deleted by the next pack."""
    dest = tmp_path / "ds"
    dest.mkdir()
    theirs = json.dumps({"version": 2, "shards": [{"raw_data": {"basename": "shard.00000.mds"}}]}).encode()
    (dest / "index.json").write_bytes(theirs)
    seqs = make_sequences(6, seed=1)
    with pytest.raises(PackError, match=r"index.json \(not a streamwin index\).*--overwrite"):
        sw.pack(list(seqs.items()), str(dest), progress=False)
    assert sorted(os.listdir(dest)) == ["index.json"] and (dest / "index.json").read_bytes() == theirs
    sw.pack(list(seqs.items()), str(dest), progress=False, overwrite=True)  # asked: replaced, not kept
    assert not [n for n in os.listdir(dest) if n.startswith("index-g")]
    assert races.same(races.read_all(str(dest)), seqs)


def test_a_users_file_that_looks_temporary_is_refused_by_name_and_kept(tmp_path):
    """Before: notes.tmp-2024-05-01 matched the temporary-file pattern and was deleted without a word."""
    dest = tmp_path / "ds"
    seqs = make_sequences(6, seed=1)
    sw.pack(list(seqs.items()), str(dest), progress=False)
    for name in ("notes.tmp-2024-05-01", "index.json.tmp-deadbeef", "x.streamwin-tmp-" + "a" * 32):
        (dest / name).write_text("mine")
        with pytest.raises(PackError, match=f"1 file\\(s\\) that are not this dataset's: {name}.*--overwrite"):
            sw.pack(list(seqs.items()), str(dest), progress=False)
        assert (dest / name).read_text() == "mine"
        (dest / name).unlink()
    # a temporary file of ours, left by a killed pack, is ours to remove
    left = dest / f"shard-g000009-u000000-000000.tar{'.streamwin-tmp-' + uuid.uuid4().hex}"
    left.write_bytes(b"half a shard")
    sw.pack(list(seqs.items()), str(dest), progress=False)
    assert not left.exists()
