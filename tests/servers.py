"""Real loopback servers for streamwin's tests: S3 (moto), HTTP with Range, fault injection.

Every server binds 127.0.0.1 on a free port (port 0), runs ``serve_forever`` in a daemon
thread, and is shut down by its fixture (open keep-alive connections are shut down too,
so no handler thread outlives the fixture). Nothing here touches a non-loopback address.

Fixtures (module level; use ``pytest_plugins = ["servers"]`` or ``from servers import *``)
------------------------------------------------------------------------------------------
``s3_server``        session   -> S3Server (moto ThreadedMotoServer on 127.0.0.1:<free>)
``s3_bucket``        function  -> "s3://sw-<hex>" (a fresh, empty bucket on s3_server)
``s3_fault_proxy``   function  -> factory ``(faults: FaultPlan | None = None) -> S3FaultProxy``
``http_server``      function  -> factory ``(root_dir, faults: FaultPlan | None = None)
                                  -> HTTPFileServer``

Objects
-------
S3Server: ``endpoint_url``; ``storage_options(**extra) -> dict`` (key/secret "testing",
  client_kwargs endpoint_url + region us-east-1; plain and picklable, works with
  ``fsspec.open("s3://...", **opts)``); ``filesystem(no_retries=False, **kw)`` (fresh
  s3fs.S3FileSystem, skip_instance_cache=True); ``make_bucket(name=None) -> "s3://name"``;
  ``fault_proxy(plan) -> S3FaultProxy``; ``faulty_endpoint(plan) -> str``;
  ``inject_errors(n, status=503) -> S3FaultProxy`` (proxies made here live until the
  session ends unless closed; prefer the ``s3_fault_proxy`` fixture).
S3FaultProxy / HTTPFileServer (both): ``set_faults(plan, reset_stats=True)``,
  ``clear_faults()``, ``stats -> FaultStats``, ``reset_stats()``, ``close()``, context
  manager, ``injector.closing`` event. S3FaultProxy adds ``endpoint_url``,
  ``storage_options()``, ``filesystem(no_retries=False, **kw)``; HTTPFileServer adds
  ``root``, ``url`` (= base_url), ``url_for(relpath)``.

Fault semantics (``FaultPlan``) apply to GET requests only (for the S3 proxy: GetObject
requests only, i.e. GET /bucket/key; listings, HEAD, PUT pass through untouched), and only
to paths containing ``path_contains`` when that is set. Order per GET: status error (no
body) -> stall -> body, possibly truncated by a drop.

Exception types observed (fsspec 2026.9.0, s3fs 2026.9.0, aiohttp 3.14.5, botocore 1.43)
-----------------------------------------------------------------------------------------
The reader's retry logic has to catch these. tests/test_servers.py asserts them (all but
the slow permanent-503 case), so a library upgrade that changes them fails there first.

fsspec HTTPFileSystem (``fsspec.filesystem("http")``, aiohttp underneath). fsspec's http
implementation does NOT retry anything by itself:
  * 503 / 500 (any non-2xx but 404): ``aiohttp.ClientResponseError`` with ``.status == 503``
    (from ``raise_for_status``), for ``cat_file`` and ``open().read()``. HEAD (``info``,
    ``size``) is never faulted here.
  * 404: ``FileNotFoundError``.
  * connection dropped mid-body (Content-Length sent, then FIN after N bytes):
    ``aiohttp.ClientPayloadError("Response payload is not completed: <ContentLengthError:
    ... received N of M bytes>")``, cause ``aiohttp.http_exceptions.ContentLengthError``.
    Same type for ``cat_file`` and ``open().read()``. With an RST instead
    (``drop_with_reset=True``) it was also ``ClientPayloadError`` (message mentions
    ConnectionResetError); ``aiohttp.ClientOSError`` is possible by timing. Both subclass
    ``aiohttp.ClientError``: catch ``(aiohttp.ClientError, OSError)``.
    A raw ``http.client`` reader gets ``http.client.IncompleteRead`` (``.partial`` = the N
    bytes).
  * stall longer than the client's read timeout (``client_kwargs={"timeout":
    aiohttp.ClientTimeout(sock_read=t)}``): ``fsspec.exceptions.FSTimeoutError``, raised
    from aiohttp's ``SocketTimeoutError`` (fsspec's sync wrapper converts any
    ``asyncio.TimeoutError``). FSTimeoutError subclasses ``asyncio.TimeoutError``, i.e. the
    builtin ``TimeoutError`` (an ``OSError``) on Python >= 3.11. Same whether the stall is
    before or after the response headers. A stall shorter than the timeout only delays.

s3fs (aiobotocore underneath) retries a lot by itself:
  * 503 SlowDown / 500 InternalError on GetObject: botocore (legacy mode, 4 retries,
    backoff up to ~1 s, 2 s, ...) retries 500/502/503/504; s3fs' ``_error_wrapper`` retries
    again (``fs.retries`` = 5 attempts) any ClientError whose text says "SlowDown". One 503
    therefore costs ~0.5-1 s and is invisible; 3 cost ~4 s; a permanent 503 gives up after
    25 GETs (~36 s) with ``OSError(errno.EBUSY, "Please reduce your request rate.")`` whose
    ``__cause__`` is ``botocore.exceptions.ClientError`` (code SlowDown). A 500 surfaces as
    ``OSError(errno.EREMOTEIO, "We encountered an internal error...")`` (cause ClientError,
    code InternalError). ``S3Server.filesystem(no_retries=True)`` (botocore
    ``config_kwargs={"retries": {"total_max_attempts": 1}}`` plus ``fs.retries = 1``)
    surfaces these on the first failure.
  * connection dropped mid-body: botocore does not retry body reads, s3fs does:
    ``cat_file`` and ``open().read()`` re-issue the GetObject (``ClientPayloadError`` is in
    ``s3fs.core.S3_RETRYABLE_ERRORS``), so up to 4 drops per read are invisible. Exhausted
    (or with no_retries): ``aiohttp.ClientPayloadError``, as with plain http.
  * stall longer than ``config_kwargs={"read_timeout": t}``: ``FSTimeoutError`` (cause
    aiobotocore ``AioReadTimeoutError`` = botocore ``ReadTimeoutError``); retried by s3fs
    (FSTimeoutError is retryable), surfaced when exhausted / with no_retries.

streamwin's own shard reads over http(s) and s3 do not go through fsspec's aiohttp client:
``streamwin.storage.RangeReader`` streams each range with one urllib3 GET (s3: a presigned
URL) and raises ``BrokenRead(delivered=N)`` from ProtocolError (IncompleteRead after a FIN,
ConnectionResetError after an RST) or ReadTimeoutError (a stall, before or after the
headers). The types above still apply to index.json, the cache's whole-shard fetch and
filesystems read through fsspec.

``FaultStats`` counters are server-side: ``completed_gets`` means the server wrote the whole
body; ``client_aborts`` counts bodies the client hung up on (e.g. after its timeout).
"""

