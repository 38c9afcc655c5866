"""What each HTTP client of remote_clients.py does when a ranged GET goes wrong (issue 42, item 6).

A loopback server holds an 8 MiB object; each client asks once for 4 MiB at offset 1 MiB, the first
request going wrong one of four ways, the requests after it answered well:

- ``drop``: a quarter of the body, then the connection closes;
- ``stall``: a quarter of the body, then nothing for 8 s (each client is given a 2 s stall timeout:
  aiohttp's ``sock_read`` for fsspec and RangeReader, ``read_timeout`` for obstore);
- ``503``: an error answer (what object stores send to slow a client down);
- ``no-range``: the Range header ignored, a 200 with the whole object.

The table shows what the caller gets (the right bytes, wrong bytes, or an exception and the bytes it
says were delivered), how long it took, and the Range of every request the server saw: a client that
retries on its own shows a second request, one that resumes at the byte shows its start moved.

Usage:
  python benchmarks/client_faults.py          # ~30 s

Prints a markdown table, then one JSON line.
"""
from __future__ import annotations

import argparse
import http.server
import importlib.util
import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from remote_clients import FsspecClient, ObstoreClient, RangeReaderClient, versions  # noqa: E402

FAULTS = ("drop", "stall", "503", "no-range")
STALL_TIMEOUT, STALL_S = 2, 8.0
SIZE, START, END = 8 << 20, 1 << 20, 5 << 20


class _FaultHandler(http.server.BaseHTTPRequestHandler):
    """Serves ``server.body``; the first request goes wrong as ``server.fault`` says, the next are answered."""

    protocol_version = "HTTP/1.1"
    server: Any

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        srv = self.server
        srv.seen.append(self.headers.get("Range"))
        fault = srv.fault if len(srv.seen) == 1 else None
        if fault == "503":
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
        a, b = (int(m[1]), int(m[2]) + 1) if m and fault != "no-range" else (0, SIZE)
        self.send_response(206 if (a, b) != (0, SIZE) else 200)
        if (a, b) != (0, SIZE):
            self.send_header("Content-Range", f"bytes {a}-{b - 1}/{SIZE}")
        self.send_header("Content-Length", str(b - a))
        self.end_headers()
        if fault in ("drop", "stall"):  # a quarter of the body, then a stall and/or a closed connection
            self.wfile.write(srv.body[a:a + (b - a) // 4])
            self.wfile.flush()
            time.sleep(STALL_S if fault == "stall" else 0)
            self.close_connection = True
            return
        try:
            self.wfile.write(srv.body[a:b])
        except OSError:  # a client that gave up on a 200 it did not ask for
            self.close_connection = True


def read_once(client: str, url: str) -> bytes:
    """One ranged read of START..END by ``client``, with no retry of ours (a stall cut after STALL_TIMEOUT s)."""
    import aiohttp

    timeout = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(sock_connect=STALL_TIMEOUT, sock_read=STALL_TIMEOUT)}}
    if client == "rangereader":
        out = memoryview(bytearray(END - START))
        return bytes(out[:RangeReaderClient(url, **timeout).reader.read_into(f"{url}/f", START, out)])
    if client == "obstore":
        store = ObstoreClient(url, read_timeout=f"{STALL_TIMEOUT}s")
        return bytes(store.obs.get_range(store.store, "f", start=START, end=END))
    return FsspecClient(url, **timeout).fs.cat_file(f"{url}/f", start=START, end=END)


def check_clients(clients: Sequence[str]) -> list[dict[str, Any]]:
    """Every client under every fault: what its caller got, in how long, and the requests the server saw."""
    import aiohttp  # noqa: F401  imported before the clock starts
    import fsspec  # noqa: F401
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FaultHandler)
    srv.daemon_threads, srv.body = True, os.urandom(SIZE)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    rows = []
    try:
        for client in clients:
            for fault in FAULTS:
                srv.fault, srv.seen = fault, []
                t = time.perf_counter()
                try:
                    data = read_once(client, url)
                    outcome = ("the right bytes" if data == srv.body[START:END]
                               else f"WRONG bytes: {len(data):,} for the {END - START:,} asked")
                except Exception as e:  # what the caller gets: its type, and the bytes delivered where it says
                    delivered = getattr(e, "delivered", None)
                    said = f"{delivered:,} bytes delivered" if delivered is not None else (str(e).splitlines() or ["no message"])[0][:60]
                    outcome = f"{type(e).__name__} ({said})"
                rows.append({"client": client, "fault": fault, "outcome": outcome,
                             "seconds": time.perf_counter() - t, "requests": list(srv.seen)})
    finally:
        srv.shutdown()
        srv.server_close()
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    clients = [c for c in ("rangereader", "obstore", "fsspec") if c != "obstore" or importlib.util.find_spec("obstore")]
    if "obstore" not in clients:
        print("obstore not installed: `.venv/bin/pip install obstore` for its rows", file=sys.stderr)
    rows = check_clients(clients)
    print("| client | fault | what the caller gets | s | Range of each request the server saw |\n|---|---|---|---:|---|")
    for r in rows:
        print(f"| {r['client']} | {r['fault']} | {r['outcome']} | {r['seconds']:.1f} | {', '.join(map(str, r['requests']))} |")
    print(json.dumps({"benchmark": "client_faults", "versions": versions(), "rows": rows}))


if __name__ == "__main__":
    main()
