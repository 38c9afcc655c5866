"""Loopback servers for benchmarks/remote.py: nginx, a range server that waits before answering, an S3 proxy.

- ``Nginx``: the OS package's nginx on 127.0.0.1 serving a directory (sendfile, keep-alive), optionally
  capped at ``limit_rate`` bytes/s a connection, as object stores cap theirs. Its access log counts the
  body bytes it sent.
- ``RangeServer``: a small threaded HTTP/1.1 server answering ranged GETs with ``sendfile`` after waiting
  ``latency`` seconds before every answer (an object store's time to first byte).
- ``LatencyProxy``: a TCP proxy that holds every request ``latency`` seconds before passing it on (put in
  front of the S3 server the tests use, moto).

Each binds a free loopback port and counts the body bytes it served (``bytes_served``).
"""
from __future__ import annotations

import http.client
import http.server
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

LOOPBACK = "127.0.0.1"
NGINX_HINT = "nginx not found: install the OS package (apt-get install nginx-light) for the nginx rows"


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def nginx_binary() -> str | None:
    """The nginx executable, or None where the OS package is not installed."""
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)


class Nginx:
    """nginx serving ``root`` on a free loopback port (``limit_rate``: bytes/s a connection, 0 = none)."""

    def __init__(self, root: str | Path, limit_rate: int = 0):
        binary = nginx_binary()
        if binary is None:
            raise FileNotFoundError(NGINX_HINT)
        self.dir = Path(tempfile.mkdtemp(prefix="sw-nginx-"))
        self.port = free_port()
        self.log = self.dir / "access.log"
        conf = f"""
daemon off; worker_processes 1; pid {self.dir}/nginx.pid; error_log {self.dir}/error.log;
events {{ worker_connections 1024; }}
http {{
  log_format bytes '$body_bytes_sent'; access_log {self.log} bytes;
  sendfile on; tcp_nopush on; keepalive_requests 100000; keepalive_timeout 120s;
  client_body_temp_path {self.dir}; proxy_temp_path {self.dir}; fastcgi_temp_path {self.dir};
  uwsgi_temp_path {self.dir}; scgi_temp_path {self.dir};
  server {{ listen {LOOPBACK}:{self.port}; root {Path(root).resolve()}; {f"limit_rate {limit_rate};" if limit_rate else ""} }}
}}"""
        (self.dir / "nginx.conf").write_text(conf)
        self.proc = subprocess.Popen([binary, "-c", str(self.dir / "nginx.conf"), "-p", str(self.dir)],
                                     stdout=subprocess.DEVNULL, stderr=tempfile.TemporaryFile())
        _wait_listening(self.port, self.proc)
        self.url = f"http://{LOOPBACK}:{self.port}"

    @property
    def bytes_served(self) -> int:
        """Body bytes nginx has logged as sent (ranged answers included)."""
        if not self.log.exists():
            return 0
        return sum(int(x) for x in self.log.read_text().split() if x.isdigit())

    def reset(self) -> None:
        """Start counting served bytes anew."""
        self.log.write_text("")
        subprocess.run(["kill", "-USR1", str(self.proc.pid)], check=False)  # reopen the log

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


class _RangeHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_RangeHTTPServer"

    def log_message(self, *args) -> None:
        pass

    def setup(self) -> None:
        """No Nagle wait: a body sent after the headers would wait for the client's delayed ACK (~40 ms)."""
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_GET(self) -> None:  # noqa: N802
        srv = self.server
        if self.path in ("/_served", "/_reset"):
            with srv.lock:
                if self.path == "/_reset":
                    srv.bytes_served = 0
                body = str(srv.bytes_served).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if srv.latency:
            time.sleep(srv.latency)
        path = srv.root / self.path.lstrip("/").split("?")[0]
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        try:
            size = os.fstat(fd).st_size
            m = _RANGE.fullmatch(self.headers.get("Range", "").strip())
            first, last = (int(m.group(1)), int(m.group(2)) if m.group(2) else size - 1) if m else (0, size - 1)
            last = min(last, size - 1)
            if m and first >= size:
                self.send_response(416)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206 if m else 200)
            if m:
                self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            self.send_header("Content-Length", str(last - first + 1))
            self.end_headers()
            self.wfile.flush()
            sent, want = 0, last - first + 1
            while sent < want:
                n = os.sendfile(self.connection.fileno(), fd, first + sent, want - sent)
                if n == 0:
                    break
                sent += n
            with srv.lock:
                srv.bytes_served += sent
        finally:
            os.close(fd)