from __future__ import annotations

import contextlib
import email.utils
import html
import http.client
import http.server
import logging
import mimetypes
import os
import re
import socket
import struct
import threading
import urllib.parse
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import pytest

__all__ = [
    "LOOPBACK",
    "MAX_STALL_SECONDS",
    "FaultPlan",
    "FaultStats",
    "FaultInjector",
    "HTTPFileServer",
    "S3FaultProxy",
    "S3Server",
    "s3_storage_options",
    "start_moto",
    "s3_server",
    "s3_bucket",
    "s3_fault_proxy",
    "http_server",
]

LOOPBACK = "127.0.0.1"
BAD_CONTENT_RANGES = {  # FaultPlan.bad_content_range: (start, end, size) -> the Content-Range value sent
    "end-before-start": lambda start, end, size: f"bytes {start}-{start - 10}/{size}",
    "empty": lambda start, end, size: f"bytes {start}-{start - 1}/{size}",
    "wrong-start": lambda start, end, size: f"bytes {start + 1}-{end}/{size}",
    "garbage": lambda start, end, size: f"bytes x-y/{size}",
}
MAX_STALL_SECONDS = 5.0  # bound on a single injected stall
_CHUNK = 64 * 1024
_HANDLER_SOCKET_TIMEOUT = 120.0  # bounds idle keep-alive handler threads
_UPSTREAM_TIMEOUT = 60.0  # proxy -> moto

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- faults


