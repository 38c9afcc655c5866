"""Which HTTP client moves ranged bytes fastest, with the least CPU, on this machine (issue 42, item 6).

Every client reads the same byte ranges (every ``*.tar`` shard of ``--data`` cut into parts of
``--part-mb`` MiB) from one loopback server, at concurrency N, each range into its own place in one
preallocated buffer (what the loader does with a block):

- ``rangereader``: streamwin's ``RangeReader(fsspec.filesystem("http")).read_into`` on a ThreadPoolExecutor
  of N threads (urllib3; the body goes from the socket into the buffer, no copy).
- ``obstore``: ``obstore.get_range_async``, N in flight on one asyncio loop (Rust object_store, GIL
  released); each result, a Rust-owned ``Bytes``, is copied into the buffer: obstore reads into no buffer
  of the caller's. ``obstore-ranges``: ``get_ranges_async``, one call a shard, N calls in flight; it merges
  touching ranges even at ``coalesce=0``, so a shard's parts go as one GET of the whole shard.
- ``fsspec``: ``HTTPFileSystem.cat_ranges(batch_size=N)`` (aiohttp, N in flight, all ranges in one call:
  it returns every range's bytes at once), each then copied into the buffer.
- ``curl``: N curl processes, each taking every N-th range on one connection, bodies to /dev/null: the ceiling.

Servers (benchmarks/remote_servers.py): ``nginx`` (sendfile, keep-alive), ``nginx-100M`` (``limit_rate``
100 MiB/s a connection), ``rs-0ms``/``rs-50ms``/``rs-100ms`` (a threaded Python server with sendfile that
waits that long before every answer). Each (server, client, N) runs in a fresh child process, rounds
interleaved; medians. Columns: MB/s over the read; client CPU s/GB (user+sys of the child, its curls
included, over the read); server CPU s/GB (nginx: its processes; the Python server: this process's
threads) per GB served; copy s/GB (time spent copying results into the buffer); first byte ms (median of
8 one-byte GETs after the read, on warm connections); GET ms (median time of one range; obstore-ranges:
one call); peak RSS; served/asked (bytes sent over bytes asked); others' cores (CPU the rest of the
machine used meanwhile, children.py).

What each client does when a GET breaks, stalls, gets a 503 or has its Range ignored: client_faults.py.

Usage:
  python benchmarks/remote_clients.py --data DIR --quick          # ~1 minute
  python benchmarks/remote_clients.py --data DIR                  # 3 rounds, ~10 minutes on 2 busy cores
  python benchmarks/remote_clients.py --data DIR --part-mb 16 --servers nginx rs-50ms --concurrency 16

``--data`` defaults to bench_data/remote_clients, written if missing (1,500 sequences, ~485 MB in 32 MB
shards). obstore is optional: ``.venv/bin/pip install obstore`` for its rows; nginx too
(``apt-get install nginx-light``). Prints a markdown table, then one JSON line with every number.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from children import run_child  # noqa: E402
from remote_servers import NGINX_HINT, Nginx, RangeServer, nginx_binary  # noqa: E402

CLIENTS = ("rangereader", "obstore", "obstore-ranges", "fsspec", "curl")
SERVERS = ("nginx", "nginx-100M", "rs-0ms", "rs-50ms", "rs-100ms")
CONCURRENCY = (8, 16, 32)
OBSTORE_HINT = "obstore not installed: `.venv/bin/pip install obstore` for its rows"
PROBES = 8


def ranges_of(data: Path, part: int, shards: int | None = None) -> list[tuple[str, int, int]]:
    """(shard name, start, end) of every part of every shard, shard after shard."""
    out = []
    for f in sorted(data.glob("*.tar"))[:shards]:
        size = f.stat().st_size
        out += [(f.name, a, min(a + part, size)) for a in range(0, size, part)]
    return out


def cpu_seconds() -> float:
    """User + system seconds of this process and its reaped children."""
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))


# -- the clients (each runs in its own child process) ---------------------------------------------

class RangeReaderClient:
    """streamwin's RangeReader on a thread pool: each range read straight into its place."""

    def __init__(self, url: str, **fs_options: Any):
        import fsspec
        from streamwin.storage.ranged import RangeReader

        self.url, self.reader = url, RangeReader(fsspec.filesystem("http", **fs_options))

    def get_into(self, name: str, start: int, out: memoryview) -> None:
        done = 0
        while done < len(out):
            got = self.reader.read_into(f"{self.url}/{name}", start + done, out[done:])
            if not got:
                raise EOFError(f"{name}: no byte at {start + done}")
            done += got

    def read(self, ranges, dst, view, n) -> tuple[list[float], float]:
        def one(i: int) -> float:
            t = time.perf_counter()
            self.get_into(ranges[i][0], ranges[i][1], view[dst[i]:dst[i + 1]])
            return time.perf_counter() - t

        with ThreadPoolExecutor(n) as pool:
            return list(pool.map(one, range(len(ranges)))), 0.0

    def probe(self, name: str, offset: int) -> float:
        t = time.perf_counter()
        self.get_into(name, offset, memoryview(bytearray(1)))
        return time.perf_counter() - t


