"""Device mode's last hop: one copy per batch with workers, static batches, no wait for the device.

On the CPU (device="cpu" runs the same code as CUDA, without streams and events): static
batches live in the same tensors every batch and every epoch, each batch's values exactly
the CPU path's (device=None, an independent path: gathered on the CPU, no device code); a
static batch is valid until the next ``next()``; non-static batches are never overwritten
while held; with workers, the trainer issues one copy per batch and nothing else that
computes. The tests marked ``cuda`` run where a GPU is: the copy runs on a side stream from
page-locked memory, ``next()`` returns while the device is still busy (no CPU wait), no
synchronizing CUDA call happens in steady state, and a training step captured in a CUDA
graph on static batches computes what the eager step computes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import streamwin as sw
from conftest import make_sequences, our_children, two_corpora
from streamwin.batch import PER_CROP
from streamwin.feed.slots import leftovers

REPO = Path(__file__).resolve().parent.parent
W, S, B = 16, 8, 4
OPEN: list[sw.WindowLoader] = []
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LAYOUTS = {
    "windows": dict(horizon=3),
    "pad": dict(horizon=3, crops=sw.Crops(pad=True), order=sw.Order(equalize="pad")),
    "drawn": dict(horizon=3, crops=sw.Crops(min_window=4, window_multiple=4, pad=True)),
    "packed": dict(crops=sw.Crops(pack_length=48, min_window=4, window_multiple=4, jitter=True, missing="mask")),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    seqs = make_sequences(60, seed=9, max_len=300)
    url = str(tmp_path_factory.mktemp("devfeed") / "ds")
    sw.pack(list(seqs.items()), url, shard_bytes=30_000, progress=False)
    return url, seqs


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    return two_corpora(tmp_path_factory.mktemp("devfeed_mix"))


@pytest.fixture(autouse=True)
def nothing_left_over():
    yield
    while OPEN:
        OPEN.pop().close()
    assert not our_children() and not leftovers(os.getpid())


def loader(url, workers=0, device=None, *, static=False, batch=B, **kw) -> sw.WindowLoader:
    args = dict(window=W, stride=S, batch_size=batch, shuffle_buffer=48, seed=5) | kw
    mix = sw.Mix(weights=[0.7, 0.3]) if isinstance(url, list) else None
    ld = sw.WindowLoader(sw.WindowDataset(url, rank=0, world_size=1, mix=mix, **args), num_workers=workers,
                         device=device, static=static)
    OPEN.append(ld)
    return ld


def cloned(b: dict) -> dict:
    return {k: v.clone() if torch.is_tensor(v) else list(v) for k, v in b.items()}


def batches(ld, epoch=0, take=None) -> list[dict]:
    ld.set_epoch(epoch)
    out = []
    for b in ld:
        out.append(cloned(b))
        if take is not None and len(out) == take:
            break
    return out


def assert_same(a: list[dict], b: list[dict]) -> None:
    """The same batches, field by field, bit for bit, dtype kept (device aside)."""
    assert len(a) == len(b) > 0
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), i
        for k in x:
            if k == "key":
                assert list(x[k]) == list(y[k]), i
            else:
                assert x[k].dtype == y[k].dtype and torch.equal(x[k].cpu(), y[k].cpu()), (i, k)


def static_run(ld, epochs=(0, 1)) -> tuple[list[dict], set, dict]:
    """Every batch of ``epochs`` (values cloned as each arrives), the storages they lived in, and the tensor
    objects each field came in (the first batch's)."""
    got, storages, first = [], set(), None
    for epoch in epochs:
        ld.set_epoch(epoch)
        for b in ld:
            tensors = {k: v for k, v in b.items() if torch.is_tensor(v)}
            first = first or tensors
            for k, v in tensors.items():
                storages.add(v.untyped_storage().data_ptr())
                if "segment_ids" in b and k in PER_CROP:  # packed rows: cut to the batch's crops, the same memory
                    assert v.data_ptr() == first[k].data_ptr(), k
                else:
                    assert v is first[k], k  # the same tensor object, not only the same memory
            got.append(cloned(b))
    return got, storages, first


# -- static batches on the CPU ----------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_static_batches_live_in_the_same_tensors_and_are_the_cpu_paths(corpus, workers, layout):
    url, _ = corpus
    kw = LAYOUTS[layout]
    want = batches(loader(url, workers, **kw)) + batches(loader(url, workers, **kw), epoch=1)
    got, storages, _ = static_run(loader(url, workers, "cpu", static=True, **kw))
    assert_same(want, got)
    assert len(storages) == 1  # every field of every batch, both epochs: one buffer


@pytest.mark.parametrize("workers", [0, 2])
def test_static_mixed_batches_are_the_cpu_paths(mix, workers):
    urls, _ = mix
    want = batches(loader(urls, workers, horizon=2))
    got, storages, first = static_run(loader(urls, workers, "cpu", static=True, horizon=2), epochs=(0,))
    assert_same(want, got)
    assert len(storages) == 1 and "source" in first


@pytest.mark.parametrize("workers", [0, 1])
def test_a_static_batch_is_valid_until_the_next_next_and_resume_keeps_its_tensors(corpus, workers):
    url, _ = corpus
    ld = loader(url, workers, "cpu", static=True, horizon=2)
    it = iter(ld)
    first = next(it)
    x0 = first["x"].clone()
    second = next(it)
    assert second["x"] is first["x"] and torch.equal(first["x"], second["x"])  # overwritten in place
    assert not torch.equal(x0, second["x"])
    state = ld.state_dict()
    third = next(it)["x"].clone()
    ld.load_state_dict(state)
    again = next(iter(ld))
    assert again["x"] is first["x"] and torch.equal(again["x"], third)


def test_static_needs_a_device(corpus):
    url, _ = corpus
    ds = sw.WindowDataset(url, window=W, stride=S, batch_size=B, rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"static=True .* pass device='cuda'"):
        sw.WindowLoader(ds, num_workers=0, static=True)
    with pytest.raises(ValueError, match="static must be True or False, got 1"):
        sw.WindowLoader(ds, num_workers=0, device="cpu", static=1)


# -- non-static device batches with workers ----------------------------------------------------------------
def test_device_batches_from_workers_are_never_overwritten_while_held(corpus):
    url, seqs = corpus
    want = batches(loader(url, 1, horizon=2))
    held = list(loader(url, 1, "cpu", horizon=2))  # every batch kept, none cloned
    assert_same(want, held)
    for b in held[:5]:  # and against the sequences themselves
        for i, (key, st) in enumerate(zip(b["key"], b["start"].tolist())):
            assert np.array_equal(b["x"][i].numpy(), seqs[key][st : st + W])
            assert np.array_equal(b["y"][i].numpy(), seqs[key][st + W : st + W + 2])
    assert len({b["x"].data_ptr() for b in held}) == len(held)


class Kernels(TorchDispatchMode):
    """Counts the ops that compute or copy (would launch a kernel on a GPU): not views, not allocations."""

    FREE = {"empty", "view", "slice", "alias", "as_strided", "_reshape_alias", "reshape", "unsqueeze", "detach",
            "lift_fresh", "expand"}

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.rstrip("_") not in self.FREE and not name.startswith("view") and not name.startswith("empty"):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("layout", ["windows", "pad", "packed"])
def test_with_workers_the_trainer_issues_one_copy_per_batch(corpus, static, layout):
    url, _ = corpus
    it = iter(loader(url, 1, "cpu", static=static, **LAYOUTS[layout]))
    next(it)
    for _ in range(5):
        with Kernels() as k:
            next(it)
        assert k.ops == ["copy_"], k.ops


def test_device_stats_report_no_wait_for_the_device(corpus):
    url, _ = corpus
    for workers in (0, 1):
        ld = loader(url, workers, "cpu", horizon=2)
        n = len(batches(ld))
        s = ld.stats()
        assert s["device_waits"] == 0 and s["batches"] == n
        if workers:
            assert s["device_uploaded_bytes"] == n * ld.dataset.layout().nbytes


# -- the example ---------------------------------------------------------------------------------------
def test_the_cuda_graph_example_runs_on_the_cpu_without_capture(corpus, tmp_path):
    url, _ = corpus
    out = subprocess.run([sys.executable, str(REPO / "examples" / "train_cuda_graph.py"), "--data", url,
                          "--window", "16", "--batch-size", "4", "--steps", "12", "--workers", "1", "--device", "cpu"],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["steps"] == 12 and last["captured"] is False and np.isfinite(last["loss"])
    assert last["device_waits"] == 0


def test_the_device_feed_benchmark_runs(corpus):
    """benchmarks/device_feed.py: trainer CPU and launches per batch, one quick case (a smoke test, no target)."""
    url, _ = corpus
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "device_feed.py"), "--data", url, "--cases",
                          "static:1", "--batches", "20", "--repeats", "1", "--window", "16", "--batch-size", "4"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout.splitlines()[0])
    assert rec["case"] == "static:1" and rec["ops_per_batch"] == 1 and rec["trainer_us_per_batch"] > 0


