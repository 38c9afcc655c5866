"""Byte ranges of remote objects read straight into the caller's buffer, resumable at the byte, in bounded time."""
from __future__ import annotations

import http.client
import os
import re
import sys
import threading
import time
from typing import Callable

import fsspec
import urllib3

from streamwin.errors import ManifestError
from streamwin.storage.deadline import attempt_limit, watchdog

# -- byte ranges of remote objects ------------------------------------------------------------

CHUNK = 4 << 20  # cat_file fallback: a range is fetched in chunks; a retry re-fetches the chunk that broke
PIECE = 1 << 20  # streamed GETs: read into the caller's buffer at most this much a socket read
CONNECTIONS = 64  # connections a reader keeps open to its endpoint, and so GETs in flight at most
LONG = 256 << 10  # GETs of this many bytes or more are timed for ``speed``: parts of blocks
THROTTLED = (429, 503)  # answers that ask a client to send fewer requests (S3's SlowDown is a 503)
HTTP_TIMEOUTS = (5.0, 30.0)  # connect, read (a stall): aiohttp's 300 s read made a stalled GET cost 5 min a try
S3_TIMEOUTS = (5.0, 60.0)  # connect (botocore's 60 s made an unreachable endpoint cost minutes), read: botocore's
PRESIGN_SECONDS = 3600  # a presigned s3 URL is used for half its lifetime, then signed anew
_HTTP_OPTIONS = {"headers", "timeout", "auth"}  # HTTPFileSystem options a streamed GET reproduces


class BrokenRead(Exception):
    """A ranged GET that failed after ``delivered`` bytes of the caller's buffer were filled.

    Why: the ``__cause__`` (a dropped connection, a read time-out, a body that ended before
    its length), or, with no cause, the message (an error answer such as 503 or 429, with
    ``delivered`` 0, and the answer's ``status``). The bytes before ``delivered`` are good; a
    retry asks for the rest.
    """

    def __init__(self, message: str, delivered: int, status: int | None = None):
        super().__init__(message)
        self.delivered, self.status = delivered, status

    @property
    def throttled(self) -> bool:
        """The server asked for fewer requests (429, or 503 such as S3's SlowDown)."""
        return self.status in THROTTLED


