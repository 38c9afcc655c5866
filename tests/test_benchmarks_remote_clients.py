"""benchmarks/remote_clients.py and client_faults.py: every client puts every range at its place in the
buffer, a run gives a row per (server, client, N), the loopback range server answers short bodies at once,
and the fault probe reports what RangeReader's caller gets."""
from __future__ import annotations

import http.client
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import client_faults  # noqa: E402
import remote_clients  # noqa: E402
from remote_servers import RangeServer  # noqa: E402

CLIENTS = ["rangereader", "fsspec", "curl"] + (["obstore", "obstore-ranges"] if importlib.util.find_spec("obstore") else [])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Three 'shards' of random bytes of uneven sizes (one shorter than a part), and a file that is no shard."""
    root = tmp_path_factory.mktemp("remote-clients")
    for name, size in (("a.tar", 700_001), ("b.tar", 100_000), ("c.tar", 1 << 20)):
        (root / name).write_bytes(os.urandom(size))
    (root / "index.json").write_text("{}")
    return root


@pytest.fixture(scope="module")
def server(corpus):
    srv = RangeServer(corpus)
    yield srv
    srv.close()


@pytest.mark.parametrize("client", [c for c in CLIENTS if c != "curl"])
def test_every_client_puts_every_range_at_its_place(corpus, server, client):
    """The buffer a client fills equals the shards' bytes end to end (the reference: the files read here)."""
    ranges = remote_clients.ranges_of(corpus, 256 << 10)
    want = b"".join((corpus / n).read_bytes() for n in ("a.tar", "b.tar", "c.tar"))
    dst = [0]
    for _, a, b in ranges:
        dst.append(dst[-1] + b - a)
    buf = bytearray(len(want))
    remote_clients.make_client(client, server.url).read(ranges, dst, memoryview(buf), 3)
    assert len(ranges) == 3 + 1 + 4 and buf == want


def test_a_run_gives_one_row_per_server_client_and_concurrency(corpus):
    rows = remote_clients.measure_clients(corpus, servers=["rs-0ms"], clients=["rangereader", "curl"],
                                          concurrency=[2, 4], part_mb=0.25, rounds=1, progress=lambda _: None)
    assert [(r["client"], r["n"]) for r in rows] == [("rangereader", 2), ("rangereader", 4), ("curl", 2), ("curl", 4)]
    for r in rows:
        assert r["rounds"] == 1 and not r["failed"] and r["mb_s"] > 0 and r["cpu_s_per_gb"] > 0
        assert r["served_per_asked"] >= 1.0  # the probes' single bytes come on top of the ranges
    assert "| rs-0ms | curl | 4 |" in remote_clients.markdown_table(rows)


def test_the_range_server_answers_a_short_range_at_once(server):
    """A 1-byte ranged GET on a kept-alive connection takes well under the ~40 ms of a delayed ACK."""
    conn = http.client.HTTPConnection(*server.url.removeprefix("http://").split(":"))
    times = []
    for k in range(9):
        t = time.perf_counter()
        conn.request("GET", "/a.tar", headers={"Range": f"bytes={k}-{k}"})
        resp = conn.getresponse()
        assert resp.status == 206 and len(resp.read()) == 1
        times.append(time.perf_counter() - t)
    conn.close()
    assert statistics.median(times) < 0.02, f"1-byte GETs took {[round(t * 1e3, 1) for t in times]} ms"


def test_the_fault_probe_shows_rangereader_naming_the_byte_it_reached():
    rows = {r["fault"]: r for r in client_faults.check_clients(["rangereader"])}
    quarter = (client_faults.END - client_faults.START) // 4
    assert rows["drop"]["outcome"] == rows["stall"]["outcome"] == f"BrokenRead ({quarter:,} bytes delivered)"
    assert client_faults.STALL_TIMEOUT <= rows["stall"]["seconds"] < client_faults.STALL_S
    assert rows["no-range"]["outcome"].startswith("BrokenRead") and rows["503"]["outcome"].startswith("BrokenRead")
    assert all(len(r["requests"]) == 1 for r in rows.values())  # no retry of its own: every retry is the caller's
