"""ReadOptions refuses what WindowDataset's read options (sw.Read) refuse, with the same error naming the argument."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

import streamwin as sw
from streamwin.read import ReadOptions

BAD = [
    ("retries", -1), ("retries", 2.5), ("retries", True), ("retries", "3"),
    ("retry_backoff", -0.1), ("retry_backoff", float("nan")), ("retry_backoff", float("inf")), ("retry_backoff", "1"),
    ("retry_backoff", False), ("on_error", "ignore"), ("on_error", None), ("on_error", 1),
    ("storage_options", ["anon"]), ("storage_options", "anon=True"),
    ("cache_dir", 3), ("cache_dir", b"/tmp"),
    ("cache_limit", -5), ("cache_limit", 1e9), ("cache_limit", np.bool_(True)),
]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_bad_options_are_refused_as_window_dataset_refuses_them(tmp_path, name, value):
    with pytest.raises((TypeError, ValueError)) as want:
        sw.WindowDataset(str(tmp_path), window=4, read=sw.Read(**{name: value}))  # checked before anything is read
    with pytest.raises(type(want.value)) as got:
        ReadOptions(**{name: value})
    assert str(want.value) == f"read=sw.Read({name}={value!r}): {got.value}" and name in str(got.value)


def test_good_options_are_kept_and_normalized(tmp_path):
    opts = ReadOptions(storage_options={"anon": True}, retries=np.int64(3), retry_backoff=1, on_error="skip",
                       cache_dir=pathlib.Path(tmp_path), cache_limit=np.int32(10))
    assert (opts.retries, opts.retry_backoff, opts.cache_limit) == (3, 1.0, 10)
    assert type(opts.retries) is int and type(opts.retry_backoff) is float and type(opts.cache_limit) is int
    assert opts.storage_options == {"anon": True} and opts.on_error == "skip"
    assert ReadOptions() == ReadOptions(None, 5, 0.2, "raise", None, None)
    with pytest.raises(AttributeError):
        opts.retries = 4  # frozen
