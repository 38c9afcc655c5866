"""Races at a pack's destination, run many times: rounds, damage, orphans (issue 28, items 1-3).

Each scenario runs real pack processes against a real destination (a local folder, or the S3
server on loopback from tests/servers.py) and checks every round against a reference computed
here, not by the code under test:

  part_vs_pack   a live dataset; `pack` and `pack --part i/2` (both parts) start together, in a
                 random order and 0-300 ms apart. Damage: the dataset there fails `verify`, or is
                 neither the old one nor the complete new one (or, when the parts won and were
                 merged, their sequences).
  takeover       a lock left by a dead process; 6 processes race to take it over and hold it
                 100 ms. Damage: two held it at once.
  stale_pack     a live dataset and a dead pack's lock; two packs start together. Damage: the
                 dataset is not the old one or one pack's whole dataset, or the loser failed with
                 anything but a PackError naming the destination and the holder.
  orphans        `pack --workers 2` SIGKILLed as its workers start: by the first worker in the fork
                 itself (before any streamwin code runs in it), by the pack right after its first
                 fork, or from outside 0-400 ms after it starts. Orphans: its processes still alive
                 3 s after it died.

    python benchmarks/races.py --rounds 50                                  # every scenario, local disk
    python benchmarks/races.py --rounds 50 --where s3 --scenarios takeover stale_pack   # on the S3 server

Prints one line per scenario (rounds, damage, orphans, outcomes) and a JSON line at the end.
tests/test_pack_races.py runs each scenario for a couple of rounds.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# One pack process. Argument: a JSON dict. Imports streamwin, says "ready", waits for "go", packs.
# kill: "child" (the first worker kills the pack in the fork, before streamwin's own fork hook runs)
# or "parent" (the pack kills itself just after its first fork).
PACK = r"""
import json, os, signal, sys, time, pathlib
a = json.loads(sys.argv[1])
pack_pid = os.getpid()
if a.get("kill") == "child":
    def kill_parent():
        if os.getppid() == pack_pid:
            os.kill(pack_pid, signal.SIGKILL)
            deadline = time.monotonic() + 5
            while os.getppid() == pack_pid and time.monotonic() < deadline:
                time.sleep(0.001)
    os.register_at_fork(after_in_child=kill_parent)
elif a.get("kill") == "parent":
    os.register_at_fork(after_in_parent=lambda: os.kill(pack_pid, signal.SIGKILL))
import numpy as np
import streamwin as sw
progress = pathlib.Path(a["progress"])
progress.mkdir(parents=True, exist_ok=True)
def items(seed, n, pause):
    rng = np.random.default_rng(seed)
    for i in range(n):
        time.sleep(pause)
        yield f"s{seed}_{i:04d}", np.full((int(rng.integers(50, 400)), 2), seed * 1000 + i, np.float32)
(progress / "ready").touch()
while not (progress / "go").exists():
    time.sleep(0.002)
inputs = a["src"] if "src" in a else items(a["seed"], a["n"], a["pause"])
sw.pack(inputs, a["dest"], shard_bytes=a.get("shard_bytes", 8 << 10), progress=False, part=a.get("part"),
        workers=a.get("workers", 1), storage_options=a.get("options"))
print("committed")
"""

TAG = "STREAMWIN_RACE_TAG"


def expected(seed: int, n: int) -> dict[str, np.ndarray]:
    """What PACK's items(seed, n) yields, computed here."""
    rng = np.random.default_rng(seed)
    return {f"s{seed}_{i:04d}": np.full((int(rng.integers(50, 400)), 2), seed * 1000 + i, np.float32) for i in range(n)}


