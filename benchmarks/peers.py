"""Every peer side by side on the same corpus and windows, in one run (issue #23).

Systems (``--systems``): streamwin, webdataset, MosaicML Streaming and LitData in two set-ups each
(mosaic-windows / mosaic-seqs, litdata-windows / litdata-seqs: every window a sample, or every
sequence a sample with windows cut in a shuffle pool), Hugging Face datasets in two (hf-stream,
hf-arrow), torchdata-nodes (plain .npy files), and tutorial (everything in memory); a peer's name
(mosaic, litdata, hf) selects both its set-ups. peers_systems.py and peers_formats.py say how each
is set up; the table and the plot show each peer's faster set-up, named, and a second table the
other. A system whose package no interpreter here has (this one or a ``--peer-python``) is
skipped with the line that installs it.

Per system, each in a fresh child process, repeats interleaved (A, B, C, ..., then again; a
system's cases back to back after its files are read into the page cache):
  windows/s       at each --workers count, from iter() to the epoch's end or --seconds
  data-wait       1 - floor / step of gpu_feed.py's simulated step (4 ms holding the interpreter,
                  1 ms asleep) fed with 1 worker; floor = the same step fed preallocated batches,
                  measured just before it; median over repeats
  peak PSS        of the child and its workers (sampled every 0.1 s), at workers 0 and 2
  on disk         bytes of what the system reads (its converted copy, where it needs one)
  first batch     seconds from constructing the loader to the first batch, workers 0
  others' CPU     cores other processes used during the system's cases (median; a shared machine's load)
and once per system, on the check corpus (peers_child.py): exact resume, elastic resume 2 -> 3
ranks, equal steps on 2 ranks.

Usage:
  python benchmarks/peers.py --quick                     # small corpus, 1 repeat
  python benchmarks/peers.py --peer-python $PEERS_VENV/bin/python --plot docs/peers.png
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import data  # noqa: E402
import throughput  # noqa: E402
from children import run_child as run_in_child  # noqa: E402
from peers_child import all_systems  # noqa: E402
from peers_report import CHECK_NAMES, FEED_WORKERS, markdown_table, others, plot, shown, summarize  # noqa: E402
from peers_systems import Params, System, peer_of, tree_bytes  # noqa: E402

REPO = HERE.parent


# =========================================================================== child processes


def run_child(python: str, job: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one job in a fresh ``python``; its record plus the sampled peak memory of its tree."""
    cmd = [python, str(Path(__file__).resolve()), "--child", json.dumps(job)]
    run = run_in_child(cmd, timeout, cwd=str(REPO), sample_memory=True)
    base = {k: job[k] for k in ("kind", "system", "workers", "repeat", "pair") if k in job}
    record = run.record or run.failed(2500)
    return {**base, **record, "peak_pss_mb": run.peak_pss_mb, "wall_s": run.wall_s,
            "other_cpu_cores": run.other_cpu_cores}


def child_main(job_json: str) -> None:
    """Child mode: run the job, print its record as the last stdout line, leave without tear-down."""
    import peers_child  # noqa: PLC0415

    record = peers_child.run_job(json.loads(job_json))
    print(json.dumps(record), flush=True)
    sys.stderr.flush()
    os._exit(0)  # loaders' threads and workers need no orderly shutdown here


def interpreters(systems: Sequence[System], pythons: Sequence[str]) -> dict[str, str | None]:
    """For each system, the first interpreter that can import its modules, or None."""
    probe = ("import importlib.util as u, json, sys\n"
             "def has(m):\n    try:\n        return u.find_spec(m) is not None\n"
             "    except ImportError:\n        return False\n"
             "print(json.dumps({m: has(m) for m in sys.argv[1:]}))")
    modules = sorted({m for s in systems for m in s.modules})
    found: dict[str, dict[str, bool]] = {}
    for python in pythons:
        run = subprocess.run([python, "-c", probe, *modules], capture_output=True, text=True, cwd=str(HERE))
        found[python] = json.loads(run.stdout) if run.returncode == 0 else {}
    return {s.name: next((py for py in pythons if all(found[py].get(m) for m in s.modules)), None)
            for s in systems}