class RangeReader:
    """Reads byte ranges of one remote filesystem's objects into caller buffers.

    ``read_into(path, offset, out)`` fills a prefix of ``out`` with the object's bytes from
    ``offset`` and returns how many: at least 1, or 0 when the object has no byte at
    ``offset``. The caller calls again for the rest. How depends on the filesystem:

    - http(s):// (fsspec HTTPFileSystem) and s3:// (s3fs): ONE ranged GET for all of
      ``out``, copied into it as the bytes arrive (urllib3, one socket read at a time, so
      a thread pool of reads overlaps; socket reads release the GIL). A transfer that
      breaks raises BrokenRead naming how many bytes it delivered, so a retry resumes at
      that very byte and a connection dropped mid-range costs only the next request's
      headers. http uses the URL with the ``headers``, ``auth`` and ``timeout`` of the
      filesystem's options; s3 a presigned GET URL from s3fs, which carries whatever
      credentials, endpoint and region s3fs was given (cached per object, signed anew
      once on a 403). Connections are pooled per reader, ``connections`` of them at most:
      a GET beyond them waits for one to be free.
    - anything else, or options a plain GET cannot reproduce (another aiohttp client,
      requester-pays or SSE-C s3, a proxy, an s3fs that cannot presign): ``fs.cat_file``
      of at most CHUNK bytes; a failure loses the chunk in flight.

    Errors: FileNotFoundError (404) and PermissionError (401/403) are final; anything else
    is transient, for the caller to retry.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, connections: int = CONNECTIONS):
        self.fs = fs
        self._signed: dict[str, tuple[str, float]] = {}  # s3 path -> (presigned URL, when signed)
        self._lock = threading.Lock()
        self.kind = _streamable(fs)
        self._pool: urllib3.PoolManager | None = None
        self.latency = 0.0  # seconds from a GET's request to its answer's headers, lately (a moving average)
        self.speed = 0.0  # bytes/s a GET's body arrives at, at best lately (slowly forgotten): a connection's own
        self.part = 0.0  # bytes of a GET of LONG bytes or more, lately
        if self.kind is None:
            return
        opts = fs.client_kwargs if self.kind == "s3" else {**fs.client_kwargs, **fs.kwargs}
        self.headers = {"Accept-Encoding": "identity"}  # the bytes as stored, never re-encoded
        if self.kind == "http":
            self.headers.update(dict(fs.client_kwargs.get("headers") or {}))
            self.headers.update(dict(fs.kwargs.get("headers") or {}))
            if opts.get("auth") is not None:  # an aiohttp.BasicAuth
                self.headers["Authorization"] = opts["auth"].encode()
        connect, read = _timeouts(fs, self.kind, opts)
        self.stall = read
        self.total = getattr(opts.get("timeout"), "total", None) if self.kind == "http" else None
        verify = opts.get("verify", True)
        self._pool = urllib3.PoolManager(
            maxsize=connections, block=True, cert_reqs="CERT_REQUIRED" if verify is not False else "CERT_NONE",
            ca_certs=verify if isinstance(verify, str) else None,
            timeout=urllib3.Timeout(connect=connect, read=read),
            # no retries of urllib3's own: every retry is streamwin's, counted and resumed at the byte
            retries=urllib3.Retry(total=None, connect=0, read=0, status=0, other=0, redirect=5))

    def close(self) -> None:
        """Close the pooled connections (a later read opens new ones)."""
        if self._pool is not None:
            self._pool.clear()

    def attempt_limit(self, nbytes: int) -> float:
        """Seconds one GET of ``nbytes`` may take before it is cut (storage.deadline), streamed GETs only."""
        if self.kind is None:
            return float("inf")  # fsspec's cat_file: its own timeouts
        return attempt_limit(nbytes, self.stall, self.total)

    def read_all(self, path: str, most: int) -> bytes:
        """The whole object at ``path`` (at most ``most`` bytes), with one GET of this reader's own
        connections and time limits: FileNotFoundError, PermissionError, ManifestError (too large) or BrokenRead."""
        url = self._url(path) if self.kind is not None else None
        if url is None:
            data = self.fs.cat_file(path)
            if len(data) > most:
                raise ManifestError(f"{path} holds {len(data):,} bytes, more than the {most:,} expected at most")
            return data
        what = f"GET {path}"
        resp = self._request(url, {**self.headers}, what)
        try:
            if resp.status != 200:
                self._check(resp, path, 0, 1, what, may_resign=False)
                raise BrokenRead(f"{what}: HTTP {resp.status} to a GET of the whole object", 0, resp.status)
            size = resp.length_remaining
            if size is None or size > most:
                raise ManifestError(f"{path}: the server announces {size} bytes, at most {most:,} are expected")
            out = bytearray(size)
            self._stream_watched(resp, size, memoryview(out), what)
            return bytes(out)
        finally:
            if not resp.closed:
                resp.close()
            resp.release_conn()

    def _request(self, url: str, headers: dict, what: str):
        """A GET's response, body not read yet; BrokenRead when it cannot be had (connect error, stall)."""
        try:
            return self._pool.request("GET", url, headers=headers, preload_content=False, decode_content=False)
        except urllib3.exceptions.MaxRetryError as e:  # a connect error or a stall before the headers
            raise BrokenRead(f"{what} from {_endpoint(url)}: {type(e.reason).__name__}: {e.reason}", 0) from e.reason
        except Exception as e:
            raise BrokenRead(f"{what} from {_endpoint(url)}: {type(e).__name__}: {e}", 0) from e

    def _stream_watched(self, resp, want: int, out: memoryview, what: str) -> int:
        """``_stream_into`` cut at this GET's time limit (a trickle or a stall after some bytes)."""
        limit = self.attempt_limit(want)
        watch = watchdog().watch(limit, resp.shutdown)
        try:
            return _stream_into(resp, want, out, what)
        except BrokenRead as e:
            if watch.cut:
                raise BrokenRead(f"{what}: cut after {limit:.0f} s, its time limit (the stall timeout + 1 s per MiB): "
                                 f"{e.delivered} of {want} bytes had arrived", e.delivered) from e
            raise
        finally:
            watchdog().finish(watch)

    def read_into(self, path: str, offset: int, out: memoryview) -> int:
        """Fill a prefix of ``out`` with the object's bytes from ``offset``: how many (0 past the object's end)."""
        if self.kind is not None:
            url = self._url(path)
            if url is not None:
                return self._get_into(path, url, offset, out)
        data = self.fs.cat_file(path, start=offset, end=offset + min(len(out), CHUNK))
        out[: len(data)] = data
        return len(data)

    def _url(self, path: str, fresh: bool = False) -> str | None:
        """Where a GET of ``path`` goes (s3: a presigned URL, cached for half its life or signed anew when
        ``fresh``); None once no URL can be signed (the caller uses cat_file)."""
        if self.kind == "http":  # quoted as fsspec's own client would send it
            encode = getattr(self.fs, "encode_url", None)
            return str(encode(path)) if encode is not None else path
        with self._lock:
            url, at = self._signed.get(path, (None, 0.0))
        if url is None or fresh or time.monotonic() - at > PRESIGN_SECONDS / 2:
            try:
                url = self.fs.url(path, expires=PRESIGN_SECONDS)
            except Exception:  # no credentials to sign with, an old s3fs: cat_file from now on
                self.kind = None
                return None
            with self._lock:
                self._signed[path] = (url, time.monotonic())
        return url

    def _get_into(self, path: str, url: str, offset: int, out: memoryview, resigned: bool = False) -> int:
        """One ranged GET into ``out``; the bytes delivered (short only at the object's end)."""
        what = f"GET {path} bytes {offset}-{offset + len(out) - 1}"  # never the presigned URL: it is a credential
        headers = {**self.headers, "Range": f"bytes={offset}-{offset + len(out) - 1}"}
        asked = time.perf_counter()
        resp = self._request(url, headers, what)
        took = time.perf_counter() - asked
        self.latency = took if not self.latency else 0.8 * self.latency + 0.2 * took
        try:
            try:
                want = self._check(resp, path, offset, len(out), what, may_resign=self.kind == "s3" and not resigned)
            except _SignAnew:
                pass
            else:
                got = self._stream_watched(resp, want, out, what)
                if got >= LONG:  # the rate of this body alone: the best of them is what a connection can carry
                    body = max(time.perf_counter() - asked - took, 1e-6)
                    self.speed = max(0.99 * self.speed, got / body)
                    self.part = got if not self.part else 0.8 * self.part + 0.2 * got
                return got
        finally:
            if not resp.closed:  # body not read to its end (an object of which we wanted a prefix, a long
                resp.close()     # error page): this connection cannot serve another request
            resp.release_conn()
        # 403 to a presigned URL: it may have expired early (rotated credentials); sign anew, once
        url = self._url(path, fresh=True)
        if url is None:
            raise PermissionError(f"{path}: HTTP 403, and the URL cannot be signed anew")
        return self._get_into(path, url, offset, out, resigned=True)

    def _check(self, resp, path: str, offset: int, size: int, what: str, may_resign: bool) -> int:
        """How many body bytes belong to the range (>= 1, or 0 past the object's end); raises for error
        answers, and _SignAnew for a 403 that a fresh presigned URL may cure."""
        status = resp.status
        if status == 206:
            return _range_answer(resp, offset, size, what)
        if status == 200 and offset == 0:  # the server ignored the Range header: the object's head is ours
            return size if resp.length_remaining is None else min(size, resp.length_remaining)
        body = resp.read(2048) if status != 200 else b""
        code = re.search(rb"<Code>([^<]{1,64})</Code>", body)  # s3's error code (SlowDown, NoSuchKey, ...)
        text = f"HTTP {status} {resp.reason or ''}".rstrip() + (f" ({code.group(1).decode()})" if code else "")
        if status == 416:
            return 0
        if status == 404:
            raise FileNotFoundError(f"{path}: {text}")
        if status in (401, 403):
            if may_resign:
                raise _SignAnew
            raise PermissionError(f"{path}: {text}")
        if status == 200:
            text = "HTTP 200: the server ignored the Range header"
        raise BrokenRead(f"{what}: {text}", 0, status)


