"""Reading from object storage at real latency, beside local disk, in one run: issue 42's targets.

The same epochs of one corpus (remote_peers_stores: 1,500 sequences of 500-20,000 steps x 8
float32, ~500 MB in 32 MB shards; windows of 128, stride 64, batches of 256, shuffle_buffer
20,000) read by streamwin from each source, at 0, 1 and 2 workers, each case in a fresh child,
rounds interleaved (medians):

  local            the shard files
  local-unchecked  the same with the tar-header checks of the manifest switched off: their cost
  nginx            the OS package's nginx on loopback (sendfile, keep-alive): skipped, said how
                   to install it, where it is missing
  nginx-100        the same, capped at 100 MB/s a connection (limit_rate), as object stores cap
  rs-0/50/100      a range server of its own process waiting 0, 50 or 100 ms before every answer
  s3-0/50/100      the S3 server the tests use (moto) behind a proxy adding the same latency

and the ceiling of the loopback: 8 curls pulling every shard's 4 MiB ranges from nginx (and
from nginx-100). Each case reads ``--epochs`` whole epochs: windows/s from the first batch on,
the first batch's seconds from building the dataset (its manifest read), and the bytes the server sent over those
the epochs' windows need (the steps they cover and their members' headers). The targets are
printed as verdicts; the table and one JSON line follow.

Usage:
  python benchmarks/remote.py --quick                     # 150 sequences, 1 round, ~2 min
  python benchmarks/remote.py                             # the whole corpus, 3 rounds
  python benchmarks/remote.py --sources local rs-0 rs-50 --workers 0 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _path in (HERE, REPO / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from children import run_child  # noqa: E402
from remote_clients import CurlClient, ranges_of  # noqa: E402
from remote_peers_stores import Servers, ensure_corpus  # noqa: E402
from remote_peers_systems import s3fs_options  # noqa: E402
from remote_servers import NGINX_HINT, Nginx, nginx_binary  # noqa: E402

SOURCES = ["local", "local-unchecked", "nginx", "nginx-100", "rs-0", "rs-50", "rs-100", "s3-0", "s3-50", "s3-100"]
LATENCIES = [0, 50, 100]
WINDOW, STRIDE, BATCH, POOL = 128, 64, 256, 20_000
CAP = 100 << 20  # nginx-100: bytes/s a connection
CURLS, CURL_PART = 8, 4 << 20


def needed_bytes(corpus: Path) -> tuple[int, int]:
    """(windows of an epoch, bytes they need: the steps they cover and their members' tar and npy headers)."""
    import streamwin as sw  # noqa: PLC0415

    m = sw.load_manifest(str(corpus))
    n = (m.length - WINDOW) // STRIDE + 1
    has = m.length >= WINDOW
    covered = (n - 1) * STRIDE + WINDOW
    return int(n[has].sum()), int(((covered * m.step_bytes + m.hlen + 512) * has).sum())


# -- a case, in its own process ----------------------------------------------------------------

def child(job: dict[str, Any]) -> None:
    """Read ``job["epochs"]`` epochs of ``job["url"]`` with ``job["workers"]`` workers; print one JSON line."""
    import streamwin as sw  # noqa: PLC0415
    from streamwin.loader import WindowLoader  # noqa: PLC0415, F401  (torch imported: not part of the first batch)

    if job.get("unchecked"):  # what checking the members' tar headers costs: not checked at all
        from streamwin.read.members import Members  # noqa: PLC0415

        Members.check_members = lambda self, buf, at, seqs, shards: []
        Members.unchecked = lambda self, seq, s_lo: seq[:0]
    read = sw.Read(storage_options=s3fs_options(job["endpoint"]) if job.get("endpoint") else None)
    started = time.perf_counter()
    ds = sw.WindowDataset(job["url"], window=WINDOW, stride=STRIDE, batch_size=BATCH, shuffle_buffer=POOL, seed=0,
                          read=read)
    loader = sw.WindowLoader(ds, num_workers=job["workers"])
    first = windows = 0
    for epoch in range(job["epochs"]):
        loader.set_epoch(epoch)
        for batch in loader:
            if not first:
                first = time.perf_counter()
            else:
                windows += int(batch["x"].shape[0])
    end = time.perf_counter()
    stats = loader.stats()
    print(json.dumps({"windows_per_s": windows / (end - first), "first_batch_s": first - started,
                      "bytes_read": stats["bytes_read"], "throttled": stats["throttled"]}))


# -- the run -----------------------------------------------------------------------------------

class Sources:
    """Where each source's data is served from, for the whole run (None: not available here)."""

    def __init__(self, corpus: Path, sources: list[str]):
        self.corpus, self.nginx = corpus, {}
        if any(s.startswith("nginx") for s in sources):
            if nginx_binary() is None:
                print(f"[remote] {NGINX_HINT}", file=sys.stderr)
            else:
                self.nginx = {"nginx": Nginx(corpus.parent), "nginx-100": Nginx(corpus.parent, CAP)}
        latencies = sorted({int(s.split("-")[1]) for s in sources if s[:3] in ("rs-", "s3-")})
        s3 = any(s.startswith("s3-") for s in sources)
        self.servers = Servers(corpus, latencies, {"corpus": corpus} if s3 else {})

    def job(self, source: str) -> tuple[dict[str, Any], Any] | None:
        """(the child's job fields naming the data, the server to count bytes on) of ``source``."""
        if source.startswith("local"):
            return {"url": str(self.corpus), "unchecked": source == "local-unchecked"}, None
        if source.startswith("nginx"):
            srv = self.nginx.get(source)
            return None if srv is None else ({"url": f"{srv.url}/{self.corpus.name}"}, srv)
        store, ms = source.split("-")
        where = self.servers.where("http" if store == "rs" else "s3", int(ms), "corpus")
        return {k: where[k] for k in ("url", "endpoint") if k in where}, self.servers.server(
            "http" if store == "rs" else "s3", int(ms))

    def close(self) -> None:
        for srv in self.nginx.values():
            srv.close()
        self.servers.close()


def curl_ceiling(url: str, corpus: Path) -> float:
    """MB/s that CURLS curls pull from ``url`` (remote_clients.CurlClient: every shard's 4 MiB ranges, each curl
    taking every CURLS-th over one connection): the loopback's ceiling."""
    ranges = ranges_of(corpus, CURL_PART)
    total = sum(b - a for _, a, b in ranges)
    started = time.perf_counter()
    CurlClient(f"{url}/{corpus.name}").read(ranges, [total], None, CURLS)
    return total / (time.perf_counter() - started) / 1e6


def measure(corpus: Path, sources: list[str], workers: list[int], rounds: int, epochs: int,
            timeout: float) -> dict[str, Any]:
    """Every (source, workers) case ``rounds`` times, interleaved; the records and the curl ceilings."""
    where = Sources(corpus, sources)
    records: dict[str, list[dict[str, Any]]] = {}
    ceilings = {}
    try:
        for name, srv in where.nginx.items():
            ceilings[name] = curl_ceiling(srv.url, corpus)
        for r in range(rounds):
            for source in sources:
                job = where.job(source)
                if job is None:
                    continue
                fields, srv = job
                for w in workers:
                    if srv is not None:
                        srv.reset()
                    spec = {**fields, "workers": w, "epochs": epochs}
                    run = run_child([sys.executable, __file__, "--case", json.dumps(spec)], timeout, cwd=str(REPO),
                                    env={**os.environ, "PYTHONPATH": str(REPO)})
                    rec = run.record or {"error": run.failed()}
                    rec["served"] = srv.bytes_served if srv is not None else None
                    records.setdefault(f"{source}:{w}", []).append(rec)
                    print(f"[remote] round {r + 1}/{rounds} {source} w={w}: "
                          f"{rec.get('windows_per_s', float('nan')):,.0f} windows/s", file=sys.stderr, flush=True)
    finally:
        where.close()
    return {"records": records, "curl_mb_s": ceilings}


def summarize(raw: dict[str, Any], corpus: Path, epochs: int) -> list[dict[str, Any]]:
    """One row per case: medians, and the ratio each target compares."""
    windows, needed = needed_bytes(corpus)
    rows = []
    for case, recs in raw["records"].items():
        ok = [r for r in recs if "windows_per_s" in r]
        source, w = case.split(":")
        row = {"source": source, "workers": int(w), "runs": len(ok), "errors": len(recs) - len(ok)}
        if ok:
            row["windows_per_s"] = statistics.median(r["windows_per_s"] for r in ok)
            row["first_batch_s"] = statistics.median(r["first_batch_s"] for r in ok)
            served = [r["served"] for r in ok if r["served"] is not None]
            row["served_over_needed"] = statistics.median(served) / (needed * epochs) if served else None
            row["throttled"] = max(r["throttled"] for r in ok)
        rows.append(row)
    by = {(r["source"], r["workers"]): r.get("windows_per_s") for r in rows}
    for row in rows:
        base = {"nginx": "local", "nginx-100": "local", "local-unchecked": "local", "rs-50": "rs-0", "rs-100": "rs-0",
                "s3-50": "s3-0", "s3-100": "s3-0"}.get(row["source"])
        ref = by.get((base, row["workers"])) if base else None
        row["ratio"] = row["windows_per_s"] / ref if ref and row.get("windows_per_s") else None
        ceiling = raw["curl_mb_s"].get(row["source"])
        if ceiling:  # the curls' MB/s as windows/s of this corpus
            row["ceiling_ratio"] = row.get("windows_per_s", 0) / (ceiling * 1e6 * windows / needed)
    return rows


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """Each target of issue 42, met or not, per case."""
    out = []
    for r in rows:
        s, w, ratio = r["source"], r["workers"], r.get("ratio")
        want = {"rs-50": 0.9, "rs-100": 0.8, "s3-50": 0.9, "s3-100": 0.8}.get(s)
        if want is not None and ratio is not None:
            base = "rs-0" if s.startswith("rs") else "s3-0"
            out.append(f"{s} / {base}, workers {w}: {ratio:.2f} (target >= {want}: {'met' if ratio >= want else 'not met'})")
        if s.startswith("nginx") and ratio is not None:
            best = max(ratio, r.get("ceiling_ratio") or 0)  # local disk or the curls, whichever is lower to reach
            out.append(f"{s} / local, workers {w}: {ratio:.2f}; / 8 curls: {r.get('ceiling_ratio') or 0:.2f} "
                       f"(target >= 0.8 of either: {'met' if best >= 0.8 else 'not met'})")
        if s == "rs-100" and "first_batch_s" in r:
            out.append(f"first batch at 100 ms, workers {w}: {r['first_batch_s']:.2f} s "
                       f"(target <= 1 s: {'met' if r['first_batch_s'] <= 1 else 'not met'})")
        if r.get("served_over_needed") is not None and w == 0:
            x = r["served_over_needed"]
            out.append(f"{s}: bytes served / bytes the windows need: {x:.3f} (target <= 1.1: "
                       f"{'met' if x <= 1.1 else 'not met'})")
    return out


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| source | workers | windows/s | ratio | of 8 curls | first batch s | served / needed | 503s |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        def f(key, spec):
            return format(r[key], spec) if r.get(key) is not None else "-"
        out.append(f"| {r['source']} | {r['workers']} | {f('windows_per_s', ',.0f')} | {f('ratio', '.2f')} | "
                   f"{f('ceiling_ratio', '.2f')} | {f('first_batch_s', '.2f')} | {f('served_over_needed', '.3f')} | "
                   f"{f('throttled', 'd')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--data", type=Path, default=REPO / "bench_data" / "remote", help="the corpus (written if missing)")
    p.add_argument("--quick", action="store_true", help="150 sequences in 8 MB shards, 1 round, 1 epoch")
    p.add_argument("--sources", nargs="+", default=SOURCES, choices=SOURCES)
    p.add_argument("--workers", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2, help="whole epochs a case reads")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a case may take")
    args = p.parse_args(argv)
    if args.case:
        child(json.loads(args.case))
        return 0
    if args.quick:
        args.rounds, args.epochs = 1, 1
        args.data = args.data.with_name(args.data.name + "-quick")
    corpus = ensure_corpus(args.data, args.quick)
    raw = measure(corpus, args.sources, args.workers, args.rounds, args.epochs, args.timeout)
    rows = summarize(raw, corpus, args.epochs)
    print("\n".join(verdicts(rows)))
    print(table(rows))
    print(json.dumps({"rows": rows, "curl_mb_s": raw["curl_mb_s"], "load": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
