"""streamwin and its peers reading one corpus from loopback servers that answer after 0, 50 or 100 ms.

Issue 42, item 3: the peers on the same server, at the same latency, on the same data. Every
system reads issue 42's corpus (1,500 sequences of 500-20,000 steps x 8 float32, 507 MB in 32 MB
shards; ``--quick``: its first 150 sequences in 8 MB shards) over the network and cuts W=128,
stride 64 windows into batches of 256 out of a 20,000-window shuffle pool (seed 0):

  streamwin-http       WindowDataset(url) + WindowLoader(ds, num_workers): ranged GETs, no node cache
  streamwin-http-cold  the same with Read(cache_dir=...) an empty directory (whole shards fetched, read locally)
  streamwin-http-warm  the same with Read(cache_dir=...) filled by a previous epoch (untimed, before the rounds)
  webdataset-http      peers_systems.py's WebDataset pipeline on http:// URLs (a whole shard a GET)
  streamwin-s3         WindowDataset("s3://...", read=sw.Read(storage_options={endpoint})): ranged GETs
  mosaic-s3            MosaicML Streaming: StreamingDataset(remote="s3://...", local=<empty dir>), a sample a
                       sequence (peers_formats.py's mosaic-seqs copy), windows cut in a WindowPool
  litdata-s3           LitData: StreamingDataset("s3://...", cache_dir=<empty dir>, storage_options), an item a
                       sequence (litdata-seqs copy), windows cut in a WindowPool

HTTP systems read a RangeServer (remote_servers.py) over the corpus's directory; S3 systems read
moto (tests/servers.py) through a LatencyProxy. The server waits the latency before every answer.

Each case (system, latency, workers) runs in a fresh child process (children.run_child, peak
PSS of its tree sampled), 3 interleaved rounds, medians:
  windows/s      windows over the time from iter() to the epoch's end, or --seconds after the first
                 batch (the first batch's wait is inside; the JSON has the rate after it apart)
  first batch s  from constructing the dataset and loader to the first batch in hand
  peak PSS MB    of the child and its workers
  served         bytes the server (or proxy) sent during the case, over the corpus's shard bytes
Mosaic and LitData run in the first interpreter that has them (this one, then each --peer-python);
a system that none has is skipped with the line that installs it.

Usage:
  python benchmarks/remote_peers.py --quick --peer-python $PEERS_VENV/bin/python
  python benchmarks/remote_peers.py --data DIR/rc --work DIR/peers-remote \\
      --peer-python $PEERS_VENV/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from children import run_child  # noqa: E402
from remote_peers_systems import SYSTEMS, RemoteSystem  # noqa: E402

REPO = HERE.parent


def case_job(system: RemoteSystem, servers: Any, latency_ms: int, workers: int, work: Path,
             seconds: float | None) -> dict[str, Any]:
    """The child's job of one case: where the system's data is, its cache directory, its cap."""
    job = {"kind": "rate", "system": system.name, "workers": workers, "latency_ms": latency_ms, "seconds": seconds,
           **servers.where(system.store, latency_ms, system.converted or "corpus")}
    if system.cache == "warm":
        job["cache_dir"] = str(work / "cache" / f"warm-{latency_ms}ms")
    elif system.cache == "cold" or system.converted:
        job["cache_dir"] = str(work / "cache" / "cold")
    return job


def run_case(python: str, job: dict[str, Any], server: Any, timeout: float, *, empty_cache: bool) -> dict[str, Any]:
    """One case in a fresh ``python`` (its cache directory emptied first if ``empty_cache``):
    its record, peak PSS, and the bytes its server sent."""
    if empty_cache and job.get("cache_dir"):
        shutil.rmtree(job["cache_dir"], ignore_errors=True)
    server.reset()
    run = run_child([python, str(Path(__file__).resolve()), "--child", json.dumps(job)], timeout, cwd=str(REPO),
                    sample_memory=True)
    record = run.record or run.failed(2500)
    return {**{k: job[k] for k in ("kind", "system", "workers", "latency_ms")}, **record,
            "peak_pss_mb": run.peak_pss_mb, "served_mb": server.bytes_served / 1e6, "wall_s": run.wall_s,
            "other_cpu_cores": run.other_cpu_cores}


def measure(corpus: Path, work: Path, *, systems: Sequence[str] | None = None,
            latencies_ms: Sequence[int] = (0, 50, 100), workers: Sequence[int] = (0, 2), rounds: int = 3,
            seconds: float | None = 3.0, peer_pythons: Sequence[str] = (), timeout: float = 300.0,
            records: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Run every case (``rounds`` interleaved rounds) and return one row per (system, workers) with medians.

    ``corpus`` is a streamwin dataset directory (written if missing: see remote_peers_stores);
    ``work`` holds the peers' converted copies and the caches. Every record is appended to ``records``."""
    from peers import interpreters  # noqa: PLC0415
    from remote_peers_stores import Servers, ensure_copy  # noqa: PLC0415

    chosen = [s for s in SYSTEMS if systems is None or s.name in systems]
    where = interpreters(chosen, [sys.executable, *peer_pythons])
    records = [] if records is None else records
    for s in chosen:
        if where[s.name] is None:
            print(f"SKIP {s.name}: not installed here ({', '.join(s.modules)}); install with: {s.install}", flush=True)
            records.append({"kind": "skip", "system": s.name, "error": f"not installed: {s.install}"})
    chosen = [s for s in chosen if where[s.name]]
    copies = {s.converted: ensure_copy(s.converted, where[s.name], corpus, work, timeout)
              for s in chosen if s.converted}
    trees = {s.converted or "corpus": copies.get(s.converted, corpus) for s in chosen if s.store == "s3"}
    servers = Servers(corpus, list(latencies_ms), trees)
    try:
        for s in (s for s in chosen if s.cache == "warm"):
            for ms in latencies_ms:  # the previous epoch that fills the warm cache (the cache keys by URL)
                job = {**case_job(s, servers, ms, 0, work, None), "kind": "fill"}
                records.append(run_case(where[s.name], job, servers.server(s.store, ms), timeout, empty_cache=True))
                _fail_loudly(records[-1], "filling the warm cache")
        for r in range(rounds):
            for s in chosen:
                for ms in latencies_ms:
                    for w in workers:
                        job = case_job(s, servers, ms, w, work, seconds)
                        record = run_case(where[s.name], job, servers.server(s.store, ms), timeout,
                                          empty_cache=s.cache != "warm")
                        records.append({**record, "round": r})
                        print(json.dumps(records[-1]), flush=True)
    finally:
        servers.close()
        _clean_mosaic(where, chosen, timeout)
        shutil.rmtree(work / "cache", ignore_errors=True)
    return summarize([r for r in records if r.get("kind") == "rate"], chosen, list(latencies_ms), list(workers))