@dataclass(frozen=True)
class FaultPlan:
    """Deterministic faults applied to matching GET requests (counted from plan install).

    status_503_times: answer ``error_status`` (503 by default) to the first K matching GETs.
    error_status:     status used for those answers (503, 500, ...). The S3 proxy sends an
                      S3 XML error body: 503 -> SlowDown, 500 -> InternalError.
    drop_after_bytes: close the connection after sending that many body bytes, for the
                      first ``drop_times`` matching GETs that have a body to send
                      (``drop_times=None``: every one). A response shorter than or equal to
                      the limit is sent whole and does not use up a drop.
    drop_every_bytes: across responses, close the connection once the body bytes served
                      since the last drop would exceed N (after sending exactly N), then
                      start counting again. Combines with drop_after_bytes (earliest wins).
    drop_with_reset:  drop with an RST (SO_LINGER 0) instead of an orderly FIN.
    stall_seconds:    sleep that long (<= MAX_STALL_SECONDS) before the body of the first
                      ``stall_times`` matching GETs (None: every one); after the headers by
                      default, before them with ``stall_before_headers=True``.
    bad_content_range: answer a range GET with a 206 whose Content-Range does not match the
                      request (the body and Content-Length stay right), for the first
                      ``bad_range_times`` matching range GETs (None: every one):
                      "end-before-start" (bytes S-(S-10)/N, a negative length), "empty"
                      (bytes S-(S-1)/N), "wrong-start" (bytes S+1-E/N), "garbage" (bytes x-y/N).
                      HTTPFileServer only.
    path_contains:    if set, only GETs whose URL path contains this string are affected.
    latency_seconds:  every matching GET waits this long before its answer (an object store's time to first
                      byte; not a fault: not counted in faults_injected).
    busy_above:       a matching GET that arrives while more than this many matching GETs are being answered
                      gets ``error_status`` (503: S3's SlowDown), as a store that limits requests per prefix
                      answers (counted in busy_answers and status_errors).
    """

    status_503_times: int = 0
    error_status: int = 503
    drop_after_bytes: int | None = None
    drop_times: int | None = 1
    drop_every_bytes: int | None = None
    drop_with_reset: bool = False
    stall_seconds: float = 0.0
    stall_times: int | None = 1
    stall_before_headers: bool = False
    bad_content_range: str | None = None
    bad_range_times: int | None = None
    path_contains: str | None = None
    latency_seconds: float = 0.0
    busy_above: int | None = None

    def __post_init__(self) -> None:
        if self.status_503_times < 0:
            raise ValueError("status_503_times must be >= 0")
        if not 400 <= self.error_status <= 599:
            raise ValueError("error_status must be a 4xx/5xx status")
        if self.drop_after_bytes is not None and self.drop_after_bytes < 0:
            raise ValueError("drop_after_bytes must be >= 0")
        if self.drop_every_bytes is not None and self.drop_every_bytes <= 0:
            raise ValueError("drop_every_bytes must be > 0")
        for name in ("drop_times", "stall_times"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{name} must be >= 0 or None")
        if self.bad_content_range not in (None, *BAD_CONTENT_RANGES):
            raise ValueError(f"bad_content_range must be one of {sorted(BAD_CONTENT_RANGES)} or None")
        if self.bad_range_times is not None and self.bad_range_times < 0:
            raise ValueError("bad_range_times must be >= 0 or None")
        if not 0.0 <= self.stall_seconds <= MAX_STALL_SECONDS:
            raise ValueError(f"stall_seconds must be within [0, {MAX_STALL_SECONDS}]")
        if not 0.0 <= self.latency_seconds <= MAX_STALL_SECONDS:
            raise ValueError(f"latency_seconds must be within [0, {MAX_STALL_SECONDS}]")
        if self.busy_above is not None and self.busy_above < 1:
            raise ValueError("busy_above must be >= 1 or None")


@dataclass(frozen=True)
class FaultStats:
    """Snapshot of a server's counters (since start or the last reset)."""

    requests: int = 0  # every request seen, any method
    get_requests: int = 0  # GETs the plan applies to (matching path; S3: GetObject)
    faults_injected: int = 0  # status_errors + drops + stalls
    status_errors: int = 0
    drops: int = 0
    stalls: int = 0
    bad_ranges: int = 0  # 206 answers sent with a Content-Range that does not match the request
    bytes_served: int = 0  # GET body bytes written, partial ones included (counted just
    #                        before each write, so a client abort may add one 64 KiB chunk)
    completed_gets: int = 0  # matching GETs whose whole body the server got to write
    client_aborts: int = 0  # matching GETs the client hung up on mid-body (e.g. timeout)
    most_in_flight: int = 0  # the most matching GETs being answered at once
    busy_answers: int = 0  # matching GETs answered error_status because more than busy_above were in flight


@dataclass
class _Decision:
    status: int | None = None
    stall: float = 0.0
    stall_before_headers: bool = False
    latency: float = 0.0
    counted: bool = True  # in flight until ``FaultInjector.done``
    drop_after: int | None = None  # per-request limit (drop_after_bytes), if armed
    drop_cause: str | None = None  # "after" | "every", set by body_limit
    bad_range: str | None = None  # a bad_content_range kind, if this GET gets one (when it is a range GET)


class FaultInjector:
    """Thread-safe fault state shared by the handler threads of one server."""

    def __init__(self, plan: FaultPlan | None = None) -> None:
        self._lock = threading.Lock()
        self.closing = threading.Event()  # set at shutdown: cuts stalls short
        self._plan = FaultPlan()
        self._counts: dict[str, int] = {}
        self._since_drop = 0
        self._in_flight = 0
        self.reset_stats()
        self.set_plan(plan or FaultPlan(), reset_stats=False)

    # -- configuration / counters
    def set_plan(self, plan: FaultPlan, reset_stats: bool = True) -> None:
        if not isinstance(plan, FaultPlan):
            raise TypeError("plan must be a FaultPlan")
        with self._lock:
            self._plan = plan
            self._status_left = plan.status_503_times
            self._drops_left = plan.drop_times
            self._stalls_left = plan.stall_times
            self._bad_ranges_left = plan.bad_range_times
            self._since_drop = 0
        if reset_stats:
            self.reset_stats()

    @property
    def plan(self) -> FaultPlan:
        return self._plan

    def reset_stats(self) -> None:
        with self._lock:
            self._counts = {f: 0 for f in FaultStats.__dataclass_fields__}

    def stats(self) -> FaultStats:
        with self._lock:
            return FaultStats(**self._counts)

    def _bump(self, name: str, n: int = 1) -> None:  # caller holds the lock
        self._counts[name] += n

    # -- per request
    def count_request(self) -> None:
        with self._lock:
            self._bump("requests")

    def decide(self, path: str) -> _Decision | None:
        """Decide faults for one GET; None if the plan does not apply to this path."""
        with self._lock:
            plan = self._plan
            if plan.path_contains is not None and plan.path_contains not in path:
                return None
            self._bump("get_requests")
            d = _Decision(latency=plan.latency_seconds)
            self._in_flight += 1
            self._counts["most_in_flight"] = max(self._counts["most_in_flight"], self._in_flight)
            if plan.busy_above is not None and self._in_flight > plan.busy_above:
                d.status = plan.error_status
                self._bump("busy_answers")
                self._bump("status_errors")
                return d
            if self._status_left > 0:
                self._status_left -= 1
                d.status = plan.error_status
                self._bump("status_errors")
                self._bump("faults_injected")
                return d
            if plan.stall_seconds > 0 and (self._stalls_left is None or self._stalls_left > 0):
                if self._stalls_left is not None:
                    self._stalls_left -= 1
                d.stall = plan.stall_seconds
                d.stall_before_headers = plan.stall_before_headers
                self._bump("stalls")
                self._bump("faults_injected")
            d.drop_after = plan.drop_after_bytes  # armed or not: decided in body_limit
            d.bad_range = plan.bad_content_range if self._bad_ranges_left != 0 else None
            return d

    def done(self, d: _Decision | None) -> None:
        """A GET ``decide`` counted in flight has been answered (or dropped)."""
        if d is not None and d.counted:
            d.counted = False
            with self._lock:
                self._in_flight -= 1

    def take_bad_range(self, d: _Decision) -> str | None:
        """The Content-Range fault for this range GET, if any (counted, within bad_range_times)."""
        if d.bad_range is None:
            return None
        with self._lock:
            if self._bad_ranges_left is not None:
                if self._bad_ranges_left <= 0:
                    return None
                self._bad_ranges_left -= 1
            self._bump("bad_ranges")
            self._bump("faults_injected")
        return d.bad_range

    def stall(self, seconds: float) -> None:
        if seconds > 0:
            self.closing.wait(min(seconds, MAX_STALL_SECONDS))

    def body_limit(self, d: _Decision, body_len: int) -> int | None:
        """How many of body_len bytes to send before dropping; None: send all.

        Decided atomically once the body length is known, so that concurrent requests
        never use more than ``drop_times`` drops between them.
        """
        with self._lock:
            limit = None
            d.drop_cause = None
            if (
                d.drop_after is not None
                and body_len > d.drop_after
                and (self._drops_left is None or self._drops_left > 0)
            ):
                limit, d.drop_cause = d.drop_after, "after"
            every = self._plan.drop_every_bytes
            if every is not None:
                allowance = max(0, every - self._since_drop)
                if body_len > allowance and (limit is None or allowance < limit):
                    limit, d.drop_cause = allowance, "every"
            if d.drop_cause == "after" and self._drops_left is not None:
                self._drops_left -= 1
            return limit

    # Counters are updated *before* the bytes they describe go out, so that a client which
    # has just seen a response (or an error) always finds the stats already up to date.
    def before_write(self, d: _Decision | None, n: int, completes: bool) -> None:
        with self._lock:
            self._bump("bytes_served", n)
            if d is not None:
                self._since_drop += n
                if completes:
                    self._bump("completed_gets")

    def before_drop(self, d: _Decision, partial: int) -> None:
        """About to write the last ``partial`` bytes of a response and cut it."""
        with self._lock:
            self._bump("bytes_served", partial)
            self._since_drop = 0
            self._bump("drops")
            self._bump("faults_injected")

    def client_aborted(self, d: _Decision | None, was_counted_complete: bool) -> None:
        with self._lock:
            if d is not None:
                self._bump("client_aborts")
                if was_counted_complete:
                    self._counts["completed_gets"] -= 1


# --------------------------------------------------------------------------- server base


class _LoopbackHTTPServer(http.server.ThreadingHTTPServer):
    request_queue_size = 128  # many DataLoader workers may connect at once
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, handler_cls: type, injector: FaultInjector) -> None:
        self.injector = injector
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__((LOOPBACK, 0), handler_cls)

    def process_request(self, request, client_address):  # type: ignore[override]
        with self._conns_lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):  # type: ignore[override]
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request, client_address):  # type: ignore[override]
        # Client-side disconnects (timeouts, aborted reads) are expected in fault tests.
        log.debug("error serving %s", client_address, exc_info=True)

    def close_all_connections(self) -> None:
        with self._conns_lock:
            conns = list(self._conns)
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