def read_all(url: str, options: dict | None = None) -> dict[str, np.ndarray] | None:
    """Every sequence at ``url`` (after `verify`), read through the manifest; None when it fails verification."""
    import fsspec

    import streamwin as sw
    from streamwin.errors import StreamwinError

    try:
        sw.verify(url, storage_options=options, progress=False)
        m = sw.load_manifest(url, storage_options=options)
    except StreamwinError:
        return None
    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    out = {}
    for i in range(m.num_sequences):
        shard = m.shards[m.shard_of(i)]
        data = fs.cat_file(f"{root}/{shard.name}", start=int(m.offset[i]) + int(m.hlen[i]),
                           end=int(m.offset[i]) + int(m.size[i]))
        out[m.key(i)] = np.frombuffer(data, dtype=m.dtype).reshape((-1, *m.step_shape))
    return out


def same(got: dict | None, want: dict, ordered: bool = True) -> bool:
    if got is None or (list(got) != list(want) if ordered else sorted(got) != sorted(want)):
        return False
    return all(np.array_equal(got[k], want[k]) for k in want)


class Proc:
    """A process running ``script`` (PACK by default), started and ready (streamwin imported), waiting for `go`."""

    def __init__(self, work: Path, args: dict, tag: str = "", script: str | None = None, what: str = "pack"):
        self.progress, self.what = work / f"p{uuid.uuid4().hex[:8]}", what
        env = dict(os.environ, PYTHONPATH=str(REPO), **({TAG: tag} if tag else {}))
        self.p = subprocess.Popen([sys.executable, "-c", script or PACK,
                                   json.dumps({**args, "progress": str(self.progress)})],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def ready(self, timeout: float = 120) -> "Proc":
        deadline = time.monotonic() + timeout
        while not (self.progress / "ready").exists():
            if self.p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.what} process did not start: {self.p.communicate()}")
            time.sleep(0.005)
        return self

    def go(self) -> None:
        (self.progress / "go").touch()

    def result(self, timeout: float = 300) -> tuple[int, str, str]:
        out, err = self.p.communicate(timeout=timeout)
        return self.p.returncode, out, err


def clean_failure(err: str, dest: str) -> bool:
    """A loser's stderr ends in one PackError that names the destination (and, for a lock, the holder)."""
    last = err.strip().splitlines()[-1] if err.strip() else ""
    return last.startswith("streamwin.errors.PackError") and dest.rstrip("/") in last


# ---- scenarios: each runs one round and returns (damaged, orphans, outcome) ----------------------

def part_vs_pack(work: Path, dest: str, options: dict | None, rng: random.Random) -> tuple[bool, int, str]:
    """Item 1: a pack and both parts of a part job, started together into a live dataset."""
    import streamwin as sw

    old = expected(7, 30)
    sw.pack(list(old.items()), dest, shard_bytes=8 << 10, progress=False, storage_options=options)
    base = dict(dest=dest, options=options, n=40)
    procs = {"pack": Proc(work, dict(base, seed=8, pause=0.01))}
    procs.update({f"part{i}": Proc(work, dict(base, seed=9, pause=0.005, part=f"{i}/2")) for i in range(2)})
    for p in procs.values():
        p.ready()
    order = list(procs)
    rng.shuffle(order)
    for name in order:
        procs[name].go()
        time.sleep(rng.uniform(0, 0.15))
    results = {name: p.result() for name, p in procs.items()}
    raw = [name for name, (code, _, err) in results.items() if code != 0 and not clean_failure(err, dest)]
    won = sorted(name for name, (code, _, _) in results.items() if code == 0)
    got = read_all(dest, options)
    damaged = not (same(got, old) or same(got, expected(8, 40))) or bool(raw)
    outcome = "+".join(won) or "none"
    if "part0" in won and "part1" in won:  # a whole part job: its merge commits the parts' sequences, or refuses
        from streamwin.errors import StreamwinError

        try:
            sw.merge(dest, storage_options=options)
            damaged |= not same(read_all(dest, options), expected(9, 40), ordered=False)
            outcome += ", merged"
        except StreamwinError:
            damaged |= not same(read_all(dest, options), got)
            outcome += ", merge refused"
    return damaged, 0, outcome + (f" raw:{raw}" if raw else "")


