"""Every stateful stage of the pipeline resumes exactly from its state at every step (tests/resume.py)."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
from torchdata.nodes import Prefetcher

import streamwin as sw
from conftest import make_sequences
from resume import assert_resumes_identically
from streamwin.nodes import Batcher, BlockReader
from streamwin.pipeline import gatherer_of


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    root = tmp_path_factory.mktemp("nodes")
    urls = []
    for name, (n, seed) in {"a": (30, 1), "b": (12, 2)}.items():
        urls.append(str(root / name))
        sw.pack(list(make_sequences(n, seed=seed, max_len=200).items()), urls[-1], shard_bytes=20_000, progress=False)
    return urls


def dataset(urls, canonical=None, equalize="drop", **kw):
    kw = {"horizon": 2, **kw}  # one stream per rank and worker: a lane a source (canonical: below)
    return sw.WindowDataset(urls if len(urls) > 1 else urls[0], window=8, stride=4, batch_size=6,
                            shuffle_buffer=40, seed=3, rank=0, world_size=2,
                            order=sw.Order(canonical=canonical, equalize=equalize), **kw)


def batcher(ds, stream=1, workers=2):
    """Process ``stream``'s Batcher of epoch 1 over its lanes (one block reader each: a stream of each source, or
    its canonical streams'), as pipeline wires it, gathering into fresh buffers."""
    schedule = ds.plan(1, workers).schedule(stream)
    only = schedule.blocks  # a worker's chunks of packed rows: the blocks each lane reads (None: all)
    readers = [BlockReader(ds.sources[i].reader(), schedule.plans[i], c, blocks=None if only is None else only[lane])
               for lane, (i, c) in enumerate(schedule.lanes)]
    layout = ds.layout()
    return Batcher(readers, schedule, gatherer_of(ds), lambda: layout.views(np.empty(layout.nbytes, dtype=np.uint8)))


def digest(batch) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(v).tobytes() for _, v in sorted(batch.items()))).hexdigest()


def test_block_reader_resumes_at_every_block(two):
    ds = dataset(two[:1])
    plan = ds.plan(0, 0).sources[0]
    source = ds.sources[0]
    span = plan.config.spec.span * source.manifest.step_bytes

    def windows(b):  # each window's bytes, not where they lie in the block's buffer (a reader's own layout)
        return ([b.buf[o : o + span].tobytes() for o in b.offs.tolist()], b.start.tolist(),
                np.take(b.seq_ids, b.key_index).tolist())
    blocks = assert_resumes_identically(lambda: BlockReader(source.reader(), plan, 0, readahead=2), windows)
    assert len(blocks) == plan.num_blocks(0) > 1


@pytest.mark.parametrize("mixed", [False, True])
def test_batcher_resumes_at_every_batch(two, mixed):
    ds = dataset(two if mixed else two[:1], mix=sw.Mix(weights=[0.7, 0.3]) if mixed else None)
    batches = assert_resumes_identically(lambda: batcher(ds), digest)
    assert len(batches) == ds.plan(1, 2).batches_per_stream > 3


@pytest.mark.parametrize("mixed", [False, True])
def test_a_batcher_of_canonical_lanes_resumes_at_every_batch(two, mixed):
    ds = dataset(two if mixed else two[:1], canonical=(4, 4), mix=sw.Mix(weights=[0.7, 0.3]) if mixed else None)
    batches = assert_resumes_identically(lambda: batcher(ds), digest)  # rank 0 of 2, worker 1 of 2
    assert len(batches) == ds.plan(1, 2).batches_per_rank // 2 > 3
    assert len(batcher(ds).readers) == (2 if mixed else 1) * 2 * 2  # sources x slots x phases


def test_torchdatas_prefetcher_over_the_batcher_resumes_at_every_batch(two):
    ds = dataset(two, equalize="pad")
    plain = assert_resumes_identically(lambda: batcher(ds), digest)
    prefetched = assert_resumes_identically(lambda: Prefetcher(batcher(ds), prefetch_factor=2), digest,
                                            shutdown=lambda node: node.source.shutdown())
    assert prefetched == plain


SCHEDULES = {  # the plans of every kind of schedule: its class, and the dataset arguments that make it
    "QuotaSchedule": dict(canonical=None),
    "CanonSchedule": dict(canonical=(4, 4)),
    "GroupSchedule": dict(canonical=(4, 1)),
    "RowChunkSchedule": dict(canonical=(4, 1), crops=sw.Crops(pack_length=24, min_window=4, window_multiple=4),
                             horizon=0),
}


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("kind", SCHEDULES)
def test_every_schedule_keeps_the_one_protocol(two, kind, mixed):
    """Every schedule class states plan.schedule.Schedule and keeps its contract, checked here lane by lane: where a
    lane stands before batch j + 1 is where it stood before batch j, plus what it passed over and what it gave; a
    batch's items of each source are its parts' sum; a lane reads the blocks listed (or all)."""
    from streamwin.plan.schedule import Schedule

    ds = dataset(two if mixed else two[:1], **SCHEDULES[kind], mix=sw.Mix(weights=[0.7, 0.3]) if mixed else None)
    plan = ds.plan(1, 2)
    for stream in range(2):  # rank 0's two workers
        schedule = plan.schedule(stream)
        assert type(schedule).__name__ == kind and Schedule in type(schedule).__mro__
        assert all(getattr(type(schedule), name) is not getattr(Schedule, name) for name in ("parts", "positions"))
        assert schedule.blocks is None or len(schedule.blocks) == len(schedule.lanes)
        stands = np.array(schedule.positions(0))
        assert not stands.any() and schedule.batches > 3
        for j in range(schedule.batches):
            for lane, n in schedule.skips(j):
                stands[lane] += n
            parts, counts = schedule.parts(j)
            per_source = np.zeros(len(plan.sources), dtype=np.int64)
            for lane, n in parts:
                stands[lane] += n
                per_source[schedule.lanes[lane][0]] += n
            assert per_source.tolist() == np.asarray(counts).tolist()
            assert stands.tolist() == schedule.positions(j + 1), (kind, stream, j)


def test_no_caller_probes_a_schedule():
    """A schedule is used through its protocol: no getattr, hasattr or isinstance on one in the library."""
    import ast
    import pathlib

    probes = []
    for path in sorted(pathlib.Path(sw.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "hasattr", "isinstance") and node.args \
                    and "schedule" in ast.unparse(node.args[0]):
                probes.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not probes, probes
