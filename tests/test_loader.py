"""End-to-end loader tests on a local dataset: window contents, coverage, equal steps, resume."""
from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

import streamwin as sw
from conftest import reference_windows

W, S, H, B = 16, 8, 4, 8


def check_batch(batch, seqs, window, horizon, pad):
    """Every window in the batch equals the naive slice of its sequence (zero-padded when short)."""
    for i, (key, start) in enumerate(zip(batch["key"], batch["start"].tolist())):
        arr = seqs[key]
        ref = np.zeros((window + horizon,) + arr.shape[1:], arr.dtype)
        part = arr[start : start + window + horizon]
        ref[: len(part)] = part
        assert np.array_equal(batch["x"][i].numpy(), ref[:window]), (key, start)
        if horizon:
            assert np.array_equal(batch["y"][i].numpy(), ref[window:]), (key, start)
        if pad:
            assert batch["mask"][i].tolist() == [j < len(part) for j in range(window)]


def run(loader):
    return [{k: (v.clone() if torch.is_tensor(v) else list(v)) for k, v in b.items()} for b in loader]


def make(url, workers=0, **kw):
    workers_kw = {k: kw.pop(k) for k in ("persistent_workers",) if k in kw}
    args = dict(window=W, stride=S, horizon=H, batch_size=B, shuffle_buffer=100, seed=1) | kw
    return sw.WindowLoader(sw.WindowDataset(url, **args), num_workers=workers, **workers_kw)


def same(a, b):
    return len(a) == len(b) and all(
        x["key"] == y["key"] and torch.equal(x["x"], y["x"]) and torch.equal(x["start"], y["start"]) for x, y in zip(a, b))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("pad", [False, True])
def test_windows_are_exact_and_each_at_most_once(tiny, workers, pad):
    url, seqs = tiny
    loader = make(url, workers, crops=sw.Crops(pad=pad))
    batches = run(loader)
    assert len(batches) == len(loader) > 0
    seen = []
    for b in batches:
        assert b["x"].shape == (B, W, 3) and b["x"].dtype == torch.float32
        assert b["y"].shape == (B, H, 3) and b["start"].dtype == torch.int64
        check_batch(b, seqs, W, H, pad)
        seen += list(zip(b["key"], b["start"].tolist()))
    expected = reference_windows(seqs, W, S, H, pad)
    assert len(set(seen)) == len(seen)
    assert set(seen) <= expected
    dropped = loader.summary()["dropped_windows"]
    assert len(expected) - len(seen) == dropped < max(1, workers) * B


def test_eval_mode_every_window_exactly_once_across_ranks(tiny):
    url, seqs = tiny
    world = 3
    per_rank, real = [], []
    for rank in range(world):
        ds = sw.WindowDataset(url, window=W, stride=S, horizon=H, batch_size=B, rank=rank, world_size=world,
                              order=sw.Order(shuffle=False, equalize="pad"))
        batches = run(sw.WindowLoader(ds))
        per_rank.append(len(batches))
        for b in batches:
            check_batch(b, seqs, W, H, False)
            real += [(k, s) for k, s, w in zip(b["key"], b["start"].tolist(), b["weight"].tolist()) if w == 1.0]
    assert len(set(per_rank)) == 1  # lockstep
    assert sorted(real) == sorted(reference_windows(seqs, W, S, H))  # exactly once, repeats weigh 0


def test_same_seed_same_batches_new_epoch_new_order(tiny):
    url, _ = tiny
    a, b = run(make(url)), run(make(url))
    assert same(a, b)
    loader = make(url)
    loader.set_epoch(1)
    c = run(loader)
    assert not same(a, c)
    assert sorted(k for x in a for k in zip(x["key"], x["start"].tolist())) != [] and len(c) == len(a)


@pytest.mark.parametrize("opts", [{}, dict(crops=sw.Crops(pad=True), order=sw.Order(equalize="pad"))])
def test_resume_at_every_step_in_process(tiny, opts):
    """A state taken after every step k (one pass, which taking them does not change) resumes to the batches
    of an uninterrupted pass: the next 16 (past a shuffle buffer's refill) at every k, all the rest at every
    8th k and the last: ~4,300 batches of the 153-batch pass instead of ~23,500 for every k's whole rest."""
    url, _ = tiny
    full = run(make(url, **opts))
    loader = make(url, **opts)
    it, states, taken = iter(loader), [loader.state_dict()], []
    for _ in full:
        taken += run([next(it)])
        states.append(loader.state_dict())
    assert same(full, taken), "taking a state changed the batches"
    for k, state in enumerate(states):
        json.dumps(state)  # a checkpoint is plain data
        restored = make(url, **opts)
        restored.load_state_dict(pickle.loads(pickle.dumps(state)))
        whole = k % 8 == 0 or k >= len(full) - 1
        rest = run(restored) if whole else run(b for b, _ in zip(restored, range(16)))
        if k < len(full):
            assert same(full[k:] if whole else full[k:k + 16], rest), f"resume after {k} batches differs"
        else:  # at the epoch's end, the next pass is the next epoch, as for the uninterrupted loader
            assert same(run(loader), rest) and not same(full, rest)