def _fail_loudly(record: dict[str, Any], what: str) -> None:
    if "error" in record:
        raise RuntimeError(f"{what} failed for {record['system']}: {record['error']}\n{record.get('stderr_tail', '')}")


def _clean_mosaic(where: dict[str, str | None], chosen: Sequence[RemoteSystem], timeout: float) -> None:
    """Remove the shared memory Mosaic's children left behind (they leave with os._exit)."""
    for s in chosen:
        if s.name == "mosaic-s3":
            job = {"kind": "clean", "system": s.name, "workers": 0, "latency_ms": 0}
            run_child([where[s.name], str(Path(__file__).resolve()), "--child", json.dumps(job)], timeout,
                      cwd=str(REPO))


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(records: list[dict[str, Any]], systems: Sequence[RemoteSystem], latencies_ms: list[int],
              workers: list[int]) -> list[dict[str, Any]]:
    """One row per (system, workers): per latency the medians over rounds, and each latency's rate / 0 ms's."""
    rows = []
    for s in systems:
        for w in workers:
            row: dict[str, Any] = {"system": s.name, "store": s.store, "setup": s.setup, "workers": w}
            for ms in latencies_ms:
                mine = [r for r in records if r["system"] == s.name and r["workers"] == w and r["latency_ms"] == ms]
                ok = [r for r in mine if "error" not in r]
                row[f"errors_{ms}ms"] = [f"{r['error']}: {r.get('stderr_tail', '')[-300:]}" for r in mine
                                         if "error" in r]
                for key in ("windows_per_s", "first_batch_s", "peak_pss_mb", "served_mb", "after_first_windows_per_s"):
                    row[f"{key}_{ms}ms"] = _median([r.get(key) for r in ok])
                row[f"full_epoch_{ms}ms"] = all(r.get("full_epoch") for r in ok) if ok else None
            base = row.get(f"windows_per_s_{latencies_ms[0]}ms")
            for ms in latencies_ms[1:]:
                rate = row.get(f"windows_per_s_{ms}ms")
                row[f"ratio_{ms}ms"] = rate / base if rate and base else None
            rows.append(row)
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "failed" if value is None else format(value, spec)


