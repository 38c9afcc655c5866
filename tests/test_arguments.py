"""Every public argument of WindowDataset is checked once, up front: a bad value is one
ValueError or TypeError whose message names the argument as the user typed it and says what
would be valid, never an internal name (block_windows) or a silently truncated value."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

import streamwin as sw

URL = "/nonexistent/streamwin-dataset"  # validation comes first: no dataset is needed to refuse an argument
INTERNAL = ("block_windows", "PlanConfig", "WindowSpec", "SplitSpec")

BAD = [
    ("window", 2.5), ("window", "64"), ("window", True), ("window", 0), ("window", None),
    ("stride", 0), ("stride", 1.5), ("stride", False),
    ("horizon", -1), ("horizon", 0.5),
    ("pad", "yes"), ("pad", 1),
    ("shuffle", "no"), ("shuffle", None),
    ("shuffle_buffer", 0), ("shuffle_buffer", 2.5), ("shuffle_buffer", "4"),
    ("seed", -1), ("seed", 1.5), ("seed", "0"), ("seed", True),
    ("batch_size", 2.5), ("batch_size", "4"), ("batch_size", 0), ("batch_size", True), ("batch_size", -8),
    ("equalize", "repeat"), ("equalize", None),
    ("rank", -1), ("rank", 1.0),
    ("world_size", 0), ("world_size", 2.5),
    ("storage_options", "anon=true"), ("storage_options", [("anon", True)]),
    ("slice_windows", 0), ("slice_windows", 2.5),
    ("readahead", -1), ("readahead", 1.5),
    ("prefetch", -1), ("prefetch", "2"),
    ("retries", -1), ("retries", 2.5),
    ("retry_backoff", -0.1), ("retry_backoff", "0.2"), ("retry_backoff", math.nan), ("retry_backoff", math.inf),
    ("retry_backoff", True),
    ("on_error", "ignore"),
    ("cache_dir", 5),
    ("cache_limit", -1), ("cache_limit", 2.5), ("cache_limit", "10GB"),
    ("split", "validation"), ("split", "Train"),
    ("split_fractions", (0.5, 0.5)), ("split_fractions", (0.8, 0.3, -0.1)), ("split_fractions", (0.5, 0.5, 0.5)),
    ("split_fractions", "abc"), ("split_fractions", (0.8, 0.1, math.nan)),
    ("split_seed", -1), ("split_seed", 0.5),
    ("holdout", -1), ("holdout", 2.5),
]


def build(url: str = URL, **overrides):
    """A dataset of ``url``: the default names none, for arguments refused before any dataset is read."""
    kwargs = {"window": 16} | overrides
    return sw.WindowDataset(url, **kwargs)


@pytest.mark.parametrize(("name", "value"), BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_a_bad_argument_is_refused_naming_it(name, value):
    with pytest.raises((ValueError, TypeError)) as info:
        build(**{name: value})
    message = str(info.value)
    assert re.search(rf"\b{name}\b", message), f"the message does not name {name}: {message}"
    assert "got " in message and repr(value) in message, f"the message does not show what was given: {message}"
    assert not any(word in message for word in INTERNAL), f"internal name in: {message}"


@pytest.mark.parametrize(("overrides", "name"), [
    ({"rank": 2, "world_size": 2}, "rank"),
    ({"holdout": 24}, "holdout"),
    ({"split": "val", "holdout": -3}, "holdout"),
])
def test_arguments_that_disagree_are_refused_naming_them(overrides, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        build(**overrides)


def test_url_must_be_a_path_or_url():
    with pytest.raises(TypeError, match=r"\burl\b.*got 5"):
        sw.WindowDataset(5, window=16)


def test_good_arguments_are_accepted_numpy_integers_included(tiny):
    ds = build(tiny[0], window=np.int64(16), stride=np.int32(8), horizon=np.uint8(2), batch_size=np.int64(4), seed=np.int64(3),
               shuffle_buffer=np.int64(100), pad=np.bool_(True), shuffle=False, rank=np.int64(1), world_size=2,
               storage_options={}, slice_windows=10, readahead=0, prefetch=0, retries=0, retry_backoff=0,
               on_error="skip", cache_dir=None, cache_limit=0, split="train", split_fractions=[0.5, 0.25, 0.25],
               split_seed=7, holdout=0)
    assert (ds.batch_size, ds.seed, ds.spec.window, ds.spec.stride) == (4, 3, 16, 8)


@pytest.mark.parametrize("epoch", [-1, 1.5, "2", True, None])
def test_set_epoch_refuses_what_is_not_an_epoch(tiny, epoch):
    loader = sw.WindowLoader(build(tiny[0], batch_size=4), num_workers=0)
    with pytest.raises((ValueError, TypeError), match=r"\bepoch\b.*got"):
        loader.set_epoch(epoch)
    assert loader.epoch == 0
    loader.set_epoch(np.int64(3))
    assert loader.epoch == 3


# -- what cannot fit is refused up front; devices and start methods as DataLoader takes them ---------

@pytest.mark.parametrize(("overrides", "workers", "named"), [
    ({"window": 10**12}, 0, "window=1000000000000"),
    ({"batch_size": 10**9}, 1, "batch_size=1000000000"),
    ({"world_size": 10**9, "rank": 0}, 0, "world_size=1000000000"),
])
def test_arguments_that_cannot_fit_in_memory_are_refused_with_the_size(tiny, overrides, workers, named):
    url, _ = tiny
    with pytest.raises(ValueError, match=r"would need [\d,.]+ GB of memory, more than this machine's") as e:
        loader = sw.WindowLoader(sw.WindowDataset(url, **({"window": 16} | overrides)), num_workers=workers)
        next(iter(loader))  # a batch is refused when the dataset is made; a world's plan when it is made
    assert named in str(e.value)
    if "world_size" in overrides:
        with pytest.raises(ValueError, match="GB of memory"):
            len(loader)


def test_a_cuda_device_without_cuda_says_so(tiny):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=r"device='cuda', but .*(without CUDA|no CUDA device).*device=None"):
        sw.WindowLoader(build(tiny[0]), device="cuda")
    with pytest.raises(ValueError, match=r"device must be .*got 'gpu'"):
        sw.WindowLoader(build(tiny[0]), device="gpu")


def test_multiprocessing_context_takes_a_name_or_a_context_and_refuses_an_unknown_name(tiny):
    import multiprocessing

    with pytest.raises(ValueError, match=r"multiprocessing_context must be one of .*'fork'.* got 'frok'"):
        sw.WindowLoader(build(tiny[0]), multiprocessing_context="frok")
    url, _ = tiny
    ds = sw.WindowDataset(url, window=16, batch_size=4)
    ctx = multiprocessing.get_context("fork")
    loader = sw.WindowLoader(ds, num_workers=1, multiprocessing_context=ctx)
    assert sum(1 for _ in loader) == len(loader) > 0
    loader.close()
