"""The hand-off between worker processes and the trainer (issue 27), and what a loader leaves behind (issue 28).

Slot numbers travel through rings in shared memory counted by semaphores (feed/protocol.py); a
slot goes back to its worker once nothing refers to it (feed/slots.py). Checked here against
references computed in the test: records and payloads arrive whole and in order across processes,
however small the ring; whatever a training loop keeps of a batch (a view, a numpy array, its keys
alone) keeps its values; the trainer takes the batches at hand in one go and wakes a sleeping worker once
per go, not per batch; arguments
whose slots cannot be had fail before anything is allocated; no worker of a failed pass lives on;
a script that ends with a loader open prints nothing but its own output.
"""
from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest
import torch

import streamwin as sw
from conftest import naive, our_children, reference_windows
from streamwin.arguments import memory_bytes
from streamwin.feed import pool as feed_pool
from streamwin.feed.protocol import ERROR, RECORD_STRUCT, WARNING, Channel, has_payload
from streamwin.feed.slots import RECORD, leftovers

pytestmark = pytest.mark.timeout(300)
W, S, H, B = 16, 8, 4, 8
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make(url, workers=1, **kw):
    loader_kw = {k: kw.pop(k) for k in ("persistent_workers", "prefetch_factor") if k in kw}
    args = dict(window=W, stride=S, horizon=H, batch_size=B, shuffle_buffer=64, seed=3) | kw
    return sw.WindowLoader(sw.WindowDataset(url, **args), num_workers=workers, **loader_kw)


# -- the channel ------------------------------------------------------------------------------------------


def _channel(size: int):
    """Both ends of one channel over a ring of ``size`` records in anonymous shared memory (fork)."""
    ctx = multiprocessing.get_context("fork")
    ring = np.frombuffer(__import__("mmap").mmap(-1, size * RECORD * 8), dtype=np.int64).reshape(size, RECORD)
    items, space = ctx.Semaphore(0), ctx.Semaphore(size)
    mine, theirs = ctx.Pipe(duplex=True)
    return ctx, ring, items, space, mine, theirs


def _sender(ring, items, space, conn, n: int) -> None:
    out = Channel(ring, items, space, conn)
    for i in range(n):
        if i % 7 == 3:  # a payload (a warning's JSON) between records
            out.send(WARNING, i, payload=f"payload {i}".encode() * (1 + i % 5))
        else:
            out.send(2, i, 10 * i, -i, i * i)
    out.send(ERROR, n, payload=b"the end")
    conn.close()


@pytest.mark.parametrize("size", [2, 5, 64])
def test_a_channel_carries_records_and_payloads_in_order_across_processes(size):
    """Another process sends 500 records, some with a payload, through a ring of 2, 5 or 64 places: every one
    arrives whole and in order (a full ring makes the sender wait, never overwrite)."""
    n = 500
    ctx, ring, items, space, mine, theirs = _channel(size)
    proc = ctx.Process(target=_sender, args=(ring, items, space, theirs, n))
    proc.start()
    theirs.close()
    inbox = Channel(ring, items, space, mine)
    got = []
    while True:
        msg = inbox.receive(10.0)
        assert msg is not None, f"nothing within 10 s after {len(got)} records"
        got.append((msg, inbox.payload() if has_payload(msg) else None))
        if msg[0] == ERROR:
            break
    proc.join(10)
    pad = (0,) * (RECORD - 5)  # values past those sent are 0
    want = [((WARNING, i, 0, 0, 0, *pad), f"payload {i}".encode() * (1 + i % 5)) if i % 7 == 3 else
            ((2, i, 10 * i, -i, i * i, *pad), None) for i in range(n)] + [((ERROR, n, 0, 0, 0, *pad), b"the end")]
    assert got == want and proc.exitcode == 0


def test_a_full_ring_refuses_a_send_that_must_not_wait():
    ctx, ring, items, space, mine, theirs = _channel(3)
    out = Channel(ring, items, space, mine)
    assert all(out.send(4, i, wait=False) for i in range(3))
    assert not out.send(5, wait=False)  # no place left: STOP at close is given up, not waited for
    inbox = Channel(ring, items, space, theirs)
    zeros = (0,) * (RECORD - 2)
    assert [inbox.receive() for _ in range(4)] == [(4, 0, *zeros), (4, 1, *zeros), (4, 2, *zeros), None]
    assert RECORD_STRUCT.size == RECORD * 8


# -- what a training loop keeps ----------------------------------------------------------------------------