def markdown_table(rows: list[dict[str, Any]], latencies_ms: list[int], corpus_mb: float) -> str:
    """The table: windows/s per latency, the ratios to the first latency, first batch, peak PSS, served / corpus."""
    lat = " / ".join(f"{ms}" for ms in latencies_ms)
    head = (["system", "w"] + [f"windows/s {ms} ms" for ms in latencies_ms]
            + [f"{ms} / {latencies_ms[0]} ms" for ms in latencies_ms[1:]]
            + [f"first batch s ({lat} ms)", "peak PSS MB", f"served / corpus ({lat} ms)"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for row in rows:
        cells = [row["system"], str(row["workers"])]
        cells += [_fmt(row.get(f"windows_per_s_{ms}ms"), ",.0f") for ms in latencies_ms]
        cells += [_fmt(row.get(f"ratio_{ms}ms"), ".2f") + "x" for ms in latencies_ms[1:]]
        cells.append(" / ".join(_fmt(row.get(f"first_batch_s_{ms}ms"), ".2f") for ms in latencies_ms))
        cells.append(_fmt(max((row.get(f"peak_pss_mb_{ms}ms") or 0 for ms in latencies_ms), default=None), ",.0f"))
        cells.append(" / ".join(_fmt((row.get(f"served_mb_{ms}ms") or 0) / corpus_mb, ".2f") for ms in latencies_ms))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The CLI (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--quick", action="store_true",
                        help="the 150-sequence corpus, 0 and 100 ms, 1 round, 1 s cases")
    parser.add_argument("--data", type=Path,
                        help="the corpus (default bench_data/remote or remote-quick; written if missing)")
    parser.add_argument("--work", type=Path, default=REPO / "bench_data" / "peers-remote",
                        help="converted copies (reused) and caches (removed at the end)")
    parser.add_argument("--systems", nargs="+", choices=[s.name for s in SYSTEMS], help="default: all")
    parser.add_argument("--latencies", nargs="+", type=int,
                        help="ms before every answer (default 0 50 100; 0 100 with --quick)")
    parser.add_argument("--workers", nargs="+", type=int, default=[0, 2])
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3; 1 with --quick)")
    parser.add_argument("--seconds", type=float,
                        help="cap of a case after its first batch (default 3; 1 with --quick; 0: none)")
    parser.add_argument("--peer-python", nargs="*", default=[], help="interpreters with the peers this one lacks")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per child")
    parser.add_argument("--out", type=Path, help="JSON results (default bench_data/remote_peers[-quick].json)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.latencies = args.latencies or ([0, 100] if args.quick else [0, 50, 100])
    args.seconds = (1.0 if args.quick else 3.0) if args.seconds is None else args.seconds
    args.data = args.data or REPO / "bench_data" / ("remote-quick" if args.quick else "remote")
    args.out = args.out or REPO / "bench_data" / f"remote_peers{'-quick' if args.quick else ''}.json"
    return args


def child_main(job_json: str) -> None:
    """Child mode: run the job, print its record as the last stdout line, leave without tear-down."""
    from remote_peers_systems import run_job  # noqa: PLC0415

    print(json.dumps(run_job(json.loads(job_json))), flush=True)
    sys.stderr.flush()
    os._exit(0)  # loaders' threads and workers need no orderly shutdown here


def main(argv: list[str] | None = None) -> int:
    """Entry point: child mode with --child, else the whole run (table printed, JSON saved)."""
    args = parse_args(argv)
    if args.child:
        child_main(args.child)
        return 0
    import streamwin  # noqa: PLC0415 - the one on PYTHONPATH, which the children import too
    from peers import versions  # noqa: PLC0415
    from remote_peers_stores import ensure_corpus  # noqa: PLC0415

    started, load_before = time.perf_counter(), os.getloadavg()
    corpus = ensure_corpus(args.data, args.quick)
    corpus_mb = sum(p.stat().st_size for p in corpus.glob("*.tar")) / 1e6
    records: list[dict[str, Any]] = []
    rows = measure(corpus, args.work, systems=args.systems, latencies_ms=args.latencies, workers=args.workers,
                   rounds=args.rounds, seconds=args.seconds, peer_pythons=args.peer_python, timeout=args.timeout,
                   records=records)
    title = (f"{corpus.name}: {corpus_mb:,.0f} MB of shards; W=128 stride 64 batch 256 shuffle 20,000; "
             f"median of {args.rounds} rounds, cases capped {args.seconds:g} s after the first batch; "
             f"streamwin from {Path(streamwin.__file__).parent}")
    table = markdown_table(rows, args.latencies, corpus_mb)
    print(f"\n# remote_peers: {title}\n\n{table}")
    for row in rows:
        for ms in args.latencies:
            for error in row[f"errors_{ms}ms"]:
                print(f"ERROR {row['system']} w={row['workers']} {ms} ms: {error}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "title": title, "corpus": str(corpus), "streamwin": str(Path(streamwin.__file__).parent),
        "rows": rows, "records": records, "table": table,
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "wall_s": time.perf_counter() - started,
        "versions": versions([sys.executable, *args.peer_python])}, indent=1))
    print(f"wrote {args.out} in {time.perf_counter() - started:.0f} s")
    return 1 if any(r.get("error") for r in records if r.get("kind") == "rate") else 0


if __name__ == "__main__":
    sys.exit(main())