class _BackgroundServer:
    """A _LoopbackHTTPServer on 127.0.0.1:<free port> served from a daemon thread."""

    _handler_cls: type

    def __init__(self, faults: FaultPlan | None = None) -> None:
        self.injector = FaultInjector(faults)
        self._httpd = _LoopbackHTTPServer(self._handler_cls, self.injector)
        self._httpd.owner = self  # type: ignore[attr-defined]
        self.host, self.port = self._httpd.server_address[:2]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"{type(self).__name__}:{self.port}",
            daemon=True,
        )
        self._thread.start()
        self._closed = False

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def set_faults(self, faults: FaultPlan | None, reset_stats: bool = True) -> None:
        """Install a new plan (fault budgets restart); counters reset unless told not to."""
        self.injector.set_plan(faults or FaultPlan(), reset_stats=reset_stats)

    def clear_faults(self) -> None:
        self.injector.set_plan(FaultPlan(), reset_stats=False)

    @property
    def stats(self) -> FaultStats:
        return self.injector.stats()

    def reset_stats(self) -> None:
        self.injector.reset_stats()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()  # stop accepting (returns within one poll interval)
        self._httpd.close_all_connections()  # cut keep-alive and in-flight connections
        self.injector.closing.set()  # wake stalled handlers; they drop, not answer
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _FaultHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as aiohttp / botocore pools expect
    timeout = _HANDLER_SOCKET_TIMEOUT
    server: _LoopbackHTTPServer

    def log_message(self, format: str, *args) -> None:  # noqa: A002
        log.debug("%s %s", self.address_string(), format % args)

    @property
    def injector(self) -> FaultInjector:
        return self.server.injector

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        except (ConnectionError, socket.timeout, BrokenPipeError):
            self.close_connection = True

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok:
            self.injector.count_request()
        return ok

    def _drain_request_body(self) -> bytes:
        te = self.headers.get("Transfer-Encoding", "").lower()
        if "chunked" in te:
            out = bytearray()
            for _ in range(1_000_000):  # bounded
                line = self.rfile.readline(65537)
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                out += self.rfile.read(size)
                self.rfile.readline(65537)
            return bytes(out)
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n > 0 else b""

    def _send_simple(self, status: int, body: bytes, ctype: str = "text/plain",
                     extra: dict[str, str] | None = None, head: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _send_error_fault(self, status: int) -> None:
        body = b"injected fault\n"
        self._send_simple(status, body, extra={"Retry-After": "0"})

    def _send_with_faults(self, d: _Decision | None, status: int,
                          headers: list[tuple[str, str]], body_len: int,
                          chunks: Iterable[bytes]) -> None:
        """Send a GET response whose headers declare body_len bytes; apply d's faults."""
        try:
            self._answer(d, status, headers, body_len, chunks)
        finally:
            self.injector.done(d)

    def _answer(self, d: _Decision | None, status: int, headers: list[tuple[str, str]], body_len: int,
                chunks: Iterable[bytes]) -> None:
        if d is not None and d.latency:
            self.injector.stall(d.latency)
        if d is not None and d.status is not None:
            self._send_error_fault(d.status)
            return
        if d is not None and d.stall and d.stall_before_headers:
            self.injector.stall(d.stall)
            if self.injector.closing.is_set():
                self._drop_connection(reset=False)
                return
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(body_len))
        self.end_headers()
        if d is not None and d.stall and not d.stall_before_headers:
            self.wfile.flush()
            self.injector.stall(d.stall)
            if self.injector.closing.is_set():
                self.injector.client_aborted(d, False)
                self._drop_connection(reset=False)
                return
        limit = self.injector.body_limit(d, body_len) if d is not None else None
        inj = self.injector
        sent = 0
        counted_complete = False
        try:
            if body_len == 0:
                inj.before_write(d, 0, completes=True)
                counted_complete = True
            for chunk in chunks:
                if limit is not None and len(chunk) > limit - sent:
                    room = limit - sent
                    inj.before_drop(d, room)  # type: ignore[arg-type]
                    if room > 0:
                        self.wfile.write(chunk[:room])
                        sent += room
                    self._drop_connection(inj.plan.drop_with_reset)
                    return
                last = sent + len(chunk) >= body_len
                inj.before_write(d, len(chunk), completes=last)
                counted_complete = counted_complete or last
                self.wfile.write(chunk)
                sent += len(chunk)
        except OSError:  # client went away (timeout, reset): not an injected fault
            inj.client_aborted(d, counted_complete)
            self.close_connection = True

    def _drop_connection(self, reset: bool) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.wfile.flush()
        with contextlib.suppress(OSError):
            if reset:
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                self.connection.close()
            else:
                self.connection.shutdown(socket.SHUT_RDWR)