def test_views_and_arrays_kept_from_a_batch_keep_their_values(tiny, recwarn):
    """A torch view and a numpy view of a batch tensor, kept after the batch itself is dropped, still hold the
    batch's values at the end of the epoch: the slot they view is not reused while they live."""
    url, seqs = tiny
    kept = []
    for b in make(url, shuffle_buffer=16):
        kept.append((b["x"][0], b["x"].numpy()[1:3], b["key"][0], b["key"][1:3], b["start"].tolist()))
        del b
    assert len(kept) > 8
    for row0, rows12, key0, keys12, starts in kept:
        assert np.array_equal(row0.numpy(), naive(seqs, key0, starts[0], W))
        for row, key, start in zip(rows12, keys12, starts[1:3]):
            assert np.array_equal(row, naive(seqs, key, start, W))


def test_the_torch_internals_that_tell_a_slot_free_still_mean_what_slots_reads(tiny):
    """feed/slots.py tells a slot free from torch internals no public API replaces (its comment says why): a storage's
    use count by its address (torch._C._storage_Use_Count, storage._cdata) and a tensor's in-place version
    (Tensor._version). A torch that drops, renames or changes them fails here, naming its version, instead of
    handing out a slot that a view still reads; and a slot's own tensors, a view of one kept, hold it."""
    from streamwin.feed import slots

    where = f"torch {torch.__version__} changed an internal feed/slots.py reads to tell a slot free (see its comment)"
    assert callable(getattr(torch._C, "_storage_Use_Count", None)), where
    t = torch.from_numpy(np.zeros(16, dtype=np.float32))
    address = t.untyped_storage()._cdata
    assert isinstance(address, int) and t[1:].untyped_storage()._cdata == address, where  # one address a storage
    alone = slots._use_count(address)
    views = [t[2:5], t.view(4, 4), t.numpy(), torch.as_strided(t, (4,), (2,))]
    assert slots._use_count(address) == alone + len(views), where  # one reference each view
    del views
    assert slots._use_count(address) == alone, where
    for change in (lambda x: x.add_(1), lambda x: x.resize_(8), lambda x: x.unsqueeze_(0),
                   lambda x: x.set_(torch.zeros(4).untyped_storage())):
        x = torch.from_numpy(np.zeros(16, dtype=np.float32))
        before = slots._VERSION(x)
        change(x)
        assert isinstance(before, int) and slots._VERSION(x) > before, where
    ds = sw.WindowDataset(tiny[0], window=W, stride=S, horizon=H, batch_size=B)
    layout = ds.layout()
    base = np.zeros(layout.nbytes, dtype=np.uint8)
    batches = slots.SlotBatches([[base]], layout, ds.manifests)
    state = batches.slots[0][0]
    assert not batches.in_use(state)
    row = state.made["x"][1]  # a view of the slot's tensor, the batch itself dropped
    assert batches.in_use(state), where
    del row
    assert not batches.in_use(state)


def test_keys_kept_alone_read_their_own_batch_and_do_not_hold_its_slot(tiny, recwarn):
    """Keys kept without their batch (not yet decoded) decode to their own batch's keys after the slot has been
    reused many times over, and keeping them costs no copy out of shared memory."""
    url, seqs = tiny
    kept = [(b["key"], b["x"].clone(), b["start"].clone()) for b in make(url, shuffle_buffer=16)]
    assert len(kept) > 8 and not [w for w in recwarn if "copied out" in str(w.message)]
    seen = set()
    for keys, x, start in kept:
        assert len(keys) == B
        for i, (key, s) in enumerate(zip(keys, start.tolist())):
            assert np.array_equal(x[i].numpy(), naive(seqs, key, s, W))
            seen.add((key, s))
    assert seen <= reference_windows(seqs, W, S, H) and len(seen) == B * len(kept)


def test_a_batch_changed_in_place_and_dropped_does_not_change_later_batches(tiny, recwarn):
    """Slot tensors are handed out again while nothing refers to them: a batch whose dict is edited, whose
    tensors are reshaped in place, written to or set to require grad, then dropped, leaves every later
    batch with its own fields, shapes, flags and exact values."""
    url, seqs = tiny
    fields, n = None, 0
    for i, b in enumerate(make(url, shuffle_buffer=16)):
        if fields is None:
            fields = {k: (tuple(v.shape), v.dtype) for k, v in b.items() if k != "key"}
        assert {k: (tuple(v.shape), v.dtype) for k, v in b.items() if k != "key"} == fields
        assert not any(v.requires_grad for k, v in b.items() if k != "key")
        for j, (key, start) in enumerate(zip(b["key"], b["start"].tolist())):
            assert np.array_equal(b["x"][j].numpy(), naive(seqs, key, start, W))
        n += 1
        change = i % 5
        if change == 0:
            b["x"].unsqueeze_(0)
            b["start"].t_()
        elif change == 1:
            b["x"].requires_grad_()
        elif change == 2:
            b.pop("start")
            b["extra"] = torch.zeros(1)
        elif change == 3:
            b["x"].mul_(-1.0)  # the slot's bytes: the worker writes the next batch over them
        else:
            assert len(list(b["key"])) == B  # keys decoded: the slot's next batch gets new ones
        del b
    assert n > 8 and not [w for w in recwarn if "copied out" in str(w.message)]


