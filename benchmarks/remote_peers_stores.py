"""What remote_peers.py reads from: the corpus, the peers' converted copies, and the loopback servers.

- The corpus: issue 42's, 1,500 sequences of 500-20,000 steps x 8 float32, 507 MB in
  32 MB shards, packed by ``streamwin.pack`` (``--quick``: its first 150 sequences in 8 MB shards).
  Each sequence comes from an RNG keyed by its index, so a corpus written here holds the same bytes
  wherever it is written.
- The copies: Mosaic's and LitData's "a sequence a record" set-ups (peers_formats.py's mosaic-seqs
  and litdata-seqs), converted once by peers.py's own child in the interpreter that has the peer,
  reused while a marker says they were made from the same index.json.
- The servers: per latency, a :class:`RangeServer` over the corpus's directory (streamwin and
  webdataset over HTTP) and a :class:`LatencyProxy` in front of one moto S3 server (tests/servers.py)
  holding the corpus and both copies in one bucket (streamwin, Mosaic and LitData over s3).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _path in (HERE, REPO / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from children import run_child  # noqa: E402
from remote_peers_systems import PARAMS  # noqa: E402
from remote_servers import LOOPBACK, LatencyProxy, RangeServer  # noqa: E402

#: The issue's corpus: sequences, shard size; the --quick corpus keeps the first QUICK_SEQS.
CORPUS_SEQS, CORPUS_SHARD_BYTES = 1_500, 32 << 20
QUICK_SEQS, QUICK_SHARD_BYTES = 150, 8 << 20
BUCKET = "remote-peers"


def write_corpus(path: Path, n_seqs: int, shard_bytes: int) -> None:
    """Pack the first ``n_seqs`` sequences of the issue's corpus into ``path`` (replacing what is there)."""
    import numpy as np  # noqa: PLC0415

    import streamwin as sw  # noqa: PLC0415

    lengths = np.random.default_rng(0).integers(500, 20_001, size=CORPUS_SEQS)[:n_seqs]

    def sequences():
        for i, steps in enumerate(lengths):
            yield f"s{i:05d}", np.random.default_rng([1, i]).standard_normal((int(steps), 8), dtype=np.float32)

    sw.pack(sequences(), str(path), shard_bytes=shard_bytes, progress=False, overwrite=True)


def ensure_corpus(path: Path, quick: bool) -> Path:
    """The corpus at ``path``, written first if it has no index.json."""
    if not (path / "index.json").exists():
        print(f"[remote_peers] writing the corpus to {path} ...", file=sys.stderr, flush=True)
        write_corpus(path, *((QUICK_SEQS, QUICK_SHARD_BYTES) if quick else (CORPUS_SEQS, CORPUS_SHARD_BYTES)))
    return path.resolve()


def corpus_id(corpus: Path) -> str:
    """A short hash of the corpus's index.json: which corpus a copy or a cache was made from."""
    return hashlib.sha256((corpus / "index.json").read_bytes()).hexdigest()[:16]


def ensure_copy(setup: str, python: str, corpus: Path, work: Path, timeout: float) -> Path:
    """peers_formats' ``setup`` copy of the corpus under ``work/copies`` (converted by ``python`` once)."""
    store = work / "copies" / corpus_id(corpus) / setup
    marker = store.with_suffix(".json")
    if marker.exists() and store.is_dir():
        return store
    shutil.rmtree(store, ignore_errors=True)
    store.parent.mkdir(parents=True, exist_ok=True)
    job = {"kind": "prepare", "system": setup, "corpus": str(corpus), "store": str(store), "params": asdict(PARAMS)}
    print(f"[remote_peers] converting the corpus for {setup} ...", file=sys.stderr, flush=True)
    run = run_child([python, str(HERE / "peers.py"), "--child", json.dumps(job)], timeout, cwd=str(REPO))
    if run.record is None or "error" in run.record:
        raise RuntimeError(f"converting for {setup} failed (exit {run.returncode}): {run.stderr[-1500:]}")
    marker.write_text(json.dumps({"corpus": str(corpus), **run.record}))
    return store


def upload_tree(client: Any, directory: Path, prefix: str) -> int:
    """Put every file under ``directory`` into the bucket under ``prefix``; bytes uploaded."""
    total = 0
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        with path.open("rb") as body:
            client.put_object(Bucket=BUCKET, Key=f"{prefix}/{path.relative_to(directory).as_posix()}", Body=body)
        total += path.stat().st_size
    return total


class Servers:
    """One RangeServer and one LatencyProxy (to moto) per latency, up for the whole run.

    ``s3_trees`` maps a key prefix to the directory uploaded under it (none: no S3 server)."""

    def __init__(self, corpus: Path, latencies_ms: list[int], s3_trees: dict[str, Path]):
        self.corpus = corpus
        self.http = {ms: RangeServer(corpus.parent, ms / 1000) for ms in latencies_ms}
        self.moto, self.proxies, self.uploaded = None, {}, 0
        if s3_trees:
            from servers import start_moto  # noqa: PLC0415

            self.moto = start_moto()
            self.moto.make_bucket(BUCKET)
            client = _s3_client(self.moto.endpoint_url)
            self.uploaded = sum(upload_tree(client, tree, prefix) for prefix, tree in s3_trees.items())
            host, port = self.moto.endpoint_url.rsplit("//", 1)[1].split(":")
            self.proxies = {ms: LatencyProxy((host, int(port)), ms / 1000) for ms in latencies_ms}

    def where(self, store: str, latency_ms: int, prefix: str) -> dict[str, Any]:
        """The job's fields naming the data: ``url`` (and ``shard_urls``, or ``endpoint``)."""
        if store == "http":
            base = f"{self.http[latency_ms].url}/{self.corpus.name}"
            shards = sorted(p.name for p in self.corpus.glob("*.tar"))
            return {"url": base, "shard_urls": [f"{base}/{name}" for name in shards]}
        return {"url": f"s3://{BUCKET}/{prefix}", "endpoint": f"http://{LOOPBACK}:{self.proxies[latency_ms].port}"}

    def server(self, store: str, latency_ms: int) -> Any:
        """The server a case of ``store`` at ``latency_ms`` reads from (its ``bytes_served``, ``reset``)."""
        return self.http[latency_ms] if store == "http" else self.proxies[latency_ms]

    def close(self) -> None:
        for server in [*self.http.values(), *self.proxies.values()]:
            server.close()
        if self.moto is not None:
            self.moto.close()


def _s3_client(endpoint: str) -> Any:
    """A boto3 client of the loopback S3 server (straight to moto: uploads skip the latency)."""
    import boto3  # noqa: PLC0415

    from remote_peers_systems import S3_KEY, S3_REGION, S3_SECRET  # noqa: PLC0415

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET,
                        region_name=S3_REGION)
