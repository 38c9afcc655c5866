"""Every wait is bounded: a server that stalls, trickles, or keeps a connection it no longer serves.

A loopback HTTP server of this module serves a packed dataset with Range support and, for
the shard files, misbehaves on purpose: ``trickle`` sends a few bytes, then one byte just
under the stall timeout, for ever; ``stall_after`` sends some bytes and then nothing. Before
streamwin bounded a transfer, each of these kept a read (or its retries, which resume at the
byte and so counted every attempt as progress) going for ever; the tests run them with a
small stall timeout and check the read fails in the documented time: per attempt the stall
timeout plus a second per MiB, in total the attempts' limits and the backoffs. ``dead`` keeps
a keep-alive connection open after its first answer and never reads from it again: fsspec's
shared http session reuses it and waits for an answer that never comes (the keep-alive hang of
a second loader's manifest load), while load_manifest reads index.json on a connection of its
own and answers at once.
"""
from __future__ import annotations

import http.server
import os
import re
import socket
import threading
import time

import aiohttp
import fsspec
import numpy as np
import pytest

import streamwin as sw
from streamwin.errors import WorkerError
from streamwin.storage.deadline import attempt_limit, total_limit

pytestmark = pytest.mark.timeout(120)
STALL = 1.0  # the stall timeout the tests give (the default is 30 s over http)