def test_a_tensor_swapped_or_moved_and_dropped_never_frees_a_kept_slot_nor_stales_a_batch(tiny):
    """A batch tensor whose storage is swapped (``set_``, ``.data =``) or whose data moves to shared memory
    (``share_memory_()``, what a torch.multiprocessing queue does; no version moves), then dropped, beside views
    kept of other batches: the kept views keep their values, every later batch is exact, and no slot leaks."""
    url, seqs = tiny
    loader = make(url, shuffle_buffer=16, persistent_workers=True)
    kept, n = [], 0
    try:
        for i, b in enumerate(b for _ in range(3) for b in loader):  # 3 epochs: every slot is used again
            for j, (key, start) in enumerate(zip(b["key"], b["start"].tolist())):
                assert np.array_equal(b["x"][j].numpy(), naive(seqs, key, start, W))
            n += 1
            change = i % 4
            if change == 0 and len(kept) < 3:
                kept.append((b["x"][0], b["key"][0], int(b["start"][0])))  # a view: its slot must stay
            elif change == 1:
                b["x"].set_(torch.zeros(3))
            elif change == 2:
                b["x"].data = b["x"].data.clone()
            elif change == 3:
                b["x"].share_memory_()
            del b
        assert n > 3 * 28 and len(kept) == 3  # more batches than slots
        for row, key, start in kept:
            assert np.array_equal(row.numpy(), naive(seqs, key, start, W))
        # and the last batch's: the generator and enumerate's result tuple still hold it while the pass ends
        assert len(loader._pool.held) <= len(kept) + 1, "slots of dropped batches are still held"
    finally:
        loader.close()


def test_the_trainer_takes_batches_in_runs_and_wakes_its_worker_once_a_run(tiny):
    """Over a pass whose steps take longer than a batch takes the worker, the trainer takes the batches at hand in
    one go: it looks at its held slots, and sends its worker records (each wakes it at most once), for fewer than
    half the batches it takes, not per batch; it seldom waits; a batch costs next() a deque pop."""
    url, _ = tiny
    loader = make(url, shuffle_buffer=16, persistent_workers=True)
    try:
        it = iter(loader)
        next(it)
        pool, looks = loader._pool, []
        recycle = pool.recycle
        pool.recycle = lambda *a, **k: (looks.append(1), recycle(*a, **k))[1]
        taken, hot = 1, 0
        for _ in it:
            taken += 1
            hot += bool(it.at_hand())  # batches still made ready: the next next() looks at nothing else
            time.sleep(0.005)  # a training step
        sent, waits = pool.outbox[0].head, pool.waits  # records to the worker: one RUN, then RELEASEs
    finally:
        loader.close()
    assert taken > 20
    assert len(looks) <= taken / 2 + waits, (taken, len(looks), waits)
    assert sent <= 1 + taken / 2 + waits, (taken, sent, waits)
    # popped from a run, unless the worker fell behind (then the trainer waited for it: a loaded machine)
    assert hot + waits >= taken / 2 and waits < taken // 4, (taken, hot, waits)


def test_batches_made_ready_but_not_handed_out_go_back_and_are_not_counted(tiny):
    """A pass abandoned with batches made ready: the position and stats() count only those handed out, their slots
    go back to the worker (the next passes run without copying batches out of shared memory), and the next pass
    yields the epoch from the start again, then the next epochs as an uninterrupted loader does."""
    url, _ = tiny
    reference = make(url, 0, shuffle_buffer=16)
    expected = [[list(b["key"]) for b in reference] for _ in range(3)]  # epochs 0, 1, 2
    loader = make(url, shuffle_buffer=16, persistent_workers=True)
    try:
        it = iter(loader)
        first = next(it)
        records = loader._pool.inbox[0].items  # the worker's records waiting in the ring
        deadline = time.monotonic() + 60
        while records.get_value() < 3 and time.monotonic() < deadline:  # slow on a loaded machine: wait for them
            time.sleep(0.01)
        taken = 1
        while it.at_hand() < 2 and taken < 8:  # the rest of the first run, then the records waiting, in one go
            next(it)
            taken += 1
        assert it.at_hand() >= 2, "the worker had batches ready: they were taken in one go"
        assert loader.state_dict()["batches"] == taken and loader.stats()["batches"] == taken
        del first
        for epoch in range(3):  # the abandoned epoch 0 again, then 1 and 2
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # "copied out of shared memory" would be a warning
                keys = [list(b["key"]) for b in loader]
            assert keys == expected[epoch]
        assert loader.stats()["batches"] == taken + 3 * len(expected[0])
        assert len(loader._pool.held) <= 1
    finally:
        loader.close()  # a failed check must not leave the persistent worker to the next tests