# --------------------------------------------------------------------------- HTTP files

_RANGE_RE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$", re.IGNORECASE)


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """(start, end_inclusive), None (serve whole file), or "unsatisfiable"."""
    if not header:
        return None
    m = _RANGE_RE.match(header)
    if not m:
        return None  # malformed or multi-range: ignore the header (RFC 9110 allows it)
    a, b = m.group(1), m.group(2)
    if a == "" and b == "":
        return None
    if a == "":  # suffix range: last b bytes
        n = int(b)
        if n == 0 or size == 0:
            return "unsatisfiable"
        return max(0, size - n), size - 1
    start = int(a)
    end = int(b) if b != "" else size - 1
    if b != "" and end < start:
        return None
    if start >= size:
        return "unsatisfiable"
    return start, min(end, size - 1)


def _file_chunks(path: str, start: int, length: int) -> Iterator[bytes]:
    with open(path, "rb") as f:
        f.seek(start)
        left = length
        while left > 0:
            b = f.read(min(_CHUNK, left))
            if not b:
                break
            left -= len(b)
            yield b


class _FileHandler(_FaultHandler):
    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    def _resolve(self) -> str | None:
        root: str = self.server.owner.root  # type: ignore[attr-defined]
        raw = urllib.parse.urlsplit(self.path).path
        rel = urllib.parse.unquote(raw)
        if "\x00" in rel or "\\" in rel:
            return None
        parts = [p for p in rel.split("/") if p not in ("", ".")]
        if any(p == ".." for p in parts):
            return None
        full = os.path.realpath(os.path.join(root, *parts))
        if full != root and not full.startswith(root + os.sep):
            return None  # e.g. a symlink pointing outside root
        return full if os.path.exists(full) else None

    def _serve(self, head: bool) -> None:
        full = self._resolve()
        if full is None:
            self._send_simple(404, b"not found\n", head=head)
            return
        if os.path.isdir(full):
            self._listing(full, head)
            return
        st = os.stat(full)
        size = st.st_size
        ctype = mimetypes.guess_type(full)[0] or "application/octet-stream"
        common = [
            ("Content-Type", ctype),
            ("Accept-Ranges", "bytes"),
            ("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True)),
            ("ETag", f'"{st.st_ino:x}-{st.st_size:x}-{int(st.st_mtime_ns):x}"'),
        ]
        rng = _parse_range(self.headers.get("Range"), size)
        if rng == "unsatisfiable":
            self._send_simple(416, b"", extra={"Content-Range": f"bytes */{size}"}, head=head)
            return
        if rng is None:
            status, start, length, headers = 200, 0, size, common
        else:
            start, end = rng  # type: ignore[misc]
            status, length = 206, end - start + 1
            headers = common + [("Content-Range", f"bytes {start}-{end}/{size}")]
        if head:
            self.send_response(status)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(length))
            self.end_headers()
            return
        d = self.injector.decide(urllib.parse.urlsplit(self.path).path)
        bad = self.injector.take_bad_range(d) if d is not None and d.status is None and rng is not None else None
        if bad is not None:
            headers = common + [("Content-Range", BAD_CONTENT_RANGES[bad](start, end, size))]
        self._send_with_faults(d, status, headers, length, _file_chunks(full, start, length))

    def _listing(self, full: str, head: bool) -> None:
        base = urllib.parse.urlsplit(self.path).path
        if not base.endswith("/"):
            base += "/"
        items = []
        for name in sorted(os.listdir(full)):
            suffix = "/" if os.path.isdir(os.path.join(full, name)) else ""
            href = html.escape(base + urllib.parse.quote(name) + suffix, quote=True)
            items.append(f'<li><a href="{href}">{html.escape(name + suffix)}</a></li>')
        body = ("<!DOCTYPE html><html><body><ul>\n" + "\n".join(items)
                + "\n</ul></body></html>\n").encode()
        self._send_simple(200, body, ctype="text/html; charset=utf-8", head=head)