def dead_lock(fs, root: str, gen: int = 3) -> None:
    """A lock left by a pack that died on this machine (a pid that is no process now)."""
    import socket

    from streamwin.packing.lock import LOCK_NAME
    from streamwin.storage.urls import join, write_atomic

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    write_atomic(fs, join(root, LOCK_NAME), json.dumps({"host": socket.gethostname(), "pid": p.pid, "start": 1,
                                                        "token": uuid.uuid4().hex, "what": "pack", "gen": gen,
                                                        "beat": time.time()}).encode())


def takeover(work: Path, dest: str, options: dict | None, rng: random.Random, contenders: int = 6
             ) -> tuple[bool, int, str]:
    """Item 2: ``contenders`` processes take over one dead pack's lock at once; each winner holds it 100 ms."""
    import multiprocessing as mp

    from streamwin.packing.dest import prepare
    from streamwin.storage.urls import url_to_fs

    fs, root = url_to_fs(dest, options)
    prepare(fs, root)
    dead_lock(fs, root)
    ctx = mp.get_context("fork")
    start, queue = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_contend, args=(dest, options, start, queue)) for _ in range(contenders)]
    for p in procs:
        p.start()
    time.sleep(0.3)
    start.set()
    got = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    held = sorted((t0, t1) for kind, t0, t1, _ in got if kind == "won")
    overlap = any(b0 < a1 for (_, a1), (b0, _) in zip(held, held[1:]))
    raw = [msg for kind, _, _, msg in got if kind == "raw"]
    return overlap or bool(raw), 0, f"{len(held)} won" + (f" raw:{raw[:1]}" if raw else "")


def _contend(dest: str, options: dict | None, start, queue, hold: float = 0.1) -> None:
    from streamwin.errors import PackError
    from streamwin.packing.lock import PackLock
    from streamwin.storage.urls import url_to_fs

    fs, root = url_to_fs(dest, dict(options or {}, skip_instance_cache=True) if options else None)
    start.wait()
    try:
        lock = PackLock(fs, root, dest).acquire()
    except PackError as e:
        queue.put(("lost" if dest in str(e) and "pid" in str(e) else "raw", 0, 0, str(e)))
        return
    except Exception as e:  # noqa: BLE001 - reported as a raw error
        queue.put(("raw", 0, 0, repr(e)))
        return
    t0 = time.time()
    time.sleep(hold)
    try:
        lock.check()  # still ours
        held = True
    except PackError:
        held = False
    t1 = time.time()
    lock.release()
    queue.put(("won", t0, t1, f"pid {os.getpid()}") if held else ("raw", 0, 0, "lost its lock while holding it"))


def stale_pack(work: Path, dest: str, options: dict | None, rng: random.Random) -> tuple[bool, int, str]:
    """Item 2, whole packs: a live dataset, a dead pack's lock, two packs started together."""
    import streamwin as sw
    from streamwin.storage.urls import url_to_fs

    old = expected(7, 30)
    sw.pack(list(old.items()), dest, shard_bytes=8 << 10, progress=False, storage_options=options)
    fs, root = url_to_fs(dest, options)
    dead_lock(fs, root, gen=5)
    procs = [Proc(work, dict(dest=dest, options=options, seed=s, n=40, pause=0.005)).ready() for s in (8, 9)]
    for p in procs:
        p.go()
    results = [p.result() for p in procs]
    raw = [err.strip().splitlines()[-1] for code, _, err in results if code != 0 and not clean_failure(err, dest)]
    got = read_all(dest, options)
    ok = same(got, old) or same(got, expected(8, 40)) or same(got, expected(9, 40))
    won = [s for s, (code, _, _) in zip((8, 9), results) if code == 0]
    return (not ok) or bool(raw), 0, f"{len(won)} committed" + (f" raw:{raw[:1]}" if raw else "")