# -- bad arguments, failed passes, exits (issue 28, items 7 and 8) -----------------------------------------


def _nothing_started(pid: int) -> bool:
    return not our_children() and not leftovers(pid)


def test_too_many_workers_fail_naming_num_workers_before_anything_starts(tiny):
    url, _ = tiny
    with pytest.raises(ValueError, match=r"num_workers=1000000 is more worker processes than this process may"):
        make(url, 10**6)
    assert _nothing_started(os.getpid())


def test_a_huge_prefetch_factor_fails_naming_it(tiny):
    url, _ = tiny
    with pytest.raises(ValueError, match=r"prefetch_factor must be an integer from 1 to 1024 .* got 10000"):
        make(url, prefetch_factor=10**4)


def test_a_batch_whose_slots_cannot_fit_fails_naming_batch_size_before_allocating(tiny):
    """One batch a tenth of this machine's memory passes every one-batch check; one worker's slots of it and the
    trainer's own batches do not fit: refused, naming batch_size and the slots, before a worker or a slot exists."""
    url, _ = tiny
    per_window = make(url, 0).dataset.layout().nbytes / B
    batch_size = int(memory_bytes() / 10 / per_window)
    loader = make(url, batch_size=batch_size)
    with pytest.raises(ValueError, match=rf"num_workers=1 x \(prefetch_factor=2 \+ \d+\) batch slots of "
                                         rf"batch_size={batch_size} windows .* would need .* GB of memory"):
        next(iter(loader))
    assert loader._pool is None and _nothing_started(os.getpid())


@pytest.mark.parametrize("persistent", [False, True])
def test_the_workers_of_a_failed_pass_stop_with_it(tiny, tmp_path, persistent):
    """A worker's error ends the pass and its workers at once (persistent ones too), not at the next pass."""
    url, _ = tiny
    bad = tmp_path / "bad"
    shutil.copytree(url, bad)
    for shard in sorted(p for p in os.listdir(bad) if p.endswith(".tar")):
        data = (bad / shard).read_bytes()
        (bad / shard).write_bytes(data.replace(b"\x93NUMPY", b"\x93NOMPY"))
    loader = make(str(bad), order=sw.Order(shuffle=False), persistent_workers=persistent)
    it = iter(loader)
    with pytest.raises(sw.ShardError):
        next(it)
    assert _nothing_started(os.getpid()), "a worker of the failed pass is still alive"
    with pytest.raises(StopIteration):
        next(it)  # the failed pass is over
    loader.close()


def test_the_readme_quick_start_run_as_a_script_prints_only_its_own_output(tmp_path):
    """The quick start as a script: its loader's worker is alive when the script ends; nothing is printed about
    objects torn down at exit (before: ``Exception ignored in SharedFile.__del__ ... AttributeError``)."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    code = readme.split("## Quick start", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    script = tmp_path / "quickstart.py"
    script.write_text(textwrap.dedent(code))
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "batches per epoch" in run.stdout
    assert "Exception ignored" not in run.stderr and "Traceback" not in run.stderr, run.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_views_kept_after_a_non_blocking_copy_keep_their_values(tiny):
    """With page-locked slots, a batch dropped right after queuing its copy keeps its slot until the copy is done."""
    url, seqs = tiny
    out = []
    for b in sw.WindowLoader(sw.WindowDataset(url, window=W, stride=S, batch_size=B, shuffle_buffer=16, seed=3),
                             num_workers=1, pin_memory=True):
        out.append((list(b["key"]), b["start"].tolist(), b["x"].to("cuda", non_blocking=True)))
    torch.cuda.synchronize()
    for keys, starts, x in out:
        for i, (key, start) in enumerate(zip(keys, starts)):
            assert np.array_equal(x[i].cpu().numpy(), naive(seqs, key, start, W))