class _RangeHTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256
    allow_reuse_address = True

    def handle_error(self, request, client_address) -> None:
        """Silent when the client hung up (a reader stopped with GETs in flight); else the usual report."""
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class RangeServer:
    """Serves the files under ``root`` on a free loopback port, waiting ``latency`` s before every answer.

    The server runs in a process of its own (so its threads never take the measured process's
    interpreter); GET /_served answers its count of body bytes served, /_reset zeroes it.
    """

    def __init__(self, root: str | Path, latency: float = 0.0):
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, __file__, "range", str(Path(root).resolve()), str(latency),
                                      str(self.port)], stdout=subprocess.DEVNULL,
                                     stderr=tempfile.TemporaryFile())  # never a pipe no one reads: it would fill
        _wait_listening(self.port, self.proc)
        self.url = f"http://{LOOPBACK}:{self.port}"

    @property
    def bytes_served(self) -> int:
        return int(_admin(self.port, "/_served"))

    def reset(self) -> None:
        _admin(self.port, "/_reset")

    def close(self) -> None:
        _stop(self.proc)


def _admin(port: int, path: str) -> str:
    """GET an admin path of a server of ours on ``port``; its body."""
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _serve_range(root: str, latency: float, port: int) -> None:
    """The RangeServer's process: serve until terminated."""
    httpd = _RangeHTTPServer((LOOPBACK, port), _RangeHandler)
    httpd.root, httpd.latency = Path(root), latency
    httpd.lock, httpd.bytes_served = threading.Lock(), 0
    httpd.serve_forever(poll_interval=0.05)


class LatencyProxy:
    """A TCP proxy to ``upstream`` (host, port) that holds each request ``latency`` s before passing it on.

    A request is what the client sends after the last answer began: the first bytes the client sends
    after the server has spoken (or on a new connection) wait ``latency`` seconds, so every request,
    keep-alive or not, sees the latency once before its first byte of answer.
    """

    def __init__(self, upstream: tuple[str, int], latency: float):
        self.upstream, self.latency = upstream, latency
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((LOOPBACK, 0))
        self.sock.listen(256)
        self.port = self.sock.getsockname()[1]
        self.closed = False
        self.bytes_served = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        server = socket.create_connection(self.upstream)
        answered = threading.Event()
        answered.set()

        def up() -> None:  # client -> server, a wait before each request
            try:
                while data := client.recv(1 << 16):
                    if answered.is_set():
                        answered.clear()
                        time.sleep(self.latency)
                    server.sendall(data)
            except OSError:
                pass
            finally:
                _shut(server)

        threading.Thread(target=up, daemon=True).start()
        try:
            while data := server.recv(1 << 18):
                answered.set()
                with self.lock:
                    self.bytes_served += len(data)
                client.sendall(data)
        except OSError:
            pass
        finally:
            _shut(client)
            server.close()
            client.close()

    def reset(self) -> None:
        with self.lock:
            self.bytes_served = 0

    def close(self) -> None:
        self.closed = True
        self.sock.close()


def _shut(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _wait_listening(port: int, proc: subprocess.Popen, seconds: float = 10.0) -> None:
    """Return once something listens on ``port``; RuntimeError with its stderr if ``proc`` exits first."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {' '.join(map(str, proc.args))}")
        with socket.socket() as s:
            if s.connect_ex((LOOPBACK, port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {seconds} s")


if __name__ == "__main__":
    if sys.argv[1] == "range":
        _serve_range(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