def orphans(work: Path, dest: str, options: dict | None, rng: random.Random, how: str | None = None
            ) -> tuple[bool, int, str]:
    """Item 3: `pack --workers 2` SIGKILLed as its workers start; its processes alive 3 s later are orphans."""
    src = work / "src"
    if not src.exists():
        src.mkdir()
        data = np.random.default_rng(0)
        for i in range(24):
            np.save(src / f"a{i:03d}.npy", data.normal(size=(20_000, 4)).astype(np.float32))
    how = how or rng.choice(["child", "parent", "outside"])
    tag = uuid.uuid4().hex
    args = dict(dest=dest, src=str(src), workers=2, shard_bytes=1 << 20, options=options)
    p = Proc(work, dict(args, kill=None if how == "outside" else how), tag=tag).ready()
    p.go()
    if how == "outside":
        time.sleep(rng.uniform(0, 0.4))
        p.p.send_signal(signal.SIGKILL)
    code = p.p.wait(timeout=300)  # (its pipes stay open while an orphan holds them)
    left = tagged(tag)
    deadline = time.monotonic() + 3
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = tagged(tag)
    for pid in left:  # leave nothing behind
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    p.result()
    damaged = os.path.exists(os.path.join(dest, "index.json")) and read_all(dest, options) is None
    return damaged, len(left), f"{how}:exit {code}"


def tagged(tag: str) -> list[int]:
    """Live (not zombie) processes whose environment holds TAG=tag: a pack and everything it started."""
    found = []
    needle = f"{TAG}={tag}".encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if needle not in f.read():
                    continue
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] not in (b"Z", b"X"):
            found.append(int(entry.name))
    return found


SCENARIOS = {"part_vs_pack": part_vs_pack, "takeover": takeover, "stale_pack": stale_pack, "orphans": orphans}
S3_SCENARIOS = ("takeover", "stale_pack", "part_vs_pack")


def run(name: str, rounds: int, s3=None, seed: int = 0) -> dict:
    """``rounds`` rounds of scenario ``name`` (on the S3 server ``s3`` when given); the tally."""
    rng = random.Random(seed)
    tally = {"scenario": name + (" (s3)" if s3 else ""), "rounds": 0, "damage": 0, "orphans": 0}
    outcomes: Counter = Counter()
    with tempfile.TemporaryDirectory(prefix="races-") as tmp:
        work = Path(tmp)
        for k in range(rounds):
            dest = f"{s3.make_bucket()}/ds" if s3 else str(work / f"ds{k}")
            damaged, orphaned, outcome = SCENARIOS[name](work, dest, s3.storage_options() if s3 else None, rng)
            tally["rounds"] += 1
            tally["damage"] += bool(damaged)
            tally["orphans"] += orphaned
            outcomes[outcome + (" DAMAGED" if damaged else "") + (f" {orphaned} ORPHANED" if orphaned else "")] += 1
    tally["outcomes"] = dict(outcomes)
    return tally


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--where", nargs="*", default=["local"], choices=["local", "s3"],
                    help="local disk, and/or the S3 server on loopback (moto; scenarios " + ", ".join(S3_SCENARIOS) + ")")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    results = []
    if "local" in args.where:
        for name in args.scenarios:
            results.append(run(name, args.rounds, seed=args.seed))
            print(_line(results[-1]), flush=True)
    if "s3" in args.where:
        sys.path.insert(0, str(REPO / "tests"))
        from servers import _aws_env, start_moto

        with _aws_env():
            s3 = start_moto()
            try:
                for name in (n for n in args.scenarios if n in S3_SCENARIOS):
                    results.append(run(name, args.rounds, s3=s3, seed=args.seed))
                    print(_line(results[-1]), flush=True)
            finally:
                s3.close()
    print(json.dumps(results))


def _line(t: dict) -> str:
    return (f"{t['scenario']:<20} rounds {t['rounds']:>3}  damage {t['damage']:>2}  orphans {t['orphans']:>2}  "
            f"outcomes {t['outcomes']}")


if __name__ == "__main__":
    main()