def _endpoint(url: str) -> str:
    """scheme://host:port of a URL (never its path or query: a presigned URL's query is a credential)."""
    u = urllib3.util.parse_url(url)
    return f"{u.scheme}://{u.host}" + (f":{u.port}" if u.port else "")


class _SignAnew(Exception):
    """A 403 to a presigned s3 URL: sign the URL anew and ask once more."""


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def _range_answer(resp, offset: int, size: int, what: str) -> int:
    """Body bytes of a 206 that belong to the range asked for; BrokenRead if the answer is another range.

    A Content-Range that does not parse, starts elsewhere, ends before it starts, ends past the
    object's size or disagrees with Content-Length is a failed attempt like a dropped
    connection: retried, counted, and named in the final error.
    """
    value = resp.headers.get("Content-Range", "")
    m = _CONTENT_RANGE.fullmatch(value.strip())
    first, last = (int(m.group(1)), int(m.group(2))) if m else (None, None)
    total = None if m is None or m.group(3) == "*" else int(m.group(3))
    length = resp.headers.get("Content-Length")
    if (m is None or first != offset or last < first or (total is not None and last >= total)
            or (length is not None and length.strip() != str(last - first + 1))):
        raise BrokenRead(f"{what}: the answer does not match the request: HTTP 206 with Content-Range {value!r}"
                         + (f", Content-Length {length}" if length is not None else ""), 0)
    return min(size, last - offset + 1)


