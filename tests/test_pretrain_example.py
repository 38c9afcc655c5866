"""examples/pretrain.py: a patch transformer on packed rows of two mixed datasets, under torchrun with 2 gloo
processes, preempted and resumed. What each rank trained on at each step, and the losses, must be those of an
uninterrupted run, recomputed here in-process (same plan, model and AdamW); the attention mask must be
block-diagonal by crop, checked against one built here from the segment ids step by step."""
from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import pytest
import torch

import streamwin as sw
from test_examples import EXAMPLES, clean_env, free_port, records, run

ARGS = ["--patch", "4", "--window", "32", "--min-window", "8", "--pack-length", "64", "--batch-size", "4",
        "--epochs", "2", "--seed", "3", "--weights", "0.8,0.2"]


def waves(n: int, seed: int, nan: bool) -> dict[str, np.ndarray]:
    """Two-channel sinusoids of uneven lengths; with ``nan``, a few missing values."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        t = int(rng.integers(20, 200))
        x = np.sin(np.arange(t)[:, None] * rng.uniform(0.05, 0.4, 2)) + 0.1 * rng.standard_normal((t, 2))
        if nan:
            x[rng.random(x.shape) < 0.03] = np.nan
        out[f"{'b' if nan else 'a'}{i:03d}"] = x.astype(np.float32)
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("pretrain_example")
    urls = [str(root / "a"), str(root / "b")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pack counts the NaN and says so
        for url, seqs in zip(urls, (waves(40, 0, False), waves(30, 1, True))):
            sw.pack(list(seqs.items()), url, shard_bytes=20_000, progress=False)
    return ",".join(urls)


def pretrain():
    sys.path.insert(0, EXAMPLES)
    try:
        import pretrain as module
    finally:
        sys.path.remove(EXAMPLES)
    return module


def reference(data: str, world: int = 2) -> tuple[list[list[tuple]], list[list[float]]]:
    """Per rank, (epoch, keys, starts) of every step of an uninterrupted run and its loss, replayed in one process:
    DDP averages the ranks' gradients, so one step on the mean of the ranks' losses is the same update."""
    module = pretrain()
    args = module.parse_args(["--data", data, "--ckpt", "unused", *ARGS])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun rank runs (OMP_NUM_THREADS=1): 5x faster on 2 busy cores
    try:
        return _replay(module, args, data, world)
    finally:
        torch.set_num_threads(threads)


def _replay(module, args, data: str, world: int) -> tuple[list[list[tuple]], list[list[float]]]:
    loaders = [sw.WindowLoader(module.dataset(args, rank=r, world_size=world), num_workers=0) for r in range(world)]
    model = module.model_of(args, loaders[0].dataset)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    batches, losses = [[] for _ in range(world)], [[] for _ in range(world)]
    for epoch in range(args.epochs):
        for ld in loaders:
            ld.set_epoch(epoch)
        for step in zip(*loaders):
            per_rank = [module.packed_loss(model, b, args.patch, torch.device("cpu")) for b in step]
            opt.zero_grad()
            (sum(per_rank) / world).backward()
            opt.step()
            for r, (b, loss) in enumerate(zip(step, per_rank)):
                batches[r].append((epoch, list(b["key"]), b["start"].tolist()))
                losses[r].append(loss.item())
    return batches, losses


def test_pretrain_example_resumes_exactly_under_torchrun(data, tmp_path):
    ckpt, rec = str(tmp_path / "ckpt.pt"), str(tmp_path / "rec")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(EXAMPLES, "pretrain.py"), "--data", data, "--ckpt", ckpt, "--record", rec, *ARGS]
    out = run([*cmd, "--stop-after", "5"], clean_env(MASTER_PORT=str(free_port())))
    assert "stopping at step 5" in out and "rows" in out
    out = run(cmd, clean_env(MASTER_PORT=str(free_port())))
    assert "resumed from" in out and "step 5, epoch 0" in out
    got, (want, losses) = records(rec), reference(data)
    for rank in range(2):
        assert [r["step"] for r in got[rank]] == list(range(1, len(want[rank]) + 1))
        assert [(r["epoch"], r["key"], r["start"]) for r in got[rank]] == want[rank], \
            f"rank {rank}: the resumed run trained on other rows than an uninterrupted run"
        np.testing.assert_allclose([r["loss"] for r in got[rank]], losses[rank], rtol=1e-4, atol=1e-6)
    assert {s for r in got[0] for s in r["source"]} == {0, 1}, "both datasets are mixed in"


def test_the_attention_mask_is_block_diagonal_by_crop_and_causal(data):
    module = pretrain()
    args = module.parse_args(["--data", data, "--ckpt", "unused", *ARGS])
    batch = next(iter(sw.WindowLoader(module.dataset(args, rank=0, world_size=1), num_workers=0)))
    seg, p = batch["segment_ids"], args.patch
    mask = module.attention_mask(seg, p)
    for b in range(seg.shape[0]):
        patches = seg.shape[1] // p
        for i in range(patches):
            for j in range(patches):
                crop_i, crop_j = seg[b, i * p].item(), seg[b, j * p].item()
                want = (crop_i == crop_j and crop_i > 0 and j <= i) or i == j
                assert mask[b, 0, i, j].item() == want, (b, i, j)
    assert (seg > 0).float().mean() > 0.7