def versions(pythons: Sequence[str]) -> dict[str, dict[str, str | None]]:
    """The packages' versions in each interpreter (the peers may run in a venv of their own)."""
    names = ("torch", "torchdata", "numpy", "streamwin", "webdataset", "mosaicml-streaming", "litdata", "datasets")
    probe = ("import json, sys\nfrom importlib import metadata\n"
             "def v(n):\n    try:\n        return metadata.version(n)\n"
             "    except metadata.PackageNotFoundError:\n        return None\n"
             "print(json.dumps({n: v(n) for n in sys.argv[1:]}))")
    out = {}
    for python in pythons:
        run = subprocess.run([python, "-c", probe, *names], capture_output=True, text=True, cwd=str(HERE))
        out[python] = json.loads(run.stdout) if run.returncode == 0 else {}
    return out


# =========================================================================== preparing stores


def ensure_store(system: System, python: str, corpus: Path, store_root: Path, p: Params,
                 timeout: float) -> dict[str, Any]:
    """The system's converted copy of ``corpus`` (made once, reused while its marker matches)."""
    store = store_root / corpus.name / system.name
    marker = store.with_suffix(".json")
    wanted = {"corpus": json.loads((corpus / data.MARKER).read_text()), "params": asdict(p)}
    if marker.exists():
        saved = json.loads(marker.read_text())
        if saved.get("wanted") == wanted:
            return {**saved["result"], "store": str(store), "reused": True}
    if type(system).prepare is System.prepare:  # reads the corpus as it is: nothing to convert
        return {"prepare_s": 0.0, "disk_bytes": tree_bytes(system.disk(corpus, store)), "store": str(store)}
    _remove(store)
    store.parent.mkdir(parents=True, exist_ok=True)
    job = {"kind": "prepare", "system": system.name, "corpus": str(corpus), "store": str(store),
           "params": asdict(p)}
    print(f"[peers] converting {corpus.name} for {system.name} ...", file=sys.stderr, flush=True)
    result = run_child(python, job, timeout)
    if "error" not in result:
        marker.write_text(json.dumps({"wanted": wanted, "result": result}))
    return {**result, "store": str(store), "reused": False}


def _remove(path: Path) -> None:
    """Remove a store left by an interrupted conversion."""
    import shutil  # noqa: PLC0415

    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


# =========================================================================== the run


def plan(systems: Sequence[str], workers: Sequence[int], repeats: int) -> list[dict[str, Any]]:
    """Jobs in run order: per repeat, every system in turn: its rates, the floor, its feed.

    A system's cases run back to back so that its files, read into the page cache once before
    them (:func:`warm`), stay there: the converted copies together outgrow this machine's memory."""
    jobs = []
    for r in range(repeats):
        for s in systems:
            jobs += [{"kind": "rate", "system": s, "workers": w, "repeat": r} for w in workers]
            jobs.append({"kind": "feed", "system": "floor", "workers": 0, "repeat": r, "pair": s})
            jobs.append({"kind": "feed", "system": s, "workers": FEED_WORKERS, "repeat": r})
    return jobs


def warm(system: System, corpus: Path, store: Path) -> float:
    """Read the files the system reads once (into the page cache, as perf-notes measured); seconds."""
    files = [str(f) for path in system.disk(corpus, store)
             for f in ([path] if path.is_file() else sorted(path.rglob("*"))) if Path(f).is_file()]
    started = time.perf_counter()
    throughput.baselines_module().read_limit(files, min_seconds=0.0)
    return time.perf_counter() - started