# -- on a GPU ------------------------------------------------------------------------------------------
@cuda
@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cuda_batches_are_bitwise_the_cpu_paths(corpus, workers, static, layout):
    url, _ = corpus
    kw = LAYOUTS[layout]
    got = batches(loader(url, workers, "cuda", static=static, **kw))
    assert all(v.device.type == "cuda" for b in got for v in b.values() if torch.is_tensor(v))
    assert_same(batches(loader(url, workers, **kw)), got)


@cuda
@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("static", [False, True])
def test_cuda_next_never_waits_for_the_device(corpus, workers, static):
    """With the device busy for ~1 s, five next() calls return at once, and nothing synchronizes in steady state."""
    url, _ = corpus
    ld = loader(url, workers, "cuda", static=static, horizon=2)
    it = iter(ld)
    for _ in range(3):
        next(it)["x"].sum()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing CUDA call now raises
    try:
        torch.cuda._sleep(2_000_000_000)  # ~1 s of a busy current stream
        t = time.perf_counter()
        for _ in range(5):
            total = next(it)["x"].sum()  # queued behind the sleep
        took = time.perf_counter() - t
        busy = not torch.cuda.current_stream().query()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert busy and took < 0.25, took
    torch.cuda.synchronize()
    assert torch.isfinite(total) and ld.stats()["device_waits"] == 0


