"""Reads from a store that answers late keep enough GETs in flight, within their bounds, and back off when told.

Against the loopback HTTP server (tests/servers.py), which can wait before every answer and
answer 503 (S3's SlowDown) to GETs beyond a number in flight. A reader's blocks are read with
its BlockReader, as a stream reads them, and every window is compared with the same block
read from the local files: the depth of the reads never changes a byte.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

import streamwin as sw
import streamwin.read.fetch as sw_fetch
import streamwin.read.remote as sw_remote
from servers import FaultPlan
from streamwin.nodes import BlockReader


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(folder, dataset name): 40 sequences of 20,000 steps x 8 float32 (25.6 MB); blocks of about 1 MB."""
    root = tmp_path_factory.mktemp("remote")
    rng = np.random.default_rng(0)
    seqs = [(f"s{i:02d}", rng.standard_normal((20_000, 8), dtype=np.float32)) for i in range(40)]
    sw.pack(seqs, str(root / "ds"), shard_bytes=4 << 20, progress=False)
    return root


def read_blocks(url: str, **kw) -> tuple[list[list[bytes]], object]:
    """Every block of one stream's epoch as its windows' bytes, read by a BlockReader that spends 5 ms on each
    (as a batcher would: the read-ahead is sized by that rate); and its ShardReader."""
    ds = sw.WindowDataset(url, window=128, stride=64, batch_size=64, shuffle_buffer=512, seed=1, **kw,
                          order=sw.Order(canonical=None))
    reader = ds.sources[0].reader()
    blocks = epoch_blocks(ds, reader)
    reader.shutdown()
    return blocks, reader


def epoch_blocks(ds, reader) -> list[list[bytes]]:
    """Every block of stream 0 of epoch 0 of ``ds`` as its windows' bytes, read with ``reader`` by a BlockReader
    that spends 5 ms on each."""
    plan = ds.plan(0, 0).sources[0]
    span = plan.config.spec.span * ds.manifest.step_bytes
    node = BlockReader(reader, plan, 0, readahead=1)
    node.reset()
    blocks = []
    for b in node:
        blocks.append([b.buf[o : o + span].tobytes() for o in b.offs.tolist()])
        node.release(b)
        time.sleep(0.005)
    node.shutdown()
    return blocks


def block_bytes(reader) -> float:
    return reader.readahead.block_bytes


def test_the_read_ahead_grows_with_latency_and_stays_within_readahead_bytes(corpus, http_server):
    local, _ = read_blocks(str(corpus / "ds"))
    assert len(local) > 20
    # (a server each: what a process measured of a source, by its URL, it keeps for the next epoch)
    got, at_once = read_blocks(http_server(corpus).url_for("ds"))
    assert got == local
    srv = http_server(corpus, FaultPlan(latency_seconds=0.1))
    got, late = read_blocks(srv.url_for("ds"))
    assert got == local
    # 100 ms before every answer: the bytes read ahead grow to rate x latency, many blocks; at once, fewer do
    # (how many fewer depends on how fast this machine batches and reads, so only the order is asserted)
    assert late.readahead.peak_bytes >= 4 * block_bytes(late)
    assert late.readahead.peak_bytes > at_once.readahead.peak_bytes
    assert srv.stats.most_in_flight > 2
    limit = int(3 * block_bytes(late))
    got, bounded = read_blocks(http_server(corpus, FaultPlan(latency_seconds=0.1)).url_for("ds"),
                               read=sw.Read(readahead_bytes=limit))
    assert got == local
    assert bounded.readahead.peak_bytes <= limit + 0.5 * block_bytes(bounded)  # (block sizes vary a little)


def test_gets_in_flight_never_exceed_the_connections(corpus, http_server, monkeypatch):
    local, _ = read_blocks(str(corpus / "ds"))
    monkeypatch.setattr(sw_remote, "CONNECTIONS", 3)
    monkeypatch.setattr(sw_fetch, "PART_BYTES", 128 << 10)  # many parts a block: far more than 3 to send
    srv = http_server(corpus, FaultPlan(latency_seconds=0.05))
    got, reader = read_blocks(srv.url_for("ds"))
    assert got == local
    assert srv.stats.most_in_flight == 3 and reader.shards.throttle.peak == 3


def test_a_store_that_says_slow_down_gets_fewer_gets_then_as_many_again(corpus, http_server, monkeypatch):
    """503 to any GET beyond 4 in flight: the GETs in flight are halved down to about 4 and every window is read
    right; once the store stops, they grow back to all the connections."""
    local, _ = read_blocks(str(corpus / "ds"))
    monkeypatch.setattr(sw_fetch, "PART_BYTES", 64 << 10)  # ~400 GETs an epoch
    monkeypatch.setattr(sw_remote, "CONNECTIONS", 16)  # (grown back in a few hundred GETs)
    srv = http_server(corpus, FaultPlan(latency_seconds=0.02, busy_above=4))
    ds = sw.WindowDataset(srv.url_for("ds"), window=128, stride=64, batch_size=64, shuffle_buffer=512, seed=1,
                          order=sw.Order(canonical=None), read=sw.Read(retry_backoff=0.01, retries=8))
    reader = ds.sources[0].reader()

    def epoch() -> list[list[bytes]]:
        return epoch_blocks(ds, reader)
    assert epoch() == local
    throttle = reader.shards.throttle
    assert srv.stats.busy_answers > 0 and reader.stats.throttled == srv.stats.busy_answers
    assert throttle.lowest <= 4
    assert srv.stats.busy_answers < srv.stats.get_requests / 4  # backed off: most GETs were answered
    srv.set_faults(FaultPlan(latency_seconds=0.02))
    for _ in range(3):
        assert epoch() == local
    assert throttle.allowed == throttle.most == sw_remote.CONNECTIONS
    reader.shutdown()


