"""Device mode over a mixed dataset (device="cpu": the same code as CUDA, run on the CPU).

Every batch must be bit for bit the CPU path's (device=None) for the same loader: in-process
and with workers, padded or not, a balanced and a skewed mix of a large and a small dataset,
over two epochs, after an exact and an elastic resume. Contents are also checked against the
sequences themselves, never against streamwin's own functions.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import streamwin as sw
from conftest import our_children, two_corpora
from streamwin.batch import BatchKeys
from streamwin.feed.slots import leftovers

W, S, H, B = 16, 8, 4, 10
OPEN: list[sw.WindowLoader] = []


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """(urls, sequences per source): a large corpus and a small one (conftest.two_corpora)."""
    return two_corpora(tmp_path_factory.mktemp("devmix"))


@pytest.fixture(autouse=True)
def nothing_left_over():
    """Every loader a test made is closed after it, and no worker process or shared memory outlives it."""
    yield
    while OPEN:
        OPEN.pop().close()
    assert not our_children() and not leftovers(os.getpid())


def make(urls, workers=0, device=None, *, weights=(0.5, 0.5), rank=0, world_size=1, batch_size=B, **kw):
    args = dict(window=W, stride=S, horizon=H, batch_size=batch_size, shuffle_buffer=64, seed=7) | kw
    ds = sw.WindowDataset(urls, rank=rank, world_size=world_size, mix=sw.Mix(weights=list(weights)), **args)
    loader = sw.WindowLoader(ds, num_workers=workers, device=device)
    OPEN.append(loader)
    return loader


def run(loader, take=None) -> list[dict]:
    """The loader's batches (tensors cloned, keys as lists), ``take`` of them or all."""
    out = []
    for b in loader:
        out.append({k: (v.clone() if torch.is_tensor(v) else v) for k, v in b.items()})
        if take is not None and len(out) == take:
            break
    return out


def assert_same(cpu: list[dict], dev: list[dict]) -> None:
    """Same batches, field by field, bit for bit (dtype too); keys as strings and as BatchKeys."""
    assert len(cpu) == len(dev) > 0
    for j, (a, b) in enumerate(zip(cpu, dev)):
        assert a.keys() == b.keys(), j
        for name in a:
            if name == "key":
                assert isinstance(b[name], BatchKeys) and list(a[name]) == list(b[name]), j
            else:
                assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), (j, name)


def assert_contents(batches: list[dict], seqs: list[dict]) -> None:
    """Each window is its source's sequence at its start (zero past a short sequence's end)."""
    for b in batches:
        assert b["source"].dtype == torch.int64 and b["source"].device.type == "cpu"
        for i, (src, key, start) in enumerate(zip(b["source"].tolist(), b["key"], b["start"].tolist())):
            ref = np.zeros((W + H, 3), np.float32)
            part = seqs[src][key][start : start + W + H]
            ref[: len(part)] = part
            assert np.array_equal(b["x"][i].numpy(), ref[:W]) and np.array_equal(b["y"][i].numpy(), ref[W:])


@pytest.mark.parametrize("weights", [(0.5, 0.5), (0.9, 0.1)], ids=["even", "skewed"])
@pytest.mark.parametrize("pad", [False, True], ids=["drop", "pad"])
@pytest.mark.parametrize("workers", [0, 2])
def test_mixed_device_batches_are_bitwise_the_cpu_path_for_two_epochs(corpora, workers, pad, weights):
    urls, seqs = corpora
    opts = dict(crops=sw.Crops(pad=True), order=sw.Order(equalize="pad")) if pad else {}
    cpu, dev = make(urls, workers, weights=weights, **opts), make(urls, workers, "cpu", weights=weights, **opts)
    epochs = []
    for epoch in range(2):
        cpu.set_epoch(epoch)
        dev.set_epoch(epoch)
        a, b = run(cpu), run(dev)
        assert len(b) == len(dev)
        assert_same(a, b)
        epochs.append(b)
    assert_contents(epochs[0][:20], seqs)
    assert {"mask", "y_mask", "weight"} <= epochs[0][0].keys() if pad else "mask" not in epochs[0][0]
    assert epochs[0][0]["source"].tolist() != epochs[1][0]["source"].tolist() or \
        epochs[0][0]["start"].tolist() != epochs[1][0]["start"].tolist(), "a new epoch, a new order"


@pytest.mark.parametrize("workers", [0, 2])
def test_mixed_device_resume_mid_epoch_is_exact(corpora, workers):
    urls, _ = corpora
    kw = dict(weights=(0.63, 0.37))  # quotas that vary from batch to batch: the cursor must sum them
    whole = run(make(urls, workers, **kw))
    for take in (1, len(whole) // 2 + 1):
        first = make(urls, workers, "cpu", **kw)
        run(first, take)
        state = json.loads(json.dumps(first.state_dict()))
        first.close()
        again = make(urls, workers, "cpu", **kw)
        again.load_state_dict(state)
        assert_same(whole[take:], run(again))


@pytest.mark.parametrize("workers", [0, 2])
def test_mixed_device_elastic_resume_is_the_cpu_paths(corpora, workers):
    """A state of a 2-rank job of 2 workers each, batch 10, resumed on 1 rank with other workers and batch 8."""
    urls, _ = corpora
    old = [make(urls, 2, rank=r, world_size=2) for r in range(2)]
    iters = [iter(x) for x in old]
    for _ in range(len(old[0]) // 3):
        for it in iters:
            next(it)
    state = json.loads(json.dumps(old[0].state_dict()))
    for x in old:
        x.close()

    def rest(device):
        loader = make(urls, workers, device, batch_size=8)
        loader.load_state_dict(state)
        return run(loader)

    assert_same(rest(None), rest("cpu"))


def test_device_memory_stays_bounded_when_a_large_source_has_far_more_blocks(corpora):
    """0.9/0.1 of a large and a small dataset, small blocks, in-process (blocks uploaded once): the trainer
    holds a few blocks, never a source's all. (With workers, batches are copied whole: nothing to bound.)"""
    urls, _ = corpora
    loader = make(urls, 0, "cpu", weights=(0.9, 0.1), shuffle_buffer=16)
    assert len(run(loader)) == len(loader) > 0
    s = loader.stats()
    per_block = s["device_uploaded_bytes"] / s["device_blocks"]
    assert s["device_blocks"] > 40
    assert 0 < s["device_peak_bytes"] <= 20 * per_block < s["device_uploaded_bytes"] / 8

