"""The crop stage's nodes resume exactly from their state at every step (tests/resume.py): a BlockReader that
cuts its blocks into crops (drawn lengths, packed rows), the Batcher over packed rows of one or two sources,
and torchdata's Prefetcher over it. Their states are cursors: the block index, the batch count."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
from torchdata.nodes import Prefetcher

import streamwin as sw
from resume import assert_resumes_identically
from streamwin.batch import PER_CROP
from streamwin.crop_stage import CropBlock
from streamwin.nodes import BlockReader
from test_nodes import batcher, two  # noqa: F401  (two: the corpora, a fixture)


def dataset(urls, pack_length=None, missing=None, mix=None):
    """Drawn crops (rows of ``pack_length`` when given) of ``urls``, for rank 0 of 2."""
    return sw.WindowDataset(urls if len(urls) > 1 else urls[0], window=8, stride=4, batch_size=3, shuffle_buffer=40,
                            seed=3, rank=0, world_size=2, mix=mix,
                            crops=sw.Crops(min_window=3, jitter=True, pack_length=pack_length, missing=missing))


def digest(batch) -> str:
    """The batch's fields, the per-crop ones cut to its ``crops`` (what follows them is not the batch's)."""
    n = int(batch["crops"][0]) if "crops" in batch else None
    fields = [v[:n] if n is not None and k in PER_CROP else v for k, v in sorted(batch.items())]
    return hashlib.sha256(b"".join(np.ascontiguousarray(v).tobytes() for v in fields)).hexdigest()


def crops(block: CropBlock):
    rows = None if block.row_ptr is None else (block.row_ptr.tolist(), block.offset.tolist())
    return block.start.tolist(), block.length.tolist(), block.seq.tolist(), rows


@pytest.mark.parametrize("pack", [None, 24])
def test_a_cutting_block_reader_resumes_at_every_block(two, pack):
    ds = dataset(two[:1], pack_length=pack)
    schedule = ds.plan(0, 0).schedule(0)
    # the process's first lane of several blocks (a canonical slot of this small global batch may take no item)
    plan, stream = next((schedule.plans[i], s) for i, s in schedule.lanes if schedule.plans[i].num_blocks(s) > 1)
    blocks = assert_resumes_identically(lambda: BlockReader(ds.sources[0].reader(), plan, stream, readahead=2),
                                        crops)
    assert len(blocks) == plan.num_blocks(stream) > 1
    if pack:
        assert [len(b[3][0]) - 1 for b in blocks] == np.diff(plan.item_bounds(stream)).tolist()


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("pack", [None, 24])
def test_the_batcher_over_crops_resumes_at_every_batch(two, mixed, pack):
    ds = dataset(two if mixed else two[:1], pack_length=pack, mix=sw.Mix(weights=[0.7, 0.3]) if mixed else None)
    if pack:  # each of the 2 workers takes several chunks of steps (RowChunkSchedule)
        assert len(ds.plan(1, 2).schedule(1).chunks) > 1
    batches = assert_resumes_identically(lambda: batcher(ds), digest)
    assert len(batches) == ds.plan(1, 2).schedule(1).batches > 3


def test_torchdatas_prefetcher_over_a_packed_batcher_resumes_at_every_batch(two):
    ds = dataset(two, pack_length=24, missing="mask")
    assert len(ds.plan(1, 2).schedule(1).chunks) > 1  # 2 workers, several chunks of steps each
    plain = assert_resumes_identically(lambda: batcher(ds), digest)
    prefetched = assert_resumes_identically(lambda: Prefetcher(batcher(ds), prefetch_factor=2), digest,
                                            shutdown=lambda node: node.source.shutdown())
    assert prefetched == plain