def test_epoch_after_epoch_the_next_ones_first_blocks_are_read_before_it_begins(corpus, http_server):
    """In a process that reads epoch after epoch, a stream's end starts the next epoch's first blocks (no barrier at
    an epoch's end); the batches are the local ones, bitwise. A process starts doing so once it went on from one
    epoch to the next: a single epoch (or the first of a worker that is not kept) reads nothing it may not need."""
    def epochs(url: str, n: int, workers: int) -> tuple[list[bytes], list[int]]:
        loader = sw.WindowLoader(sw.WindowDataset(url, window=128, stride=64, batch_size=64, shuffle_buffer=512,
                                                  seed=1), num_workers=workers, persistent_workers=workers > 0)
        out, early = [], []
        for e in range(n):
            loader.set_epoch(e)
            out += [b["x"].numpy().tobytes() + "".join(b["key"]).encode() for b in loader]
            early.append(loader.stats()["early_blocks"])
        loader.close()
        return out, early
    local, _ = epochs(str(corpus / "ds"), 3, 0)
    url = http_server(corpus, FaultPlan(latency_seconds=0.05)).url_for("ds")
    for workers in (0, 1):
        got, early = epochs(url, 3, workers)
        assert got == local
        assert early[0] == early[1] == 0 < early[2]  # (totals: epoch 1 followed epoch 0, so epoch 2's were early)


def test_a_cold_cache_fetches_a_shard_as_parts_in_flight_together_resuming_a_broken_get(corpus, http_server,
                                                                                      tmp_path, monkeypatch):
    """The node cache fetches a remote shard whole: as parts with many GETs in flight (not one stream that waits
    a round trip a read), each byte served about once, a GET that breaks resumed at its byte; the copies verified,
    the windows the local ones; the next epoch reads the copies, nothing from the server."""
    local, _ = read_blocks(str(corpus / "ds"))
    monkeypatch.setattr(sw_fetch, "PART_BYTES", 256 << 10)  # a 4 MB shard in 16 parts
    srv = http_server(corpus, FaultPlan(latency_seconds=0.05, drop_every_bytes=3 << 20))
    cache = tmp_path / "cache"
    got, reader = read_blocks(srv.url_for("ds"), read=sw.Read(cache_dir=str(cache)))
    assert got == local
    m = sw.load_manifest(str(corpus / "ds"))
    whole = sum(s.bytes for s in m.shards) + sum((corpus / "ds" / (s.name + m.checks.suffix)).stat().st_size
                                                 for s in m.shards)
    copies = [p for p in cache.iterdir() if p.name.endswith("_tar")]  # (named by a hash of the URL, its dots _)
    assert len(copies) == len(m.shards) and all(p.stat().st_size in {s.bytes for s in m.shards} for p in copies)
    assert srv.stats.drops > 0 and srv.stats.most_in_flight > 4
    assert srv.stats.bytes_served <= whole + (srv.stats.drops + srv.stats.get_requests) * (64 << 10)  # ~once
    srv.reset_stats()
    again, _ = read_blocks(srv.url_for("ds"), read=sw.Read(cache_dir=str(cache)))
    assert again == local and srv.stats.bytes_served < (1 << 20)  # the index only


def test_a_streams_first_block_starts_alone_though_the_last_stream_read_far_ahead(corpus, http_server):
    """The next epoch's stream of a source keeps what the last one measured (far ahead at 100 ms) but starts its
    first blocks alone: started with many after it, the first block would share the store's bandwidth with all of
    them and the first batch would come last."""
    srv = http_server(corpus, FaultPlan(latency_seconds=0.1))
    ds = sw.WindowDataset(srv.url_for("ds"), window=128, stride=64, batch_size=64, shuffle_buffer=512, seed=1,
                          order=sw.Order(canonical=None))
    reader = ds.sources[0].reader()
    local, _ = read_blocks(str(corpus / "ds"))
    assert epoch_blocks(ds, reader) == local
    ahead = reader.readahead
    assert ahead.want >= 4 * ahead.block_bytes  # the last stream ended far ahead
    events: list[str] = []
    started, taken = ahead.started, ahead.taken
    ahead.started = lambda: (events.append("start"), started())[1]
    ahead.taken = lambda *a: (events.append("take"), taken(*a))[1]
    assert epoch_blocks(ds, reader) == local
    first_take = events.index("take")
    assert 1 <= events[:first_take].count("start") <= 2  # the first block and the one always read ahead
    assert events.count("start") >= len(local) - 2 and ahead.peak_bytes >= 4 * ahead.block_bytes
    reader.shutdown()
