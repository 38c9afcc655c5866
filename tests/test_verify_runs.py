"""A read of a long run verified where it lies: a changed byte anywhere in it is caught, to the chunk.

A run of a long sequence is verified block by block (one xxh3 call per 256 KiB it covers whole)
and chunk by chunk at its ends, straight from its mapping (its page tables filled by the mapping
call, which holds no GIL). Here one byte is flipped in the shard file, in
turn in the run's first chunk (which it covers only in part), its last chunk, a chunk of a
whole block, and the chunks on either side of a sums page boundary (4 MiB of shard; with the
pages read one at a time, so the run's sums come from two reads). Each time, the reference,
computed here from the byte's offset and the windows' steps alone, says which windows have a
step in the damaged chunk: with on_error="skip" exactly those weigh 0 and every other window is
exact; with "raise" the ShardError names the chunk's first byte the read needed.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest

import streamwin as sw
from conftest import flip_byte
from streamwin.formats import sums
from streamwin.read import ReadOptions, ShardReader
from streamwin.read import sums as read_sums
from streamwin.storage import mapped

pytestmark = pytest.mark.timeout(180)
W, S, F = 64, 48, 2  # window, stride (steps), features (float32): 8 bytes a step
STEPS = 700_000  # 5.6 MB a sequence: two of them put runs across sums pages (4 MiB of shard each)
C, PAGE_SPAN = sums.CHUNK, sums.BLOCK * sums.PAGE_BLOCKS


@pytest.fixture(scope="module")
def long_runs(tmp_path_factory):
    """(url, sequences, manifest) of one shard of two long sequences (values encode sequence and step)."""
    seqs = {f"s{i}": (np.arange(STEPS, dtype=np.float64)[:, None] * 10 + i + np.zeros((1, F))).astype(np.float32)
            for i in range(2)}
    url = tmp_path_factory.mktemp("runs") / "ds"
    m = sw.pack(list(seqs.items()), str(url), shard_bytes=1 << 30, progress=False)
    assert len(m.shards) == 1 and m.checks.in_files and m.shards[0].bytes > 2 * PAGE_SPAN
    return url, seqs, m


class Slice:
    """A plan whose one block is windows [w0, w1) of sequence ``i`` (stride S): one run of the shard."""

    def __init__(self, ds, i: int, w0: int, w1: int):
        self.config = ds.plan(0, 0).sources[0].config
        self.i, self.w0, self.w1, self.length = i, w0, w1, ds.manifest.length

    def block_parts(self, stream, block):
        g = np.arange(self.w1 - self.w0)
        return g, np.ones(len(g), dtype=bool), None

    def locate(self, g):
        return np.full(len(g), self.i), (self.w0 + g) * S

    def ends(self, seq):
        return self.length[seq]


flip = partial(flip_byte, mask=0x20)


def run_bytes(m, i: int, w0: int, w1: int) -> tuple[int, int]:
    """Shard bytes [lo, hi) that windows [w0, w1) of sequence i cover: the run a block of them reads."""
    data0, sb = int(m.offset[i] + m.hlen[i]), m.step_bytes
    return data0 + w0 * S * sb, data0 + ((w1 - 1) * S + W) * sb


def read(url, m, ds, i, w0, w1, on_error):
    reader = ShardReader(str(url), m, ReadOptions(on_error=on_error))
    try:
        block = reader.read_block(Slice(ds, i, w0, w1), 0, 0)
        x = np.stack([block.buf[o : o + W * m.step_bytes].view(np.float32).reshape(W, F) for o in block.offs.tolist()])
        return block.real.copy(), x, reader.stats
    finally:
        reader.shutdown()


# windows [w0, w1) of sequence 1 (its bytes start past the first sums page): a run of ~2.9 MB across a page
# boundary; where in it the byte is flipped
W0, W1 = 1_000, 8_500
PLACES = ["first chunk", "last chunk", "whole block", "before page boundary", "after page boundary"]


def place(m, where: str) -> int:
    lo, hi = run_bytes(m, 1, W0, W1)
    boundary = -(-lo // PAGE_SPAN) * PAGE_SPAN
    assert lo < boundary - C and boundary + C < hi, "the run must cross a sums page boundary"
    return {"first chunk": lo + 5, "last chunk": hi - 3, "whole block": -(-lo // sums.BLOCK) * sums.BLOCK + 77_777,
            "before page boundary": boundary - 1, "after page boundary": boundary}[where]


@pytest.mark.parametrize("pages", [read_sums.READ_PAGES, 1], ids=["pages-grouped", "pages-one-by-one"])
@pytest.mark.parametrize("where", PLACES)
def test_a_flipped_byte_anywhere_in_a_long_run_is_caught_to_the_chunk(long_runs, tmp_path, monkeypatch, where,
                                                                       pages):
    src, seqs, m = long_runs
    url = tmp_path / "ds"
    url.mkdir()
    for p in src.iterdir():
        (url / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(read_sums, "READ_PAGES", pages)
    at = place(m, where)
    flip(url / m.shards[0].name, at)
    ds = sw.WindowDataset(str(url), window=W, stride=S, batch_size=8, order=sw.Order(shuffle=False))
    # the reference: a window is lost iff one of its steps has a byte in the damaged chunk
    data0, sb = int(m.offset[1] + m.hlen[1]), m.step_bytes
    c0 = at // C * C
    s0, s1 = (c0 - data0) // sb, -(-(c0 + C - data0) // sb)
    starts = np.arange(W0, W1) * S
    lost = (starts < s1) & (starts + W > s0)
    assert 0 < lost.sum() < len(lost)

    with pytest.warns(RuntimeWarning, match="checksum mismatch"):
        real, x, stats = read(url, m, ds, 1, W0, W1, "skip")
    assert np.array_equal(~real, lost) and stats.skipped_ranges == 1
    want = np.stack([seqs["s1"][s : s + W] for s in starts.tolist()])
    assert np.array_equal(x[~lost], want[~lost]) and not x[lost].any()

    with pytest.raises(sw.ShardError, match="checksum mismatch") as e:
        read(url, m, ds, 1, W0, W1, "raise")
    needed = max(c0, run_bytes(m, 1, W0, W1)[0])
    assert e.value.offset == needed and e.value.member == f"{m.key(1)}.npy"


def test_an_undamaged_long_run_reads_exact_and_verifies_each_byte_once(long_runs):
    url, seqs, m = long_runs
    ds = sw.WindowDataset(str(url), window=W, stride=S, batch_size=8, order=sw.Order(shuffle=False))
    real, x, stats = read(url, m, ds, 1, W0, W1, "raise")
    lo, hi = run_bytes(m, 1, W0, W1)
    assert real.all() and np.array_equal(x, np.stack([seqs["s1"][s : s + W] for s in range(W0 * S, (W1 - 1) * S + 1, S)]))
    # whole chunks, each once: from the chunk boundary before the run's first byte to the one after its last
    assert stats.bytes_verified == -(-hi // C) * C - lo // C * C


@pytest.mark.skipif(not mapped.available(), reason="no MAP_FIXED here")
def test_a_mapping_holds_the_file_bytes(long_runs):
    url, seqs, m = long_runs
    path = url / m.shards[0].name
    want = np.fromfile(path, dtype=np.uint8, count=3 * mapped.PAGE + 100, offset=5 * mapped.PAGE)
    buf = mapped.MappedBuffer(5 * mapped.PAGE)
    with open(path, "rb") as f:
        buf.map_file(mapped.PAGE, f.fileno(), 5 * mapped.PAGE, len(want))
    got = buf.array()
    assert np.array_equal(got[mapped.PAGE : mapped.PAGE + len(want)], want) and not got[: mapped.PAGE].any()