@pytest.mark.parametrize("persistent", [False, True])
def test_resume_with_workers_and_across_epochs(tiny, persistent):
    url, _ = tiny
    ref = make(url, 2, persistent_workers=persistent)
    epochs = []
    for e in range(2):
        ref.set_epoch(e)
        epochs.append(run(ref))
    assert len(epochs[0]) == len(epochs[1]) == len(ref)  # persistent workers keep full epochs
    n = len(epochs[0])
    for k in (0, 1, n // 2, n - 1):
        loader = make(url, 2, persistent_workers=persistent)
        it = iter(loader)
        got = [next(it) for _ in range(k)]
        state = loader.state_dict()
        del it, got
        restored = make(url, 2, persistent_workers=persistent)
        restored.load_state_dict(state)
        out = []
        for e in range(0, 2):  # the usual loop: set_epoch with the state's epoch keeps the position
            restored.set_epoch(e)
            out.append(run(restored))
        assert same(out[0], epochs[0][k:]) and same(out[1], epochs[1]), k


def test_resume_twice_and_thrice_in_a_row(tiny):
    url, _ = tiny
    full = run(make(url, 2))
    loader, done = make(url, 2), []
    for chunk in (3, 5, 4):
        it = iter(loader)
        done += [next(it) for _ in range(chunk)]
        state = loader.state_dict()
        loader = make(url, 2)
        loader.load_state_dict(state)
    done += run(loader)
    assert same(full, [{k: v for k, v in b.items()} for b in done])


def test_state_is_small_and_holds_no_window_data(tiny):
    url, _ = tiny
    loader = make(url, shuffle_buffer=10_000)
    it = iter(loader)
    next(it)
    size = len(pickle.dumps(loader.state_dict()))
    assert size < 4096, size


def test_set_epoch_to_another_epoch_discards_restored_position(tiny):
    url, _ = tiny
    loader = make(url)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    fresh = make(url)
    fresh.set_epoch(2)
    expected = run(fresh)
    restored = make(url)
    restored.load_state_dict(state)
    restored.set_epoch(2)
    assert same(run(restored), expected)


@pytest.mark.parametrize("change", [dict(window=8), dict(horizon=2), dict(stride=4), dict(seed=5),
                                    dict(order=sw.Order(shuffle=False)), dict(crops=sw.Crops(pad=True))])
def test_loading_state_into_different_plan_is_refused(tiny, change):
    """Another world, worker count or batch size resumes elastically (test_elastic.py); another order is refused."""
    url, _ = tiny
    loader = make(url)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    change = dict(change)
    other = make(url, change.pop("workers", 0), **change)
    with pytest.raises(sw.StateMismatchError, match="in checkpoint"):
        other.load_state_dict(state)


def test_loading_state_of_another_dataset_is_refused(tiny, tmp_path):
    url, seqs = tiny
    sw.pack(list(seqs.items())[:-1], str(tmp_path / "other"), progress=False)
    loader = make(url)
    next(iter(loader))
    with pytest.raises(sw.StateMismatchError, match="dataset"):
        make(str(tmp_path / "other")).load_state_dict(loader.state_dict())


def test_one_dimensional_sequences_and_integer_dtype(tmp_path):
    seqs = {f"t{i}": np.arange(i * 7 + 50, dtype=np.int32) for i in range(20)}
    sw.pack(list(seqs.items()), str(tmp_path / "tok"), progress=False)
    loader = sw.WindowLoader(sw.WindowDataset(str(tmp_path / "tok"), window=10, stride=3, horizon=1, batch_size=5))
    for b in loader:
        assert b["x"].shape == (5, 10) and b["x"].dtype == torch.int32 and b["y"].shape == (5, 1)
        check_batch(b, seqs, 10, 1, False)


def test_dataset_without_index_names_the_problem(tmp_path):
    with pytest.raises(sw.ManifestError, match="index.json"):
        len(sw.WindowLoader(sw.WindowDataset(str(tmp_path), window=4, batch_size=2)))


@pytest.mark.parametrize("workers", [0, 2])
def test_state_taken_after_an_epoch_ends_does_not_replay_it(tiny, workers):
    url, _ = tiny
    loader = make(url, workers)
    first = run(loader)
    state = loader.state_dict()
    loader.set_epoch(1)
    second = run(loader)
    restored = make(url, workers)
    restored.load_state_dict(state)
    restored.set_epoch(0)
    assert run(restored) == []  # epoch 0 was finished: nothing of it is yielded again
    restored.set_epoch(1)
    assert same(run(restored), second) and len(first) == len(second)


def test_mapped_and_copied_reads_give_identical_epochs(tiny, monkeypatch):
    """Local shards are mapped (no read copy); the read-into-memory path must give the same bits."""
    url, seqs = tiny
    from streamwin.storage import mapped

    assert mapped.available()
    mapped_run = run(make(url, crops=sw.Crops(pad=True)))
    monkeypatch.setattr(mapped, "available", lambda: False)
    copied_run = run(make(url, crops=sw.Crops(pad=True)))
    assert same(mapped_run, copied_run) and len(mapped_run) > 0
    for b in mapped_run:
        check_batch(b, seqs, W, H, True)


@pytest.mark.parametrize("workers,prefetch", [(0, 0), (0, 2), (2, 0)])
def test_batches_kept_stay_intact(tiny, workers, prefetch):
    """A batch is never a view of a block, and its arrays are reused only once no one holds them.

    Every batch of the epoch is kept as yielded (no clone) while blocks are unmapped and batch
    arrays recycled behind it; each must still equal the naive slices of its sequences.
    """
    import gc

    from streamwin.storage import mapped

    url, seqs = tiny
    # small blocks: many mapped and unmapped
    loader = make(url, workers, shuffle_buffer=16, read=sw.Read(prefetch=prefetch))
    kept = list(loader)  # the tensors themselves
    del loader
    gc.collect()
    # no kept tensor lies in a mapping still alive (mappings of other tests' loaders, whose reads in flight end
    # on their own threads, may still be there on a busy machine: only what the batches hold counts)
    maps = [(o.addr, o.addr + o.nbytes) for o in gc.get_objects() if type(o) is mapped.MappedBuffer and o.addr]
    inside = [k for b in kept for k, v in b.items() if k != "key" and v.numel()
              and any(lo <= v.data_ptr() < hi for lo, hi in maps)]
    assert not inside, f"a batch still holds a mapping: {inside[:4]}"
    assert len(kept) > 4
    for b in kept:
        check_batch(b, seqs, W, H, False)


def test_batch_arrays_are_reused_only_when_released():
    from streamwin.batch import BufferPool

    pool = BufferPool(64, keep=2)
    a = pool.get()
    held = torch.from_numpy(a.view(np.float32).reshape(4, 4))  # what a consumer holds
    del a
    b = pool.get()
    assert not np.shares_memory(b, held.numpy())
    del b
    c = pool.get()  # b was released: reused
    assert not np.shares_memory(c, held.numpy())
    del held, c
    d = pool.get()
    e = pool.get()
    assert not np.shares_memory(d, e)  # both free, but one is handed out twice never


def test_a_refused_mapping_falls_back_to_reading(tiny, monkeypatch):
    """When the system refuses a mapping (out of mappings or address space), the block is read instead."""
    import errno

    from streamwin.storage import mapped

    url, seqs = tiny
    expected = run(make(url))

    def refuse(*args, **kwargs):
        raise OSError(errno.ENOMEM, "no more mappings")

    monkeypatch.setattr(mapped.MappedBuffer, "map_file", refuse)
    assert same(run(make(url)), expected)


def test_a_finished_in_process_pass_lets_go_of_its_stream(tiny):
    """An iterator kept after its epoch (or caught in a reference cycle) must not keep the stream's last
    block, read threads and buffers alive until the garbage collector runs (memory grew per epoch)."""
    import gc
    import weakref

    url, _ = tiny
    loader = make(url, 0)
    it = iter(loader)
    next(it)
    source = weakref.ref(it.runs.feed.stream)
    gc.disable()
    try:
        for _ in it:
            pass
        assert source() is None, "the finished pass still holds its stream (shard readers, blocks)"
    finally:
        gc.enable()


@pytest.mark.parametrize("workers", [0, 2])
def test_stats_report_bytes_decompressed(tiny, tmp_path, workers):
    url, seqs = tiny
    sw.pack(list(seqs.items()), str(tmp_path / "z"), compression="zstd", progress=False)
    for where, compressed in ((str(tmp_path / "z"), True), (url, False)):
        loader = make(where, workers)
        run(loader)
        stats = loader.stats()
        assert (stats["bytes_decompressed"] > 0) == compressed, (where, stats)


def test_the_in_process_gather_runs_on_one_thread_and_leaves_the_callers_count(tiny, monkeypatch):
    """torch's other intra-op threads spin after a parallel copy (ms of CPU a batch on a busy machine): the gather
    copies on one thread, and the caller's own torch work keeps the threads it set."""
    url, seqs = tiny
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch's native thread pool fixes its thread count once for the whole process")
    seen = []
    select = torch.index_select

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return select(*args, **kwargs)

    before = torch.get_num_threads()
    monkeypatch.setattr(torch, "index_select", recording)
    torch.set_num_threads(2)
    try:
        batches = 0
        for batch in make(url):
            batches += 1
            assert torch.get_num_threads() == 2
            check_batch(batch, seqs, W, H, False)
    finally:
        torch.set_num_threads(before)
    assert batches > 0 and len(seen) >= batches and set(seen) == {1}, seen[:10]
