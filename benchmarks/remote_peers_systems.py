"""The systems of remote_peers.py, each reading the corpus from a loopback server: how each builds its loader.

A job (a dict the parent sends as JSON) names the system and where its data is: ``url`` (the
dataset's URL on the server), ``shard_urls`` (webdataset), ``endpoint`` (the S3 endpoint, a
LatencyProxy in front of moto), ``cache_dir`` (an empty directory for a cold cache, a filled one
for a warm cache). Every system cuts W=128, stride 64 windows into batches of 256 out of a
20,000-window shuffle pool (its own, or :class:`~peers_systems.WindowPool`):

- ``streamwin-http`` / ``streamwin-s3``: ``WindowDataset(url, ...)`` + ``WindowLoader(ds, num_workers)``;
  over s3 with ``storage_options`` naming the endpoint; ``-cold`` / ``-warm``: with ``cache_dir``.
- ``webdataset-http``: peers_systems.py's WebDataset pipeline on ``http://`` URLs of the same tar
  files (webdataset streams each shard with one GET through ``curl``).
- ``mosaic-s3``: ``StreamingDataset(remote="s3://...", local=<empty dir>, shuffle=True)`` of the
  mosaic-seqs MDS copy (one sample a sequence), in a WindowPool; endpoint from ``S3_ENDPOINT_URL``.
- ``litdata-s3``: ``StreamingDataset("s3://...", cache_dir=<empty dir>, shuffle=True,
  storage_options={"endpoint_url": ...})`` of the litdata-seqs copy, in a WindowPool.

This module is imported by the child processes, in whichever interpreter has the system's package
(the peers' own venv for Mosaic and LitData), so it imports no streamwin at module level.
"""
from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from peers_systems import Params, PoolLoader, WindowPool

#: The issue's windows: W=128, stride 64, batches of 256, a 20,000-window shuffle pool, seed 0.
PARAMS = Params(window=128, stride=64, batch_size=256, shuffle_buffer=20_000, seed=0)
#: Credentials moto accepts (tests/servers.py).
S3_KEY, S3_SECRET, S3_REGION = "testing", "testing", "us-east-1"


@dataclass(frozen=True)
class RemoteSystem:
    """One system in one set-up: its name, the store it reads (http or s3), what it needs, how it builds."""

    name: str
    store: str  # "http" or "s3"
    setup: str  # the set-up in a few words, for the table
    modules: tuple[str, ...]
    install: str
    build: Callable[[dict[str, Any], int], Iterable[Any]]
    cache: str = ""  # "", "cold" or "warm": the node cache streamwin is given
    converted: str = ""  # the peers_formats set-up whose copy it reads ("" = the tar shards)
    load: Callable[[], None] | None = None  # imports its modules its own way (default: importlib)

    def import_modules(self) -> None:
        """Import what ``build`` imports, before the clock starts: a trainer has imported its loader already."""
        if self.load is not None:
            self.load()
            return
        for module in self.modules:
            importlib.import_module(module)


def _streamwin(job: dict[str, Any], workers: int) -> Iterable[Any]:
    import streamwin as sw  # noqa: PLC0415

    p = PARAMS
    read = sw.Read(cache_dir=job.get("cache_dir") or None,
                   storage_options=s3fs_options(job["endpoint"]) if job.get("endpoint") else None)
    ds = sw.WindowDataset(job["url"], window=p.window, stride=p.stride, batch_size=p.batch_size,
                          shuffle_buffer=p.shuffle_buffer, seed=p.seed, read=read)
    return sw.WindowLoader(ds, num_workers=workers)


def s3fs_options(endpoint: str) -> dict[str, Any]:
    """fsspec's storage_options for the loopback S3 endpoint (tests/servers.py's s3_storage_options)."""
    return {"key": S3_KEY, "secret": S3_SECRET, "client_kwargs": {"endpoint_url": endpoint, "region_name": S3_REGION}}


def _webdataset(job: dict[str, Any], workers: int) -> Iterable[Any]:
    import webdataset as wds  # noqa: PLC0415

    from baselines import cut_windows  # noqa: PLC0415

    p, urls = PARAMS, job["shard_urls"]
    dataset = (wds.WebDataset(urls, shardshuffle=len(urls), seed=p.seed, nodesplitter=wds.split_by_node,
                              workersplitter=wds.split_by_worker, empty_check=False)
               .decode().compose(cut_windows(p.window, p.stride))
               .shuffle(p.shuffle_buffer, seed=p.seed).batched(p.batch_size))
    return wds.WebLoader(dataset, batch_size=None, num_workers=workers)


def _s3_environment(endpoint: str) -> None:
    """The AWS variables boto3 (Mosaic) and obstore (LitData) read: moto's credentials and region."""
    os.environ.update(AWS_ACCESS_KEY_ID=S3_KEY, AWS_SECRET_ACCESS_KEY=S3_SECRET, AWS_DEFAULT_REGION=S3_REGION,
                      AWS_REGION=S3_REGION, S3_ENDPOINT_URL=endpoint, AWS_ENDPOINT_URL=endpoint,
                      AWS_ALLOW_HTTP="true")


def _load_streaming() -> None:
    from peers_formats import _import_streaming  # noqa: PLC0415

    _import_streaming()
    importlib.import_module("boto3")