@cuda
@pytest.mark.parametrize("static", [False, True])
def test_cuda_copies_run_on_a_side_stream_from_page_locked_memory(corpus, tmp_path, static):
    """The profiler's trace: each batch's host-to-device copy is pinned and on a stream other than the step's."""
    url, _ = corpus
    it = iter(loader(url, 1, "cuda", static=static, horizon=2))
    next(it)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            (next(it)["x"] * 2).sum()
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    h2d = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e["name"]]
    kernels = {e["args"]["stream"] for e in events if e.get("cat") == "kernel"}
    assert len(h2d) == 4 and all("Pinned" in e["name"] for e in h2d), [e["name"] for e in h2d]
    assert not {e["args"]["stream"] for e in h2d} & kernels


@cuda
@pytest.mark.parametrize("workers", [0, 1])
def test_cuda_graph_captured_step_on_static_batches_matches_the_eager_step(corpus, workers):
    """torch's whole-network capture recipe, with no copy into the graph's input: the loader refills it."""
    url, _ = corpus
    torch.manual_seed(0)
    dev = torch.device("cuda")
    models = [torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(W * 3, 32), torch.nn.ReLU(),
                                  torch.nn.Linear(32, 2 * 3)).to(dev) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]

    def step(k, b):
        loss = torch.nn.functional.mse_loss(models[k](b["x"]).view(-1, 2, 3), b["y"])
        loss.backward()
        opts[k].step()
        return loss

    it = iter(loader(url, workers, "cuda", static=True, horizon=2))
    b = next(it)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up on a side stream before capture, both models alike
        for _ in range(3):
            for k in (0, 1):
                opts[k].zero_grad(set_to_none=True)
                step(k, b)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    opts[1].zero_grad(set_to_none=True)  # grads made in the graph's pool, overwritten by each replay
    with torch.cuda.graph(graph):
        loss = step(1, b)
    x = b["x"]
    want, got = [], []
    for _ in range(6):
        b = next(it)
        assert b["x"] is x
        opts[0].zero_grad(set_to_none=True)
        want.append(step(0, cloned(b)).item())
        graph.replay()
        got.append(loss.item())
    assert np.allclose(got, want, rtol=1e-4, atol=1e-6), (got, want)
