"""Golden batches: every delivery mode yields bitwise the batches recorded before the redesign.

The digests in ``golden_batches.json`` were recorded from streamwin at 73f61a4 (before the
redesign of issue 19) by ``python tests/test_golden.py --record``; the ``auto_`` cases, of
canonical streams (``canonical="auto"``), when their one-phase order became striped chunks. Each case hashes, batch by
batch, the bytes of every field a batch carries (x, y, mask, y_mask, weight, start, source)
and its keys, so any change of content, order, dtype, shape or field set fails here, naming
the case and the first batch that differs. Record again only for a change of behaviour that
is meant, and say so in the commit.

The corpora are written by ``streamwin.pack`` from seeded arrays (conftest.make_sequences),
never binary fixtures. Ranks are simulated in one process (explicit rank/world_size) and
stepped in lockstep, as a DDP job steps them.
"""
from __future__ import annotations

import hashlib
import json
import pathlib
import sys
import tempfile

import numpy as np
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import streamwin as sw  # noqa: E402
from conftest import make_sequences  # noqa: E402

GOLDEN = pathlib.Path(__file__).with_name("golden_batches.json")
FIELDS = ("x", "y", "mask", "y_mask", "weight", "start", "source")
W, S, H, B = 16, 8, 4, 8


def digest(batch: dict) -> str:
    """sha256 (16 hex digits) of a batch's field names, dtypes, shapes and bytes, and its keys."""
    h = hashlib.sha256()
    for name in FIELDS:
        if name in batch:
            t = batch[name].detach().to("cpu").contiguous()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:".encode())
            h.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy().tobytes())
    h.update(("keys:" + "\n".join(batch["key"])).encode())
    h.update(("fields:" + ",".join(sorted(k for k in batch if k != "key"))).encode())
    return h.hexdigest()[:16]


def corpora(root: pathlib.Path) -> dict[str, object]:
    """The datasets of every case, packed into ``root``: plain, zstd, and a small second source for mixing."""
    seqs = make_sequences(90, seed=11, max_len=300)
    small = {f"small{k[3:]}": -v - 1 for k, v in make_sequences(24, seed=12, max_len=120).items()}
    urls = {"plain": str(root / "plain"), "zstd": str(root / "zstd"), "small": str(root / "small")}
    sw.pack(list(seqs.items()), urls["plain"], shard_bytes=30_000, progress=False)
    sw.pack(list(seqs.items()), urls["zstd"], shard_bytes=30_000, compression="zstd", progress=False)
    sw.pack(list(small.items()), urls["small"], shard_bytes=20_000, progress=False)
    return urls


def dataset(url, order: sw.Order = sw.Order(canonical=None), **kw) -> sw.WindowDataset:
    """The cases recorded before the redesign keep their order, one stream per rank and worker (canonical=None,
    the default until "auto"); the ``auto_`` cases take canonical streams (canonical="auto": (8, 1) here; a mix,
    which "auto" gives one stream per rank and worker, passes (8, 1))."""
    args = dict(window=W, stride=S, horizon=H, batch_size=B, shuffle_buffer=48, seed=5, rank=0, world_size=1) | kw
    return sw.WindowDataset(url, order=order, **args)


def run(loader, take: int | None = None, epochs=(0,)) -> list[str]:
    out = []
    try:
        for epoch in epochs:
            loader.set_epoch(epoch)
            for batch in loader:
                out.append(digest(batch))
                if take is not None and len(out) >= take:
                    break
    finally:
        loader.close()
    return out


def lockstep(loaders, take: int | None = None) -> list[str]:
    """Digests of a job's ranks stepped together: rank 0's batch, rank 1's, ... per step."""
    iters = [iter(x) for x in loaders]
    out = []
    try:
        while take is None or len(out) < take * len(loaders):
            got = [next(it, None) for it in iters]
            if all(b is None for b in got):
                break
            assert all(b is not None for b in got), "ranks ran out at different steps"
            out += [digest(b) for b in got]
    finally:
        for x in loaders:
            x.close()
    return out


def resumed(make, take: int) -> list[str]:
    """The batches after ``take``, from a loader restored from the state taken after ``take`` batches."""
    first = make()
    seen = run(first, take)
    state = json.loads(json.dumps(first.state_dict()))
    again = make()
    again.load_state_dict(state)
    return seen + run(again)


def elastic(url, old_world: int, new_world: int, take: int, **kw) -> list[str]:
    """A job of ``old_world`` ranks stopped after ``take`` steps, resumed on ``new_world`` ranks from rank 0's state."""
    old = [sw.WindowLoader(dataset(url, rank=r, world_size=old_world, **kw), num_workers=0) for r in range(old_world)]
    before = lockstep(old, take)
    state = json.loads(json.dumps(old[0].state_dict()))
    new = [sw.WindowLoader(dataset(url, rank=r, world_size=new_world, **kw), num_workers=0) for r in range(new_world)]
    for x in new:
        x.load_state_dict(state)
    return before + lockstep(new)