class HTTPFileServer(_BackgroundServer):
    """Serves ``root`` read-only at ``base_url`` (GET/HEAD, single byte ranges, listings).

    url_for("a/b.tar") -> "http://127.0.0.1:<port>/a/b.tar". Directories answer a small
    HTML index of links (what fsspec's HTTPFileSystem.ls parses). Paths escaping root
    (``..``, encoded ``%2e%2e``, symlinks out of root) answer 404.
    """

    _handler_cls = _FileHandler

    def __init__(self, root: str | os.PathLike, faults: FaultPlan | None = None) -> None:
        self.root = os.path.realpath(os.fspath(root))
        if not os.path.isdir(self.root):
            raise NotADirectoryError(self.root)
        super().__init__(faults)

    @property
    def url(self) -> str:
        return self.base_url

    def url_for(self, relpath: str | os.PathLike = "") -> str:
        rel = Path(relpath).as_posix().lstrip("/") if os.fspath(relpath) else ""
        return f"{self.base_url}/{urllib.parse.quote(rel)}"


# --------------------------------------------------------------------------- S3

_HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
    "trailer", "trailers", "transfer-encoding", "upgrade", "expect",
}
_S3_SUBRESOURCES = {
    "acl", "tagging", "uploadid", "uploads", "attributes", "retention", "legal-hold",
    "torrent", "restore", "select", "policy", "location", "versions", "list-type",
    "delete", "cors", "lifecycle",
}
_S3_ERROR_CODES = {
    503: ("SlowDown", "Please reduce your request rate."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
}


def _is_get_object(path_and_query: str) -> bool:
    parts = urllib.parse.urlsplit(path_and_query)
    segs = parts.path.lstrip("/").split("/", 1)
    if len(segs) < 2 or not segs[0] or not segs[1]:
        return False
    keys = {k.lower() for k, _ in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)}
    return not (keys & _S3_SUBRESOURCES)