def _mosaic(job: dict[str, Any], workers: int) -> Iterable[Any]:
    from peers_formats import _import_streaming  # noqa: PLC0415

    _s3_environment(job["endpoint"])
    _import_streaming()
    from streaming import StreamingDataset  # noqa: PLC0415

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    p = PARAMS
    dataset = StreamingDataset(remote=job["url"], local=job["cache_dir"], shuffle=True, shuffle_seed=p.seed,
                               batch_size=1)
    return PoolLoader(WindowPool(dataset, p, "x", lambda taken: None, lambda state: None), workers)


def _litdata(job: dict[str, Any], workers: int) -> Iterable[Any]:
    _s3_environment(job["endpoint"])
    from litdata import StreamingDataset  # noqa: PLC0415
    from litdata.streaming import downloader  # noqa: PLC0415

    # LitData GETs its chunks through obstore with client options of its own, which replace the
    # ones obstore reads from the environment (AWS_ALLOW_HTTP) and lack allow_http, so obstore
    # refuses the loopback endpoint's http:// ("builder error: BadScheme"); an https:// store
    # needs no such option. This one key is all that is changed: the reads are LitData's own.
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"

    p = PARAMS
    options = {"endpoint_url": job["endpoint"], "aws_access_key_id": S3_KEY, "aws_secret_access_key": S3_SECRET,
               "region_name": S3_REGION}
    dataset = StreamingDataset(job["url"], cache_dir=job["cache_dir"], shuffle=True, seed=p.seed,
                               storage_options=options)
    return PoolLoader(WindowPool(dataset, p, None, lambda taken: None, lambda state: None), workers)


_SW = ("streamwin",), "pip install -e ."
_PEERS = "$PEERS_VENV/bin/python -m pip install mosaicml-streaming litdata (benchmarks/README.md, Installing the peers)"
SYSTEMS = [
    RemoteSystem("streamwin-http", "http", "ranged GETs, no node cache", *_SW, _streamwin),
    RemoteSystem("streamwin-http-cold", "http", "cache_dir= empty: whole shards fetched, then read locally",
                 *_SW, _streamwin, cache="cold"),
    RemoteSystem("streamwin-http-warm", "http", "cache_dir= filled by a previous epoch", *_SW, _streamwin,
                 cache="warm"),
    RemoteSystem("webdataset-http", "http", "whole shard a GET (curl), decode, cut, shuffle, batched",
                 ("webdataset",), "pip install webdataset", _webdataset),
    RemoteSystem("streamwin-s3", "s3", "s3:// ranged GETs, no node cache", *_SW, _streamwin),
    RemoteSystem("mosaic-s3", "s3", "MDS, a sample a sequence; local= empty; windows cut in a pool",
                 ("streaming", "boto3"), _PEERS, _mosaic, converted="mosaic-seqs", load=_load_streaming),
    RemoteSystem("litdata-s3", "s3", "optimize() chunks, an item a sequence; cache_dir= empty; windows cut in a pool",
                 ("litdata", "boto3", "obstore"), _PEERS, _litdata, converted="litdata-seqs"),
]


def system_named(name: str) -> RemoteSystem:
    """The system called ``name``."""
    return {s.name: s for s in SYSTEMS}[name]


def measure(job: dict[str, Any]) -> dict[str, Any]:
    """Windows/s from iter() to the epoch's end, or ``seconds`` after the first batch; first batch from construction
    (the system's modules imported before).

    The first batch's wait is inside the rate (what a trainer gets over the span); the rate after
    it is kept apart. ``fill`` jobs run the epoch to its end untimed (a warm cache's previous run)."""
    from baselines import batch_tensor  # noqa: PLC0415

    system = system_named(job["system"])
    system.import_modules()
    constructed = time.perf_counter()
    loader = system.build(job, job["workers"])
    setup_s = time.perf_counter() - constructed
    windows = batches = 0
    first_at, first_windows, full = 0.0, 0, True
    started = time.perf_counter()
    for batch in loader:
        x = batch_tensor(batch)
        windows += int(x.shape[0])
        batches += 1
        float(x[0, 0, 0])
        now = time.perf_counter()
        if not first_at:
            first_at, first_windows = now, windows
        if job.get("seconds") and now - first_at >= job["seconds"]:
            full = False
            break
    ended = time.perf_counter()
    after = ended - (first_at or ended)
    return {"windows_per_s": windows / max(ended - started, 1e-9), "windows": windows, "batches": batches,
            "seconds": ended - started, "setup_s": setup_s, "first_batch_s": (first_at or ended) - constructed,
            "after_first_windows_per_s": (windows - first_windows) / after if after > 0 else None,
            "full_epoch": full}


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """A child's job: ``rate`` or ``fill`` (both :func:`measure`), or ``clean`` (Mosaic's shared memory)."""
    if job["kind"] == "clean":
        from peers_formats import _import_streaming  # noqa: PLC0415

        _import_streaming()
        from streaming.base.util import clean_stale_shared_memory  # noqa: PLC0415

        clean_stale_shared_memory()
        return {"cleaned": True}
    if job.get("cache_dir"):
        Path(job["cache_dir"]).mkdir(parents=True, exist_ok=True)
    return measure(job)