def _stream_into(resp, want: int, out: memoryview, what: str) -> int:
    """Copy ``want`` body bytes of ``resp`` into ``out`` as they arrive; BrokenRead naming what was delivered.

    The bytes go from the socket straight into ``out``, PIECE at a time. Read as bytes objects
    (urllib3's ``read1``), each socket read allocated a PIECE-sized object and shrank it to what
    had arrived; in the threads of concurrent GETs this fragmented glibc's heaps, and a
    process's memory grew with the bytes it had read (by 40 MB over a 1 GB epoch over http).
    """
    readinto = _body_readinto(resp)
    done = 0
    try:
        while done < want:
            n = readinto(out[done : done + min(want - done, PIECE)])
            if not n:  # the connection closed before the range's end
                raise http.client.IncompleteRead(b"", want - done)
            done += n
    except Exception as e:
        raise BrokenRead(f"{what}: the stream broke after {done} of {want} bytes: {type(e).__name__}: {e}",
                         done) from e
    return done


def _body_readinto(resp) -> Callable[[memoryview], int]:
    """``readinto`` of a urllib3 response's body that copies nothing: http.client's own, where urllib3 has one.

    urllib3's public ``readinto`` reads a bytes object and copies it; the http.client response
    under it (not content-decoded: streamwin asks for the bytes as stored) fills the buffer.
    """
    fp = getattr(resp, "_fp", None)
    if isinstance(fp, http.client.HTTPResponse):
        return fp.readinto
    return resp.readinto


def _streamable(fs: fsspec.AbstractFileSystem) -> str | None:
    """"http" or "s3" when a plain ranged GET reads ``fs``'s objects as fsspec would, else None."""
    http = sys.modules.get("fsspec.implementations.http")
    if http is not None and isinstance(fs, http.HTTPFileSystem):
        same = fs.get_client is http.get_client and not (set(fs.client_kwargs) | set(fs.kwargs)) - _HTTP_OPTIONS
        return "http" if same else None
    s3fs = sys.modules.get("s3fs")
    if s3fs is not None and isinstance(fs, s3fs.S3FileSystem):
        plain = not (fs.req_kw or fs.s3_additional_kwargs or (fs.config_kwargs or {}).get("proxies"))
        proxied = any(os.environ.get(v) for v in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"))
        return "s3" if plain and not proxied else None
    return None


def _timeouts(fs: fsspec.AbstractFileSystem, kind: str, opts: dict) -> tuple[float | None, float | None]:
    """(connect, read) seconds; read bounds each socket read, so it catches a stall, not a long body."""
    if kind == "s3":
        ck = fs.config_kwargs or {}
        return ck.get("connect_timeout", S3_TIMEOUTS[0]), ck.get("read_timeout", S3_TIMEOUTS[1])
    t = opts.get("timeout")
    if t is None:
        return HTTP_TIMEOUTS
    if isinstance(t, (int, float)):
        return float(t), float(t)
    connect = getattr(t, "sock_connect", None) or getattr(t, "connect", None) or getattr(t, "total", None)
    return connect, getattr(t, "sock_read", None) or getattr(t, "total", None)