class _S3ProxyHandler(_FaultHandler):
    def do_GET(self) -> None:
        self._proxy()

    def do_HEAD(self) -> None:
        self._proxy()

    def do_PUT(self) -> None:
        self._proxy()

    def do_POST(self) -> None:
        self._proxy()

    def do_DELETE(self) -> None:
        self._proxy()

    def _send_error_fault(self, status: int) -> None:
        code, msg = _S3_ERROR_CODES.get(status, ("ServiceUnavailable", "Injected fault."))
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{msg}</Message>"
            f"<RequestId>streamwin-fault</RequestId><HostId>streamwin</HostId></Error>"
        ).encode()
        self._send_simple(status, body, ctype="application/xml")

    def _proxy(self) -> None:
        body = self._drain_request_body()
        method = self.command
        d = None
        if method == "GET" and _is_get_object(self.path):
            d = self.injector.decide(urllib.parse.urlsplit(self.path).path)
        try:
            self._proxy_answer(d, body, method)
        finally:
            self.injector.done(d)

    def _proxy_answer(self, d: _Decision | None, body: bytes, method: str) -> None:
        if d is not None and d.status is not None:
            self.injector.stall(d.latency)
            self._send_error_fault(d.status)
            return
        up_host, up_port = self.server.owner.upstream  # type: ignore[attr-defined]
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            headers.pop("Content-Length", None)
        headers["Content-Length"] = str(len(body))
        try:
            conn = http.client.HTTPConnection(up_host, up_port, timeout=_UPSTREAM_TIMEOUT)
            try:
                conn.request(method, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                resp_headers = resp.getheaders()
                status = resp.status
            finally:
                conn.close()
        except OSError as e:
            self._send_simple(502, f"upstream error: {e}\n".encode())
            return
        out_headers = []
        declared_len = None
        for k, v in resp_headers:
            kl = k.lower()
            if kl in _HOP_BY_HOP or kl in ("date", "server"):
                continue
            if kl == "content-length":
                declared_len = v
                continue
            out_headers.append((k, v))
        if method == "HEAD":
            self.send_response(status)
            for k, v in out_headers:
                self.send_header(k, v)
            self.send_header("Content-Length", declared_len or "0")
            self.end_headers()
            return
        chunks = (data[i:i + _CHUNK] for i in range(0, len(data), _CHUNK))
        if not 200 <= status < 300:
            self.injector.done(d)
            d = None  # only successful object bodies get stalled / truncated
        self._send_with_faults(d, status, out_headers, len(data), chunks)


def s3_storage_options(endpoint_url: str, **extra) -> dict:
    """Options for s3fs / fsspec.open("s3://...", **opts) against a loopback endpoint."""
    opts = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint_url, "region_name": "us-east-1"},
    }
    opts.update(extra)
    return opts


_shared_aio_session = None


def _aio_session():
    """One aiobotocore session for the helpers' filesystems: creating an S3 client on a
    fresh session re-reads botocore's service models (~0.3-1 s); on a shared one ~0.1 s.
    Only used by filesystem(); storage_options() stays a plain, picklable dict."""
    global _shared_aio_session
    if _shared_aio_session is None:
        from aiobotocore.session import AioSession

        _shared_aio_session = AioSession()
    return _shared_aio_session


def _s3_filesystem(endpoint_url: str, no_retries: bool = False, **kw):
    import s3fs

    opts = s3_storage_options(endpoint_url, **kw)
    if no_retries:
        ck = dict(opts.get("config_kwargs") or {})
        ck["retries"] = {"total_max_attempts": 1, "mode": "standard"}
        opts["config_kwargs"] = ck
    opts.setdefault("session", _aio_session())
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    if no_retries:
        fs.retries = 1
    return fs


class S3FaultProxy(_BackgroundServer):
    """Loopback HTTP proxy in front of moto; injects FaultPlan faults into GetObject.

    All other requests (HEAD, listings, PUT, ...) pass through unchanged. Buckets and
    objects are moto's, so data written through S3Server is readable here and vice versa.
    """

    _handler_cls = _S3ProxyHandler

    def __init__(self, upstream: tuple[str, int], faults: FaultPlan | None = None) -> None:
        self.upstream = upstream
        super().__init__(faults)

    @property
    def endpoint_url(self) -> str:
        return self.base_url

    def storage_options(self, **extra) -> dict:
        return s3_storage_options(self.endpoint_url, **extra)

    def filesystem(self, no_retries: bool = False, **kw):
        return _s3_filesystem(self.endpoint_url, no_retries=no_retries, **kw)


