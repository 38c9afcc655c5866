"""Appends raced against a reader mid-epoch and against another append, run many times (issue 44, item 5).

Each round packs a small dataset at a real destination (a local folder, or the S3 server on
loopback from tests/servers.py) and checks it against data computed here, not by the code under
test:

  reader   a WindowLoader (2 forkserver worker processes) reads an epoch while an append process (new
           sequences, and new steps of old ones: mode="extend") commits at a random moment of it.
           Damage: the epoch differs from the one the dataset yields without the append (the
           reader keeps the generation it loaded), its next epoch does too (its workers, started
           anew, plan on the view the loader loaded), or the dataset after the round is not the
           old one grown by the append, read back member by member.
  appends  two append processes (other new keys, other old keys extended) start 0-300 ms apart.
           The pack lock lets one in at a time: each commits whole, or fails with a PackError
           naming the destination. Damage: the dataset is not the old one grown by exactly the
           appends that reported success, or fails verify.

    python benchmarks/grow_races.py --rounds 50                    # both scenarios, local disk
    python benchmarks/grow_races.py --rounds 50 --where s3         # on the S3 server (moto)

Prints one line per scenario (rounds, damage, outcomes) and a JSON line at the end;
tests/test_grow_races.py runs each for a couple of rounds.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import races  # noqa: E402
from benchmarks.races import clean_failure  # noqa: E402

# One append process: waits for "go", then appends additions(seed) (new sequences and extensions) with mode="extend",
# ``pause`` seconds before each.
APPEND = r"""
import json, pathlib, sys, time
a = json.loads(sys.argv[1])
sys.path.insert(0, a["repo"])
import streamwin as sw
from benchmarks.grow_races import additions
progress = pathlib.Path(a["progress"])
progress.mkdir(parents=True, exist_ok=True)
(progress / "ready").touch()
while not (progress / "go").exists():
    time.sleep(0.002)
def slowly(items, pause):
    for item in items:
        time.sleep(pause)
        yield item
sw.pack(slowly(additions(a["seed"]).items(), a.get("pause", 0)), a["dest"], shard_bytes=4 << 10, progress=False,
        mode="extend", storage_options=a.get("options"))