class Misbehaving(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, root: str):
        self.root, self.mode, self.served = root, None, 0
        self.stop = threading.Event()
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{path}"

    def close(self) -> None:
        self.stop.set()
        self.shutdown()
        self.server_close()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        srv: Misbehaving = self.server
        path = os.path.join(srv.root, self.path.lstrip("/"))
        if not os.path.isfile(path):
            self.send_error(404)
            return
        data = open(path, "rb").read()
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        lo, hi = (int(m.group(1)), int(m.group(2) or len(data) - 1) + 1) if m else (0, len(data))
        body = data[lo:hi]
        self.send_response(206 if m else 200)
        if m:
            self.send_header("Content-Range", f"bytes {lo}-{hi - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        mode = srv.mode if path.endswith(".tar") else None
        if mode is None or mode == "dead":
            self.wfile.write(body)
            self.wfile.flush()
            with srv.lock:
                srv.served += len(body)
            if mode == "dead" or (srv.mode == "dead" and path.endswith(".json")):
                srv.stop.wait(60)  # keep the connection, never read from it again
                self.close_connection = True
            return
        self.wfile.write(body[:100])  # a little, then a trickle or nothing
        self.wfile.flush()
        for b in body[100:]:
            if mode == "stall_after" or srv.stop.wait(STALL * 0.6):
                srv.stop.wait(60)
                break
            self.wfile.write(bytes([b]))
            self.wfile.flush()
        self.close_connection = True


@pytest.fixture()
def served(tmp_path):
    rng = np.random.default_rng(1)
    seqs = {f"s{i}": rng.standard_normal((int(n), 2)).astype(np.float32) for i, n in enumerate(rng.integers(50, 400, 30))}
    sw.pack(list(seqs.items()), str(tmp_path / "ds"), shard_bytes=20_000, progress=False)
    srv = Misbehaving(str(tmp_path))
    yield srv, seqs
    srv.close()


def timeouts(sock_read: float = STALL) -> dict:
    return {"client_kwargs": {"timeout": aiohttp.ClientTimeout(sock_read=sock_read)}}


@pytest.mark.parametrize("mode", ["trickle", "stall_after"])
def test_a_trickling_or_stalling_server_fails_in_bounded_time(served, mode):
    srv, _ = served
    srv.mode = mode
    retries, backoff = 2, 0.05
    ds = sw.WindowDataset(srv.url("ds"), window=8, batch_size=4,
                          read=sw.Read(retries=retries, retry_backoff=backoff, storage_options=timeouts()))
    loader = sw.WindowLoader(ds, num_workers=0)
    t0 = time.monotonic()
    with pytest.raises(sw.ShardError) as e:
        next(iter(loader))
    took = time.monotonic() - t0
    biggest = max(s.bytes for s in ds.manifest.shards)  # no range read is larger than a shard
    bound = total_limit(attempt_limit(biggest, STALL), retries, backoff)
    assert took < bound + 2.0, (took, bound)
    assert e.value.shard.startswith(srv.url("ds")) and isinstance(e.value.offset, int)
    assert ("time limit" in str(e.value)) or ("Timeout" in str(e.value)), str(e.value)
    loader.close()


def test_the_documented_limits():
    assert attempt_limit(0, 30.0) == 30.0 and attempt_limit(10 << 20, 30.0) == 40.0  # 1 s per MiB
    assert attempt_limit(10 << 20, 30.0, total=5.0) == 5.0  # aiohttp's ClientTimeout(total=...) when given
    assert total_limit(31.0, 5, 0.2) == pytest.approx(6 * 31.0 + 0.2 * 31)


def test_a_stalled_index_json_is_an_error_in_bounded_time(served):
    srv, _ = served

    class Stalled(Handler):
        def do_GET(self) -> None:
            self.server.stop.wait(60)  # accepts, never answers

    stalled = Misbehaving(srv.root)
    stalled.RequestHandlerClass = Stalled
    try:
        t0 = time.monotonic()
        with pytest.raises(sw.ManifestError, match="index.json"):
            sw.load_manifest(stalled.url("ds"), timeouts(), retries=1, backoff=0.05)
        assert time.monotonic() - t0 < 2 * STALL + 2.0
    finally:
        stalled.close()


def test_a_dead_keep_alive_connection_hangs_a_shared_session_not_load_manifest(served):
    """The keep-alive hang, pinned: a pooled connection whose server no longer reads it. fsspec's shared
    session sends the next request on it and waits (here until its 2 s read timeout; by default 5 minutes
    a try); load_manifest reads on a connection of its own and is not affected."""
    srv, _ = served
    srv.mode = "dead"
    fs = fsspec.filesystem("http", skip_instance_cache=True, **timeouts(2.0))
    assert fs.cat_file(srv.url("ds/index.json"))  # answered; the connection stays in the session's pool, dead
    t0 = time.monotonic()
    with pytest.raises(Exception) as e:
        fs.cat_file(srv.url("ds/index.json"))  # reuses the dead connection: no answer
    assert time.monotonic() - t0 >= 1.5 and isinstance(e.value, (TimeoutError, aiohttp.ClientError)), repr(e.value)
    t0 = time.monotonic()
    m = sw.load_manifest(srv.url("ds"))  # default timeouts: had it waited, it would take 30 s
    assert m.num_sequences == 30 and time.monotonic() - t0 < 1.0
    m = sw.load_manifest(srv.url("ds"))  # and again: every load on a connection of its own
    assert m.num_sequences == 30


def test_a_worker_in_a_stalled_read_dies_with_its_trainer(served, tmp_path):
    """A worker blocked in a read (a server that never answers) exits when its trainer is SIGKILLed,
    within a second or two, not when its read times out."""
    import signal
    import subprocess
    import sys

    srv, _ = served
    srv.mode = "stall_after"
    script = tmp_path / "trainer.py"
    script.write_text(
        "import sys, streamwin as sw\n"
        "ds = sw.WindowDataset(sys.argv[1], window=8, batch_size=4)\n"
        "loader = sw.WindowLoader(ds, num_workers=1)\n"
        "it = iter(loader)\n"
        "print('started', flush=True)\n"
        "next(it)\n")
    proc = subprocess.Popen([sys.executable, str(script), srv.url("ds")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "started"
        workers = _children(proc.pid, wait=20)
        assert workers, "no worker process started"
        time.sleep(1.0)  # the worker is in its stalled read now
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        t0 = time.monotonic()
        while any(_alive(p) for p in workers) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        assert not any(_alive(p) for p in workers), "a worker outlived its SIGKILLed trainer"
        assert time.monotonic() - t0 < 3.0
    finally:
        if proc.poll() is None:
            proc.kill()


def _children(pid: int, wait: float, besides: frozenset[int] = frozenset()) -> list[int]:
    """The child processes of ``pid`` other than ``besides`` (those it had before), once it has one."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < wait:
        try:
            kids = [int(x) for x in open(f"/proc/{pid}/task/{pid}/children").read().split()]
        except OSError:
            kids = []
        kids = [k for k in kids if k not in besides]
        if kids:
            return kids
        time.sleep(0.1)
    return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_stopped_worker_is_named_within_the_silence_limit(served, monkeypatch):
    """SIGSTOP a worker: the trainer names it (worker, pid, "stopped") once its heartbeat has stood still
    for SILENT_S (10 s by default, 2 s here); before, the trainer waited on it for ever."""
    import signal

    import streamwin.feed.pool as pool

    srv, _ = served
    monkeypatch.setattr(pool, "SILENT_S", 2.0)
    loader = sw.WindowLoader(sw.WindowDataset(srv.url("ds"), window=8, batch_size=4, shuffle_buffer=64),
                             num_workers=1, prefetch_factor=1)
    before = frozenset(_children(os.getpid(), wait=0.01))  # the suite's servers and other tests' helpers
    it = iter(loader)
    next(it)
    worker, = _children(os.getpid(), wait=5, besides=before)
    os.kill(worker, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=rf"worker 0 \(pid {worker}\) has not answered .* stopped"):
            for _ in range(10_000):
                next(it)
        assert time.monotonic() - t0 < 2.0 + 3.0
    finally:
        if _alive(worker):  # the failed pass killed it already (its workers do not wait for the next pass)
            os.kill(worker, signal.SIGCONT)
        loader.close()
    assert not _alive(worker)


FORKSERVER_IDLE = """
import sys, time, streamwin as sw
if __name__ == "__main__":
    ds = sw.WindowDataset(sys.argv[1], window=8, batch_size=4, shuffle_buffer=64)
    loader = sw.WindowLoader(ds, num_workers=1, multiprocessing_context="forkserver", prefetch_factor=1)
    it = iter(loader)
    next(it)
    time.sleep(2.5)  # a training step longer than a second: the worker waits for a slot meanwhile
    print(1 + sum(1 for _ in it), len(loader))
"""


def test_a_forkserver_worker_outlives_a_slow_step(tmp_path):
    """Before: a forkserver worker took its parent (the fork server) for a dead trainer after 1 s without
    a message, and exited: "streamwin worker 0 exited with code 0"."""
    import subprocess
    import sys

    rng = np.random.default_rng(2)
    sw.pack([(f"s{i}", rng.standard_normal((300, 2)).astype(np.float32)) for i in range(20)], str(tmp_path / "ds"),
            progress=False)
    script = tmp_path / "idle.py"
    script.write_text(FORKSERVER_IDLE)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "ds")], capture_output=True, text=True,
                       timeout=100, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = map(int, r.stdout.split())
    assert got == want > 0
