"""Every public argument of WindowDataset is checked once, up front: a bad value is one
ValueError or TypeError whose message names the argument as the user typed it (in its option
group, the group too) and says what would be valid, never an internal name (block_windows) or a
silently truncated value."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

import streamwin as sw

URL = "/nonexistent/streamwin-dataset"  # validation comes first: no dataset is needed to refuse an argument
INTERNAL = ("block_windows", "PlanConfig", "WindowSpec", "SplitSpec")

BAD = [  # (the option group, or None for WindowDataset's own arguments; the argument; a bad value)
    (None, "window", 2.5), (None, "window", "64"), (None, "window", True), (None, "window", 0), (None, "window", None),
    (None, "stride", 0), (None, "stride", 1.5), (None, "stride", False),
    (None, "horizon", -1), (None, "horizon", 0.5),
    (sw.Crops, "pad", "yes"), (sw.Crops, "pad", 1),
    (sw.Order, "shuffle", "no"), (sw.Order, "shuffle", None),
    (None, "shuffle_buffer", 0), (None, "shuffle_buffer", 2.5), (None, "shuffle_buffer", "4"),
    (None, "seed", -1), (None, "seed", 1.5), (None, "seed", "0"), (None, "seed", True),
    (None, "batch_size", 2.5), (None, "batch_size", "4"), (None, "batch_size", 0), (None, "batch_size", True),
    (None, "batch_size", -8),
    (sw.Order, "equalize", "repeat"), (sw.Order, "equalize", None),
    (None, "rank", -1), (None, "rank", 1.0),
    (None, "world_size", 0), (None, "world_size", 2.5),
    (sw.Read, "storage_options", "anon=true"), (sw.Read, "storage_options", [("anon", True)]),
    (sw.Order, "slice_windows", 0), (sw.Order, "slice_windows", 2.5),
    (sw.Read, "readahead", -1), (sw.Read, "readahead", 1.5),
    (sw.Read, "prefetch", -1), (sw.Read, "prefetch", "2"),
    (sw.Read, "retries", -1), (sw.Read, "retries", 2.5),
    (sw.Read, "retry_backoff", -0.1), (sw.Read, "retry_backoff", "0.2"), (sw.Read, "retry_backoff", math.nan),
    (sw.Read, "retry_backoff", math.inf), (sw.Read, "retry_backoff", True),
    (sw.Read, "on_error", "ignore"),
    (sw.Read, "cache_dir", 5),
    (sw.Read, "cache_limit", -1), (sw.Read, "cache_limit", 2.5), (sw.Read, "cache_limit", "10GB"),
    (sw.Select, "split", "validation"), (sw.Select, "split", "Train"),
    (sw.Select, "split_fractions", (0.5, 0.5)), (sw.Select, "split_fractions", (0.8, 0.3, -0.1)),
    (sw.Select, "split_fractions", (0.5, 0.5, 0.5)), (sw.Select, "split_fractions", "abc"),
    (sw.Select, "split_fractions", (0.8, 0.1, math.nan)),
    (sw.Select, "split_seed", -1), (sw.Select, "split_seed", 0.5),
    (sw.Select, "holdout", -1), (sw.Select, "holdout", 2.5),
]


def build(url: str = URL, **overrides):
    """A dataset of ``url``: the default names none, for arguments refused before any dataset is read."""
    kwargs = {"window": 16} | overrides
    return sw.WindowDataset(url, **kwargs)


@pytest.mark.parametrize(("group", "name", "value"), BAD,
                         ids=[f"{g.KEYWORD + '.' if g else ''}{n}={v!r}" for g, n, v in BAD])
def test_a_bad_argument_is_refused_naming_it(group, name, value):
    with pytest.raises((ValueError, TypeError)) as info:
        build(**{name: value}) if group is None else build(**{group.KEYWORD: group(**{name: value})})
    message = str(info.value)
    assert re.search(rf"\b{name}\b", message), f"the message does not name {name}: {message}"
    assert "got " in message and repr(value) in message, f"the message does not show what was given: {message}"
    assert not any(word in message for word in INTERNAL), f"internal name in: {message}"
    if group is not None:
        typed = f"{group.KEYWORD}=sw.{group.__name__}({name}={value!r})"
        assert message.startswith(typed + ": "), f"the message does not start with {typed}: {message}"


@pytest.mark.parametrize(("overrides", "name"), [
    ({"rank": 2, "world_size": 2}, "rank"),
    ({"select": lambda: sw.Select(holdout=24)}, "holdout"),
    ({"select": lambda: sw.Select(split="val", holdout=-3)}, "holdout"),
])
def test_arguments_that_disagree_are_refused_naming_them(overrides, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        build(**{k: v() if callable(v) else v for k, v in overrides.items()})


def test_url_must_be_a_path_or_url():
    with pytest.raises(TypeError, match=r"\burl\b.*got 5"):
        sw.WindowDataset(5, window=16)


def test_good_arguments_are_accepted_numpy_integers_included(tiny):
    ds = build(tiny[0], window=np.int64(16), stride=np.int32(8), horizon=np.uint8(2), batch_size=np.int64(4), seed=np.int64(3),
               shuffle_buffer=np.int64(100), rank=np.int64(1), world_size=2, crops=sw.Crops(pad=np.bool_(True)),
               order=sw.Order(shuffle=False, slice_windows=10),
               read=sw.Read(storage_options={}, readahead=0, prefetch=0, retries=0, retry_backoff=0, on_error="skip",
                            cache_dir=None, cache_limit=0),
               select=sw.Select(split="train", split_fractions=[0.5, 0.25, 0.25], split_seed=7, holdout=0))
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