print("committed")
"""
LOADER = dict(window=8, stride=4, batch_size=8, shuffle_buffer=32, seed=1)


class Proc(races.Proc):
    """An APPEND process, started and ready (streamwin imported), waiting for `go`."""

    def __init__(self, work: Path, args: dict):
        super().__init__(work, args, script=APPEND, what="append")


def old(n: int = 24) -> dict[str, np.ndarray]:
    """The dataset each round starts from: values (sequence * 1000 + step)."""
    rng = np.random.default_rng(0)
    return {f"o{i:03d}": (np.arange(int(rng.integers(20, 90)))[:, None] * 1000 + i + np.zeros((1, 2))).astype(np.float32)
            for i in range(n)}


def additions(seed: int) -> dict[str, np.ndarray]:
    """What append ``seed`` (1 or 2) adds: three new sequences, and the next steps of four old ones of its own."""
    rng = np.random.default_rng(seed)
    new = {f"n{seed}_{i}": np.full((int(rng.integers(10, 60)), 2), seed * 100 + i, np.float32) for i in range(3)}
    more = {f"o{j:03d}": np.full((int(rng.integers(5, 30)), 2), -seed * 100 - j, np.float32)
            for j in range(4 * seed - 4, 4 * seed)}
    return {**new, **more}


def grown(base: dict, *appends: int) -> dict[str, np.ndarray]:
    """``base`` grown by the appends, in order: new keys added, old ones extended."""
    out = dict(base)
    for seed in appends:
        for k, a in additions(seed).items():
            out[k] = np.concatenate([out[k], a]) if k in out else a
    return out


def read_back(url: str, options: dict | None) -> dict[str, np.ndarray] | None:
    """Every sequence at ``url``, its members read one after the other (after verify); None when verify fails."""
    import fsspec

    import streamwin as sw
    from streamwin.errors import StreamwinError

    try:
        sw.verify(url, storage_options=options, progress=False)
        m = sw.load_manifest(url, storage_options=options)
    except StreamwinError:
        return None
    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    members = m.members()
    chains = {i: [i] for i in range(m.num_sequences)}
    if m.segments is not None:
        for j, i in enumerate(m.segments.seq.tolist()):
            chains[i].append(m.num_sequences + j)
    out = {}
    for i, rows in chains.items():
        parts = []
        for r in rows:
            shard = members.shards[members.shard_of(r)]
            a, n, h = int(members.offset[r]), int(members.size[r]), int(members.hlen[r])
            parts.append(np.frombuffer(fs.cat_file(f"{root}/{shard.name}", start=a + h, end=a + n), dtype=m.dtype))
        out[m.key(i)] = np.concatenate(parts).reshape((-1, *m.step_shape))
    return out


def same(got: dict | None, want: dict) -> bool:
    return got is not None and sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)


def epoch(loader, number: int) -> list[tuple]:
    loader.set_epoch(number)
    return [(list(b["key"]), b["start"].tolist(), b["x"].numpy().tobytes()) for b in loader]


def reader(work: Path, dest: str, options: dict | None, rng: random.Random) -> tuple[bool, str]:
    """An epoch read by a loader with 2 workers while an append commits."""
    import streamwin as sw

    base = old()
    sw.pack(list(base.items()), dest, shard_bytes=4 << 10, progress=False, storage_options=options)
    read = sw.Read(storage_options=options)
    want = [epoch(sw.WindowLoader(sw.WindowDataset(dest, read=read, **LOADER)), e) for e in (0, 1)]
    # forkserver: each pass's workers load index.json themselves (forked ones inherit the trainer's manifest)
    loader = sw.WindowLoader(sw.WindowDataset(dest, read=read, **LOADER), num_workers=2,
                             multiprocessing_context="forkserver")
    append = Proc(work, dict(repo=str(REPO), dest=dest, options=options, seed=1)).ready()
    n = len(want[0])
    at = rng.randrange(1, n // 2)
    got, done = [], None
    try:
        loader.set_epoch(0)
        for k, b in enumerate(loader):
            got.append((list(b["key"]), b["start"].tolist(), b["x"].numpy().tobytes()))
            if k + 1 == at:
                append.go()
            if k + 1 >= at and done is None:
                time.sleep(0.02)  # the append lands somewhere in the rest of the epoch ...
                if append.p.poll() is not None or k + 1 == n - 2:
                    append.p.wait(timeout=300)  # ... at the latest two batches before its end
                    done = k + 1
        code, out, err = append.result()
        again = epoch(loader, 1)
    finally:
        loader.close()
    damaged = got != want[0] or again != want[1] or code != 0 or not same(read_back(dest, options), grown(base, 1))
    return damaged, "committed mid-epoch" if done is not None and done < len(got) else "committed at the end"


def appends(work: Path, dest: str, options: dict | None, rng: random.Random) -> tuple[bool, str]:
    """Two appends started 0-300 ms apart into one dataset."""
    import streamwin as sw

    base = old()
    sw.pack(list(base.items()), dest, shard_bytes=4 << 10, progress=False, storage_options=options)
    procs = {seed: Proc(work, dict(repo=str(REPO), dest=dest, options=options, seed=seed)).ready()
             for seed in (1, 2)}
    first = rng.choice([1, 2])
    procs[first].go()
    time.sleep(rng.uniform(0, 0.3))
    procs[3 - first].go()
    results = {seed: p.result() for seed, p in procs.items()}
    won = [s for s, (code, out, _) in results.items() if code == 0 and "committed" in out]
    clean = all(code == 0 or clean_failure(err, dest) for code, _, err in results.values())
    damaged = not clean or not same(read_back(dest, options), grown(base, *won))  # (their keys differ: any order)
    return damaged, f"{len(won)} committed" + ("" if clean else " UNCLEAN")


SCENARIOS = {"reader": reader, "appends": appends}


def run(name: str, rounds: int, s3=None, seed: int = 0) -> dict:
    """``rounds`` rounds of scenario ``name`` (on the S3 server ``s3`` when given); the tally."""
    rng = random.Random(seed)
    outcomes: Counter = Counter()
    damage = 0
    with tempfile.TemporaryDirectory(prefix="grow-races-") as tmp:
        for k in range(rounds):
            dest = f"{s3.make_bucket()}/ds" if s3 else str(Path(tmp) / f"ds{k}")
            damaged, outcome = SCENARIOS[name](Path(tmp), dest, s3.storage_options() if s3 else None, rng)
            damage += bool(damaged)
            outcomes[outcome + (" DAMAGED" if damaged else "")] += 1
    return {"scenario": name + (" (s3)" if s3 else ""), "rounds": rounds, "damage": damage,
            "outcomes": dict(outcomes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--where", nargs="*", default=["local"], choices=["local", "s3"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    results = []
    for where in args.where:
        s3 = None
        if where == "s3":
            sys.path.insert(0, str(REPO / "tests"))
            from servers import _aws_env, start_moto

            env = _aws_env()
            env.__enter__()
            s3 = start_moto()
        try:
            for name in args.scenarios:
                results.append(run(name, args.rounds, s3=s3, seed=args.seed))
                t = results[-1]
                print(f"{t['scenario']:<14} rounds {t['rounds']:>3}  damage {t['damage']:>2}  outcomes {t['outcomes']}",
                      flush=True)
        finally:
            if s3 is not None:
                s3.close()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