@dataclass
class S3Server:
    """moto in server mode on 127.0.0.1. All methods are safe to call from tests."""

    endpoint_url: str
    _moto: object = None
    _proxies: list | None = None

    def storage_options(self, **extra) -> dict:
        """{"key", "secret", "client_kwargs": {"endpoint_url", "region_name"}} (+ extra)."""
        return s3_storage_options(self.endpoint_url, **extra)

    def filesystem(self, no_retries: bool = False, **kw):
        """A fresh s3fs.S3FileSystem (skip_instance_cache=True) on this endpoint."""
        return _s3_filesystem(self.endpoint_url, no_retries=no_retries, **kw)

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket (unique name if None); returns "s3://name"."""
        name = name or f"sw-{uuid.uuid4().hex[:16]}"
        conn = http.client.HTTPConnection(*self._hostport(), timeout=30)
        try:
            conn.request("PUT", f"/{name}", body=b"", headers={
                "Content-Length": "0",
                "Authorization": "AWS4-HMAC-SHA256 Credential=testing/20240101/us-east-1/"
                                 "s3/aws4_request, SignedHeaders=host, Signature=x",
            })
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            raise RuntimeError(f"CreateBucket {name}: {resp.status} {data[:300]!r}")
        return f"s3://{name}"

    def _hostport(self) -> tuple[str, int]:
        u = urllib.parse.urlsplit(self.endpoint_url)
        return u.hostname or LOOPBACK, int(u.port or 80)

    def fault_proxy(self, faults: FaultPlan | None = None) -> S3FaultProxy:
        """Start a fault-injecting proxy in front of this server (closed by close())."""
        p = S3FaultProxy(self._hostport(), faults)
        if self._proxies is None:
            self._proxies = []
        self._proxies.append(p)
        return p

    def faulty_endpoint(self, faults: FaultPlan) -> str:
        """Endpoint URL of a new fault proxy (see fault_proxy for one with counters)."""
        return self.fault_proxy(faults).endpoint_url

    def inject_errors(self, get_errors: int, status: int = 503) -> S3FaultProxy:
        """Proxy answering ``status`` to the next ``get_errors`` GetObject requests."""
        return self.fault_proxy(FaultPlan(status_503_times=get_errors, error_status=status))

    def close(self) -> None:
        for p in self._proxies or []:
            p.close()
        self._proxies = []
        if self._moto is not None:
            self._moto.stop()  # type: ignore[attr-defined]
            self._moto = None


_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
_AWS_ENV_UNSET = ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


@contextlib.contextmanager
def _aws_env() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in (*_AWS_ENV, *_AWS_ENV_UNSET)}
    os.environ.update(_AWS_ENV)
    for k in _AWS_ENV_UNSET:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _moto_server_class() -> type:
    """ThreadedMotoServer, minus a duplicate ``Server`` response header.

    moto's S3 responses carry their own ``server: amazon.com`` header and werkzeug adds
    ``Server: Werkzeug/...``; aiohttp's pure-Python HTTP parser (used under ``python -X
    dev``, with AIOHTTP_NO_EXTENSIONS=1, or where its C parser is not built) rejects a
    response with two Server headers ("Duplicate 'Server' header found"). The subclass
    serves the same moto app with a request handler that does not add werkzeug's header
    (and a short shutdown poll interval), and that runs one write at a time: moto checks a
    conditional PUT's If-None-Match, then writes, unlocked, where S3 decides atomically. Falls back to plain ThreadedMotoServer if moto's
    internals move.
    """
    from moto.server import ThreadedMotoServer

    try:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server
    except ImportError:  # pragma: no cover - depends on moto's layout
        return ThreadedMotoServer

    writes = threading.Lock()

    class _Handler(MotoRequestHandler):  # type: ignore[misc, valid-type]
        def send_response(self, code, message=None):  # no automatic Server header
            self.log_request(code)
            self.send_response_only(code, message)
            self.send_header("Date", self.date_time_string())

        def run_wsgi(self):
            # moto checks If-None-Match / If-Match and then writes, with no lock, so of two conditional PUTs at
            # once both could succeed; S3 decides them atomically. One write at a time here does too.
            if self.command in ("PUT", "POST", "DELETE"):
                with writes:
                    return super().run_wsgi()
            return super().run_wsgi()

    class _MotoServer(ThreadedMotoServer):  # type: ignore[misc, valid-type]
        def _server_entry(self) -> None:
            app = DomainDispatcherApplication(create_backend_app)
            self._server = make_server(
                self._ip_address, self._port, app, True, request_handler=_Handler
            )
            self._server_ready_event.set()
            self._server.serve_forever(poll_interval=0.05)

    return _MotoServer


def start_moto() -> S3Server:
    """Start moto's ThreadedMotoServer on 127.0.0.1:<free port> and wait until it answers."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    srv = _moto_server_class()(ip_address=LOOPBACK, port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    s3 = S3Server(endpoint_url=f"http://{LOOPBACK}:{port}", _moto=srv)
    # Warm up (loads the S3 backend) with a bounded readiness loop.
    last: Exception | None = None
    for _ in range(50):
        try:
            conn = http.client.HTTPConnection(LOOPBACK, port, timeout=10)
            try:
                conn.request("GET", "/moto-api/data.json")
                conn.getresponse().read()
            finally:
                conn.close()
            break
        except OSError as e:
            last = e
            threading.Event().wait(0.05)
    else:
        srv.stop()
        raise RuntimeError(f"moto server did not answer: {last}")
    return s3


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """Session-wide moto S3 server on loopback; dummy AWS env vars while it lives."""
    with _aws_env():
        s3 = start_moto()
        try:
            yield s3
        finally:
            s3.close()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh uniquely named bucket: "s3://sw-<hex>"."""
    return s3_server.make_bucket()


@pytest.fixture
def s3_fault_proxy(s3_server: S3Server) -> Iterator[Callable[..., S3FaultProxy]]:
    """Factory: s3_fault_proxy(FaultPlan(...)) -> S3FaultProxy, closed after the test."""
    made: list[S3FaultProxy] = []

    def make(faults: FaultPlan | None = None) -> S3FaultProxy:
        p = S3FaultProxy(s3_server._hostport(), faults)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


@pytest.fixture
def http_server() -> Iterator[Callable[..., HTTPFileServer]]:
    """Factory: http_server(root_dir, faults=None) -> HTTPFileServer, closed after the test."""
    made: list[HTTPFileServer] = []

    def make(root: str | os.PathLike, faults: FaultPlan | None = None) -> HTTPFileServer:
        s = HTTPFileServer(root, faults)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()