def cases(urls: dict) -> dict[str, callable]:
    plain, zstd, small = urls["plain"], urls["zstd"], urls["small"]
    pad = dict(crops=sw.Crops(pad=True), order=sw.Order(canonical=None, equalize="pad"))
    mix = dict(mix=sw.Mix(weights=[0.7, 0.3]))
    auto, auto_pad = sw.Order(canonical="auto"), dict(crops=sw.Crops(pad=True), order=sw.Order(equalize="pad"))
    eight = sw.Order(canonical=(8, 1))
    return {
        "in_process": lambda: run(sw.WindowLoader(dataset(plain), num_workers=0), epochs=(0, 1)),
        "in_process_pad": lambda: run(sw.WindowLoader(dataset(plain, **pad), num_workers=0)),
        "workers_1": lambda: run(sw.WindowLoader(dataset(plain), num_workers=1)),
        "workers_2": lambda: run(sw.WindowLoader(dataset(plain, **pad), num_workers=2), epochs=(0, 1)),
        "device_cpu_0": lambda: run(sw.WindowLoader(dataset(plain, **pad), num_workers=0, device="cpu")),
        "device_cpu_2": lambda: run(sw.WindowLoader(dataset(plain, **pad), num_workers=2, device="cpu")),
        "zstd_in_process": lambda: run(sw.WindowLoader(dataset(zstd, **pad), num_workers=0)),
        "zstd_workers_2": lambda: run(sw.WindowLoader(dataset(zstd), num_workers=2)),
        "mixed_in_process": lambda: run(sw.WindowLoader(dataset([plain, small], **mix, **pad), num_workers=0)),
        "mixed_workers_2": lambda: run(sw.WindowLoader(dataset([plain, small], **mix), num_workers=2)),
        "mixed_device_cpu_2": lambda: run(sw.WindowLoader(dataset([plain, small], **mix), num_workers=2,
                                                          device="cpu")),
        "resume_in_process": lambda: resumed(lambda: sw.WindowLoader(dataset(plain, **pad), num_workers=0), 7),
        "resume_workers_2": lambda: resumed(lambda: sw.WindowLoader(dataset(plain), num_workers=2), 5),
        "resume_mixed": lambda: resumed(lambda: sw.WindowLoader(dataset([plain, small], **mix), num_workers=0), 6),
        "two_ranks": lambda: lockstep([sw.WindowLoader(dataset(plain, rank=r, world_size=2), num_workers=0)
                                       for r in range(2)]),
        "elastic_2_to_3": lambda: elastic(plain, 2, 3, 4),
        "elastic_2_to_3_pad": lambda: elastic(plain, 2, 3, 3, **pad),
        "elastic_2_to_3_mixed": lambda: elastic([plain, small], 2, 3, 3, **mix),
        "split_val": lambda: run(sw.WindowLoader(dataset(plain, select=sw.Select(split="val",
                                                                                 split_fractions=(0.5, 0.3, 0.2))),
                                                 num_workers=0)),
        "holdout_test": lambda: run(sw.WindowLoader(dataset(plain, select=sw.Select(split="test", holdout=20)),
                                                    num_workers=0)),
        "skip_errors_no_shuffle": lambda: run(sw.WindowLoader(dataset(plain, read=sw.Read(on_error="skip"),
                                                                      order=sw.Order(canonical=None, shuffle=False)),
                                                              num_workers=0)),
        # canonical streams (canonical="auto": 8 rank slots, one phase), recorded with the striped order (415f365)
        "auto_in_process": lambda: run(sw.WindowLoader(dataset(plain, order=auto), num_workers=0),
                                          epochs=(0, 1)),
        "auto_workers_3_pad": lambda: run(sw.WindowLoader(dataset(plain, **auto_pad), num_workers=3)),
        "auto_device_cpu_2": lambda: run(sw.WindowLoader(dataset(plain, **auto_pad), num_workers=2,
                                                            device="cpu")),
        "auto_zstd_workers_2": lambda: run(sw.WindowLoader(dataset(zstd, order=auto), num_workers=2)),
        "auto_mixed_workers_2": lambda: run(sw.WindowLoader(dataset([plain, small], order=eight, **mix),
                                                               num_workers=2)),
        "auto_resume_workers_2": lambda: resumed(lambda: sw.WindowLoader(dataset(plain, order=auto),
                                                                            num_workers=2), 5),
        "auto_two_ranks": lambda: lockstep([sw.WindowLoader(dataset(plain, rank=r, world_size=2, order=auto),
                                                               num_workers=1) for r in range(2)]),
        "auto_elastic_2_to_4_mixed": lambda: elastic([plain, small], 2, 4, 3, order=eight, **mix),
    }


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    return corpora(tmp_path_factory.mktemp("golden"))


GOLDEN_CASES = sorted(json.loads(GOLDEN.read_text())) if GOLDEN.exists() else []


@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_batches_are_bitwise_the_recorded_ones(urls, case):
    want = json.loads(GOLDEN.read_text())[case]
    got = cases(urls)[case]()
    assert len(got) == len(want), f"{case}: {len(got)} batches, recorded {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"{case}: batch {i} differs from the recorded one ({g} != {w})"


def test_the_canonical_order_is_one_for_every_worker_count_and_resume():
    """Recorded runs of canonical streams ("auto"): 3 workers and 2 (device="cpu") made the same batches, and a
    resume after 5 batches with 2 workers continued the in-process epoch."""
    got = json.loads(GOLDEN.read_text())
    assert got["auto_workers_3_pad"] == got["auto_device_cpu_2"]
    n = len(got["auto_resume_workers_2"])
    assert n > 100 and got["auto_resume_workers_2"] == got["auto_in_process"][:n]


def test_every_case_is_recorded(urls):
    assert sorted(cases(urls)) == GOLDEN_CASES


def record() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        urls = corpora(pathlib.Path(tmp))
        out = {name: make() for name, make in sorted(cases(urls).items())}
    GOLDEN.write_text(json.dumps(out, indent=0, sort_keys=True) + "\n")
    print({k: len(v) for k, v in out.items()})


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/test_golden.py --record   (rewrites tests/golden_batches.json)")
    record()