# =========================================================================== CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The CLI (see the module docstring)."""
    names = [s.name for s in all_systems()]
    names += sorted({peer_of(s) for s in all_systems()} - set(names))  # a peer: all its set-ups
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--quick", action="store_true", help="the --quick corpus, 1 repeat, short cases")
    parser.add_argument("--data", type=Path, help="corpus for the rates (default bench_data/full or quick)")
    parser.add_argument("--check-data", type=Path, help="corpus of the checks (default bench_data/quick)")
    parser.add_argument("--systems", nargs="+", default=names, choices=names,
                        help="set-ups (mosaic-windows) or peers (mosaic: both its set-ups); default all")
    parser.add_argument("--workers", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--repeats", type=int, help="interleaved rounds (default 3; 1 with --quick)")
    parser.add_argument("--seconds", type=float, help="cap of one rate case (default 10; 3 with --quick)")
    parser.add_argument("--steps", type=int, help="timed simulated steps (default 300; 40 with --quick)")
    parser.add_argument("--warmup", type=int, help="steps before timing (default 30; 5 with --quick)")
    parser.add_argument("--no-checks", action="store_true", help="skip the three checks")
    parser.add_argument("--peer-python", nargs="*", default=[],
                        help="other interpreters to run peers this one lacks (e.g. a venv with them)")
    parser.add_argument("--store", type=Path, default=REPO / "bench_data" / "peers",
                        help="where converted copies of the corpus go (reused)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per child")
    parser.add_argument("--out", type=Path, help="JSON results (default bench_data/peers[-quick].json)")
    parser.add_argument("--plot", type=Path, help="PNG (default: --out with .png)")
    parser.add_argument("--replot", type=Path, help="print the table and draw the plot of a saved JSON, run nothing")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    args.repeats = args.repeats or (1 if quick else 3)
    args.seconds = args.seconds or (3.0 if quick else 10.0)
    args.steps = args.steps or (40 if quick else 300)
    args.warmup = args.warmup or (5 if quick else 30)
    return args


def corpora(args: argparse.Namespace) -> tuple[Path, Path]:
    """The rate corpus and the check corpus, written if missing."""
    quick = data.CorpusSpec.quick()
    check = args.check_data or data.default_dir(quick)
    if args.check_data is None or not (Path(args.check_data) / data.MARKER).exists():
        data.write_corpus(check, quick)
    main = args.data or data.default_dir(quick if args.quick else data.CorpusSpec())
    if args.data is None or not (Path(args.data) / data.MARKER).exists():
        data.write_corpus(main, quick if args.quick else data.CorpusSpec())
    return Path(main).resolve(), Path(check).resolve()


def header(corpus: Path, p: Params, args: argparse.Namespace) -> str:
    """One line naming the corpus and the setup."""
    spec = data.CorpusSpec(**json.loads((corpus / data.MARKER).read_text())["spec"])
    lengths = data.sequence_lengths(spec.n_seqs, spec.min_len, spec.max_len, spec.seed)
    return (f"{spec.n_seqs:,} sequences, {data.corpus_bytes(spec) / 1e9:.2f} GB, F={spec.features} {spec.dtype}; "
            f"W={p.window} stride={p.stride} batch={p.batch_size} shuffle={p.shuffle_buffer}; "
            f"{data.count_windows(lengths, p.window, p.stride):,} windows/epoch; median of {args.repeats}, "
            f"cases capped at {args.seconds:g} s")


def parent_main(args: argparse.Namespace) -> int:
    """Convert, run every case and the checks in children, print the table, save JSON and the plot."""
    started = time.perf_counter()
    p = Params(batch_size=args.batch_size)
    corpus, check_corpus = corpora(args)
    chosen = [s for s in all_systems() if s.name in args.systems or peer_of(s) in args.systems]
    where = interpreters(chosen, [sys.executable, *args.peer_python])
    systems = [s for s in chosen if where[s.name]]
    for s in chosen:
        if not where[s.name]:
            print(f"SKIP {s.name}: not installed here ({', '.join(s.modules)}); install with: {s.install}", flush=True)
    title = header(corpus, p, args)
    print(f"# peers: {title}", flush=True)
    stores, check_stores, records = {}, {}, []
    for s in list(systems):
        stores[s.name] = ensure_store(s, where[s.name], corpus, args.store, p, args.timeout)
        check_stores[s.name] = ensure_store(s, where[s.name], check_corpus, args.store, p, args.timeout)
        for rec in (stores[s.name], check_stores[s.name]):
            if "error" in rec:
                print(f"ERROR converting for {s.name}: {rec['error']}\n{rec['stderr_tail']}", flush=True)
                systems.remove(s)
                records.append({"kind": "prepare", "system": s.name, "workers": None, **rec})
                break
    names = [s.name for s in systems]
    common = {"params": asdict(p), "seconds": args.seconds, "steps": args.steps, "warmup": args.warmup,
              "corpus": str(corpus), "check_corpus": str(check_corpus)}
    os.sync()  # the conversions' writes reach the disk now, not during a timed case
    by_name, warmed = {s.name: s for s in systems}, None
    for job in plan(names, args.workers, args.repeats):
        py = where.get(job["system"]) or sys.executable
        store = stores.get(job["system"], {}).get("store", "")
        if job["system"] in by_name and (job["system"], job["repeat"]) != warmed:
            warmed = (job["system"], job["repeat"])
            seconds = warm(by_name[job["system"]], corpus, Path(store))
            print(f"[peers] {job['system']}: files read into the page cache in {seconds:.1f} s",
                  file=sys.stderr, flush=True)
        records.append(run_child(py, {**common, **job, "store": store}, args.timeout))
        print(json.dumps(records[-1]), flush=True)
    checks: dict[str, dict[str, Any]] = {}
    for s in ([] if args.no_checks else systems):
        job = {**common, "kind": "checks", "system": s.name, "workers": 0, "repeat": 0,
               "store": stores[s.name]["store"], "check_store": check_stores[s.name]["store"]}
        rec = run_child(where[s.name], job, args.timeout)
        records.append(rec)
        checks[s.name] = rec if "error" not in rec else {k: f"error: {rec['error']}" for k in CHECK_NAMES}
        print(json.dumps(rec), flush=True)
    rows = summarize(records, systems, args.workers, stores, checks)
    report(args, rows, records, title, corpus, check_corpus, time.perf_counter() - started)
    return 1 if any(row["errors"] for row in rows) or any("error" in r for r in records) else 0


def report(args: argparse.Namespace, rows: list[dict[str, Any]], records: list[dict[str, Any]], title: str,
           corpus: Path, check_corpus: Path, elapsed: float) -> None:
    """Print the table and the checks' details; write the JSON and the plot."""
    print()
    print(markdown_table(shown(rows), args.workers))
    if others(rows):
        print("\nThe other set-up of each peer that has two (slower by the geometric mean of windows/s):\n")
        print(markdown_table(others(rows), args.workers))
    print()
    for row in rows:
        for k in CHECK_NAMES:
            print(f"{row['system']} {k}: {row[k]}")
    busy = throughput.busy_warning(records)
    if busy:
        print(busy)
    for rec in records:
        if "error" in rec:
            print(f"\n{rec['system']} {rec['kind']} workers={rec.get('workers')} failed ({rec['error']}):\n"
                  f"{rec.get('stderr_tail', '')}")
    print(f"\ntook {elapsed / 60:.1f} min; checks on {check_corpus.name}")
    out = args.out or REPO / "bench_data" / ("peers-quick.json" if args.quick else "peers.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"title": title, "corpus": str(corpus), "check_corpus": str(check_corpus),
                               "environment": throughput.environment(),
                               "versions": versions([sys.executable, *args.peer_python]), "summary": rows, "runs": records,
                               "elapsed_s": elapsed}, indent=1))
    path = args.plot or out.with_suffix(".png")
    plot(shown(rows), args.workers, path, f"streamwin and its peers: {title}")
    print(f"wrote {out} and {path}")


def main(argv: list[str] | None = None) -> int:
    """Entry point: child mode with --child, else the whole run."""
    args = parse_args(argv)
    if args.child:
        child_main(args.child)
        return 0
    if args.replot:
        return replot(args)
    return parent_main(args)


def replot(args: argparse.Namespace) -> int:
    """The table and the plot of a saved run (--replot JSON), without running anything."""
    saved = json.loads(args.replot.read_text())
    rows = saved["summary"]
    workers = sorted(int(k.rsplit("_w", 1)[1]) for k in rows[0] if k.startswith("windows_per_s_w"))
    print(markdown_table(shown(rows), workers))
    if others(rows):
        print("\nThe other set-ups:\n\n" + markdown_table(others(rows), workers))
    path = args.plot or args.replot.with_suffix(".png")
    plot(shown(rows), workers, path, f"streamwin and its peers: {saved['title']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