class ObstoreClient:
    """obstore's HTTPStore: one get_range_async a range (or, ``per_shard``, one get_ranges_async a shard)."""

    def __init__(self, url: str, per_shard: bool = False, **client_options: Any):
        import obstore
        from obstore.store import HTTPStore

        self.obs, self.per_shard = obstore, per_shard
        self.store = HTTPStore.from_url(url, client_options={"allow_http": True, **client_options})

    def read(self, ranges, dst, view, n) -> tuple[list[float], float]:
        return asyncio.run(self._read(ranges, dst, view, n))

    async def _read(self, ranges, dst, view, n) -> tuple[list[float], float]:
        groups: dict[str, list[int]] = {}
        for i, (name, _, _) in enumerate(ranges):
            groups.setdefault(name if self.per_shard else str(i), []).append(i)
        # get_ranges merges touching ranges even at coalesce=0 (a shard's parts: one GET) and runs
        # at most 10 GETs a call: enough calls in flight for about n GETs
        spans = max(1 + sum(ranges[j][1] > ranges[i][2] for i, j in zip(g, g[1:])) for g in groups.values())
        calls = -(-n // min(10, spans))
        gate, times, copy = asyncio.Semaphore(calls), [], [0.0]

        async def one(idx: list[int]) -> None:
            name = ranges[idx[0]][0]
            async with gate:
                t = time.perf_counter()
                if self.per_shard:
                    got = await self.obs.get_ranges_async(self.store, name, starts=[ranges[i][1] for i in idx],
                                                          ends=[ranges[i][2] for i in idx], coalesce=0)
                else:
                    got = [await self.obs.get_range_async(self.store, name, start=ranges[idx[0]][1],
                                                          end=ranges[idx[0]][2])]
                times.append(time.perf_counter() - t)
            t = time.perf_counter()
            for i, data in zip(idx, got):
                view[dst[i]:dst[i + 1]] = memoryview(data)
            copy[0] += time.perf_counter() - t

        await asyncio.gather(*(one(idx) for idx in groups.values()))
        return times, copy[0]

    def probe(self, name: str, offset: int) -> float:
        t = time.perf_counter()
        self.obs.get_range(self.store, name, start=offset, length=1)
        return time.perf_counter() - t


class FsspecClient:
    """fsspec's HTTPFileSystem.cat_ranges over all ranges at once, N in flight, then copied."""

    def __init__(self, url: str, **fs_options: Any):
        import fsspec

        self.url, self.fs = url, fsspec.filesystem("http", **fs_options)

    def read(self, ranges, dst, view, n) -> tuple[list[float], float]:
        got = self.fs.cat_ranges([f"{self.url}/{r[0]}" for r in ranges], [r[1] for r in ranges],
                                 [r[2] for r in ranges], batch_size=n, on_error="raise")
        t = time.perf_counter()
        for i, data in enumerate(got):
            if len(data) != dst[i + 1] - dst[i]:
                raise ValueError(f"{ranges[i]}: {len(data)} bytes came back")
            view[dst[i]:dst[i + 1]] = data
        return [], time.perf_counter() - t

    def probe(self, name: str, offset: int) -> float:
        t = time.perf_counter()
        self.fs.cat_file(f"{self.url}/{name}", start=offset, end=offset + 1)
        return time.perf_counter() - t


class CurlClient:
    """N curl processes, each taking every N-th range over one connection (--next), bodies to /dev/null."""

    def __init__(self, url: str):
        self.url = url

    def _curl(self, ranges, write_out: str) -> subprocess.Popen:
        args = ["curl"]
        for k, (name, a, b) in enumerate(ranges):
            args += (["--next"] if k else []) + ["-s", "-o", "/dev/null", "-w", write_out + r"\n", "-r", f"{a}-{b - 1}",
                                                 f"{self.url}/{name}"]
        return subprocess.Popen(args, stdout=subprocess.PIPE, text=True)

    def read(self, ranges, dst, view, n) -> tuple[list[float], float]:
        procs = [self._curl(ranges[k::n], "%{size_download} %{time_total}") for k in range(n)]
        lines = [ln.split() for p in procs for ln in p.communicate()[0].splitlines()]
        if any(p.returncode for p in procs) or sum(int(s) for s, _ in lines) != dst[-1]:
            raise RuntimeError(f"curl: exit codes {[p.returncode for p in procs]}, "
                               f"{sum(int(s) for s, _ in lines)} of {dst[-1]} bytes")
        return [float(t) for _, t in lines], 0.0

    def probes(self, name: str, offsets: Sequence[int]) -> list[float]:
        out = self._curl([(name, o, o + 1) for o in offsets], "%{time_starttransfer}").communicate()[0]
        return [float(x) for x in out.split()]


def make_client(client: str, url: str) -> Any:
    if client == "rangereader":
        return RangeReaderClient(url)
    if client.startswith("obstore"):
        return ObstoreClient(url, per_shard=client == "obstore-ranges")
    return FsspecClient(url) if client == "fsspec" else CurlClient(url)


def measure_one(client: str, url: str, data: Path, n: int, part: int, shards: int | None) -> dict[str, Any]:
    """One client reading every range once at concurrency ``n``: speed, CPU, copies, latencies."""
    import numpy as np

    ranges = ranges_of(data, part, shards)
    dst = [0, *itertools.accumulate(b - a for _, a, b in ranges)]  # where each range goes in the buffer
    buf = np.ones(dst[-1], np.uint8)  # touched now: its page faults are no client's
    view = memoryview(buf)
    reader = make_client(client, url)
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    times, copy_s = reader.read(ranges, dst, view, n)
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    if client != "curl":  # the head, middle and tail of every range must be the file's bytes there
        for i, (name, a, b) in enumerate(ranges):
            with open(data / name, "rb") as f:
                for at in (a, (a + b) // 2, max(a, b - 4096)):
                    want = os.pread(f.fileno(), min(4096, b - at), at)
                    if bytes(view[dst[i] + at - a:dst[i] + at - a + len(want)]) != want:
                        raise ValueError(f"{client}: wrong bytes at {name}:{at}")
    offsets = [ranges[0][1] + k * 4097 for k in range(PROBES)]
    probes = reader.probes(ranges[0][0], offsets) if client == "curl" else [reader.probe(ranges[0][0], o) for o in offsets]
    gb = dst[-1] / 1e9
    return {"client": client, "n": n, "bytes": dst[-1], "ranges": len(ranges), "wall_s": wall, "mb_s": dst[-1] / 1e6 / wall,
            "cpu_s_per_gb": cpu / gb, "copy_s_per_gb": copy_s / gb, "get_ms": 1e3 * statistics.median(times) if times else None,
            "first_byte_ms": 1e3 * statistics.median(probes),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


# -- the parent: servers, children, rounds -----------------------------------------------------------

def start_server(name: str, data: Path) -> Any:
    if name.startswith("nginx"):
        return Nginx(data, limit_rate=100 << 20 if name == "nginx-100M" else 0)
    m = re.fullmatch(r"rs-(\d+)ms", name)
    if m is None:
        raise ValueError(f"--servers: unknown server {name!r}; choose from {', '.join(SERVERS)}")
    return RangeServer(data, latency=int(m.group(1)) / 1000)


def server_cpu(server: Any) -> float:
    """CPU seconds the server has used: nginx's processes, or this process (whose threads serve)."""
    if isinstance(server, Nginx):
        import psutil

        procs = [psutil.Process(server.proc.pid)]
        procs += procs[0].children(recursive=True)
        return sum(t.user + t.system for t in (p.cpu_times() for p in procs))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure_clients(data: Path, servers: Sequence[str] = SERVERS, clients: Sequence[str] = CLIENTS,
                    concurrency: Sequence[int] = CONCURRENCY, part_mb: float = 4, rounds: int = 3,
                    shards: int | None = None, timeout: float = 120,
                    progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Every (server, client, N) read in a fresh child, ``rounds`` interleaved rounds: one row of medians each."""
    if not any(data.glob("*.tar")):
        raise FileNotFoundError(f"--data {data}: no *.tar shard there")
    if any(c.startswith("obstore") for c in clients) and importlib.util.find_spec("obstore") is None:
        progress(OBSTORE_HINT)
        clients = [c for c in clients if not c.startswith("obstore")]
    if any(s.startswith("nginx") for s in servers) and nginx_binary() is None:
        progress(NGINX_HINT)
        servers = [s for s in servers if not s.startswith("nginx")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    live: dict[str, Any] = {}
    runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    try:
        for name in servers:
            live[name] = start_server(name, data)
        for r, s, c, n in itertools.product(range(rounds), servers, clients, concurrency):  # rounds outermost
            srv = live[s]
            srv.reset()
            cpu0 = server_cpu(srv)
            res = run_child([sys.executable, __file__, "--case", c, "--url", srv.url, "--data", str(data), "--part-mb",
                             str(part_mb), "--concurrency", str(n)] + (["--shards", str(shards)] if shards else []),
                            timeout, cwd=str(REPO), env=env)
            rec = res.record or res.failed()
            rec.update(server_cpu_s=server_cpu(srv) - cpu0, served=srv.bytes_served, others_cores=res.other_cpu_cores)
            runs.setdefault((s, c, n), []).append(rec)
            progress(f"round {r + 1}/{rounds} {s} {c} N={n}: "
                     + (f"{rec['mb_s']:.0f} MB/s" if "mb_s" in rec else rec["stderr_tail"][-300:]))
    finally:
        for srv in live.values():
            srv.close()
    return [summarize(s, c, n, recs, part_mb) for (s, c, n), recs in runs.items()]


def summarize(server: str, client: str, n: int, recs: list[dict[str, Any]], part_mb: float) -> dict[str, Any]:
    """Medians over the rounds that finished (peak RSS: the max), and how many failed."""
    ok = [r for r in recs if "mb_s" in r]
    med = lambda key: statistics.median(r[key] for r in ok) if ok and ok[0][key] is not None else None  # noqa: E731
    row = {"server": server, "client": client, "n": n, "part_mb": part_mb, "rounds": len(ok),
           "failed": [r["stderr_tail"][-500:] for r in recs if "mb_s" not in r]}
    if ok:
        row.update({k: med(k) for k in ("mb_s", "cpu_s_per_gb", "copy_s_per_gb", "first_byte_ms", "get_ms", "others_cores")})
        row["server_cpu_s_per_gb"] = statistics.median(r["server_cpu_s"] / max(r["served"], 1) * 1e9 for r in ok)
        row["served_per_asked"] = statistics.median(r["served"] / r["bytes"] for r in ok)
        row["peak_rss_mb"] = max(r["peak_rss_mb"] for r in ok)
        row["mb_per_cpu_s"] = 1000 / row["cpu_s_per_gb"]
    return row


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One line per (server, client, N)."""
    head = ("| server | client | N | MB/s | client CPU s/GB | MB per CPU s | server CPU s/GB | copy s/GB "
            "| first byte ms | GET ms | peak RSS MB | served/asked | others' cores |\n|" + "---|" * 3 + "---:|" * 10)
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
    lines = [head]
    for r in rows:
        if not r["rounds"]:
            lines.append(f"| {r['server']} | {r['client']} | {r['n']} | failed |" + " |" * 9)
            continue
        lines.append(f"| {r['server']} | {r['client']} | {r['n']} | {r['mb_s']:,.0f} | {r['cpu_s_per_gb']:.2f} "
                     f"| {r['mb_per_cpu_s']:,.0f} | {fmt(r['server_cpu_s_per_gb'], '.2f')} | {r['copy_s_per_gb']:.3f} "
                     f"| {r['first_byte_ms']:.1f} | {fmt(r['get_ms'], '.0f')} | {r['peak_rss_mb']:,.0f} "
                     f"| {r['served_per_asked']:.3f} | {r['others_cores']:.1f} |")
    return "\n".join(lines)


def write_corpus(path: Path) -> None:
    """The issue's corpus: 1,500 sequences of 500-20,000 steps x 8 float32 (~485 MB) in 32 MB shards."""
    import numpy as np
    import streamwin as sw

    lengths = np.random.default_rng(0).integers(500, 20_001, size=1500)
    sw.pack(((f"s{i:05d}", np.random.default_rng([1, i]).standard_normal((int(t), 8), dtype=np.float32))
             for i, t in enumerate(lengths)), str(path), shard_bytes=32 << 20, progress=False)


def versions() -> dict[str, str | None]:
    """The versions of what moved the bytes."""
    out: dict[str, str | None] = {}
    for mod in ("obstore", "fsspec", "aiohttp", "urllib3"):
        out[mod] = __import__(mod).__version__ if importlib.util.find_spec(mod) else None
    out["curl"] = subprocess.run(["curl", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    nginx = nginx_binary()
    out["nginx"] = subprocess.run([nginx, "-v"], capture_output=True, text=True).stderr.strip() if nginx else None
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=REPO / "bench_data" / "remote_clients")
    p.add_argument("--part-mb", type=float, default=4, help="size of a range, MiB (default 4)")
    p.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    p.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=CLIENTS)
    p.add_argument("--concurrency", nargs="+", type=int, default=list(CONCURRENCY))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--shards", type=int, help="read only the first SHARDS shards")
    p.add_argument("--quick", action="store_true", help="1 round, N 8 and 32, nginx, rs-0ms, rs-50ms, 4 shards")
    p.add_argument("--case", choices=CLIENTS, help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.part_mb <= 0 or a.rounds < 1 or min(a.concurrency) < 1 or (a.shards is not None and a.shards < 1):
        p.error(f"--part-mb {a.part_mb}, --rounds {a.rounds}, --concurrency {a.concurrency}, --shards {a.shards}: "
                "each must be positive")
    if a.case:
        print(json.dumps(measure_one(a.case, a.url, a.data, a.concurrency[0], int(a.part_mb * (1 << 20)), a.shards)))
        return
    if a.quick:
        a.rounds, a.concurrency, a.servers, a.shards = 1, [8, 32], ["nginx", "rs-0ms", "rs-50ms"], a.shards or 4
    if not any(a.data.glob("*.tar")):
        print(f"writing the corpus to {a.data} (~485 MB)", flush=True)
        write_corpus(a.data)
    load, t0 = os.getloadavg(), time.perf_counter()
    rows = measure_clients(a.data, a.servers, a.clients, a.concurrency, a.part_mb, a.rounds, a.shards,
                           progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(markdown_table(rows))
    print(json.dumps({"benchmark": "remote_clients", "loadavg_before": load, "loadavg_after": os.getloadavg(),
                      "cpus": os.cpu_count(), "wall_s": time.perf_counter() - t0, "versions": versions(),
                      "config": {"data": str(a.data), "part_mb": a.part_mb, "rounds": a.rounds, "shards": a.shards},
                      "rows": rows}))


if __name__ == "__main__":
    main()
