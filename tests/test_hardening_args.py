"""Numbers past every check (issue 28, item 7): each refused in one clear error naming what the user typed.

Before: ``window=2**61..2**63`` and ``horizon=2**63`` were accepted (the memory check computed
the batch's size in int64 and overflowed), ``window=2**64``, ``window=2**62, pad=True`` and
``shuffle_buffer=2**63`` were raw OverflowErrors, a loader state took ``shuffle=1``,
``pad=0`` and keys of no state, and a damaged npy header's error showed the Python tokenizer.
"""
from __future__ import annotations

import copy
import re

import numpy as np
import pytest

import streamwin as sw
from streamwin.formats import npy as npyfmt

pytestmark = pytest.mark.timeout(120)

HUGE = [  # the arguments, an option group's as a dict of its fields (made in the test: its check refuses them)
    (dict(window=2**61), "window"), (dict(window=2**62), "window"), (dict(window=2**63), "window"),
    (dict(window=2**64), "window"), (dict(window=8, horizon=2**63), "horizon"),
    (dict(window=2**62, crops=dict(pad=True)), "window"), (dict(window=8, shuffle_buffer=2**63), "shuffle_buffer"),
    (dict(window=8, stride=2**64), "stride"), (dict(window=8, order=dict(slice_windows=2**63)), "slice_windows"),
    (dict(window=8, crops=dict(windows_per_sequence=2**63)), "windows_per_sequence"),
    (dict(window=8, batch_size=2**40), "batch_size"),
    (dict(window=8, select=dict(split="train", holdout=2**63)), "holdout"),
    (dict(window=8, crops=dict(pack_length=2**63)), "pack_length"),
    (dict(window=2**40, batch_size=1, crops=dict(pad=True)), "window=1099511627776"),  # in range; no memory holds it
]
GROUPS = {"crops": sw.Crops, "order": sw.Order, "select": sw.Select}


@pytest.mark.parametrize("kw, named", HUGE, ids=[f"{n}-{i}" for i, (_, n) in enumerate(HUGE)])
def test_numbers_too_large_are_refused_naming_the_argument(tiny, kw, named):
    url, _ = tiny
    with pytest.raises(ValueError) as e:  # not an OverflowError, not a loader that starts
        sw.WindowDataset(url, **{k: GROUPS[k](**v) if k in GROUPS else v for k, v in kw.items()})
    assert named in str(e.value) and "OverflowError" not in str(e.value)


def test_the_largest_accepted_numbers_still_plan(tiny):
    url, _ = tiny
    ds = sw.WindowDataset(url, window=8, stride=2**50, shuffle_buffer=2**40 - 1, batch_size=4)
    assert len(sw.WindowLoader(ds, num_workers=0)) > 0  # one window per sequence, nothing overflows


@pytest.fixture(scope="module")
def state(tiny):
    url, _ = tiny
    loader = sw.WindowLoader(sw.WindowDataset(url, window=8, batch_size=4), num_workers=0)
    it = iter(loader)
    next(it)
    return url, loader.state_dict()


@pytest.mark.parametrize("where, key, value", [("inputs", "shuffle", 1), ("inputs", "pad", 0),
                                               ("inputs", "window", 8.0), ("inputs", "seed", 0.0),
                                               ("inputs", "extra", None), ("state", "extra", 1),
                                               ("rest_of", "extra", 1)])
def test_a_state_with_wrong_types_or_unknown_keys_is_refused(state, where, key, value):
    url, good = state
    bad = copy.deepcopy(good)
    if where == "state":
        bad[key] = value
    elif where == "inputs":
        bad["inputs"][key] = value
    else:
        bad["rest_of"] = [{"inputs": dict(good["inputs"]), "batches": 0, key: value}]
    loader = sw.WindowLoader(sw.WindowDataset(url, window=8, batch_size=4), num_workers=0)
    field = f"{'rest_of[0].' if where == 'rest_of' else ''}{'inputs.' if where == 'inputs' else ''}{key}"
    with pytest.raises(sw.StateMismatchError, match=re.escape(f"field {field} ")):
        loader.load_state_dict(bad)
    loader.load_state_dict(good)  # the state itself still loads


def test_a_bad_npy_header_is_named_in_plain_words():
    header = npyfmt.npy_header(np.zeros((5, 2), "f4"))
    cut = header.replace(b"(5, 2)", b"(5, (2")  # an unclosed parenthesis: the tokenizer's TokenError
    with pytest.raises(ValueError) as e:
        npyfmt.parse_npy_header(cut)
    text = str(e.value)
    assert "TokenError" not in text and "EOF in multi-line" not in text
    assert "bad .npy header" in text and "'shape': (5, (2" in text


def test_numpy_arguments_make_a_state_that_loads(tiny):
    """numpy integers and bools are accepted as arguments; their state's plan inputs must be plain JSON (before:
    the state of such a loader was refused by its own load_state_dict)."""
    url, _ = tiny

    def make():
        ds = sw.WindowDataset(url, window=np.int64(8), stride=np.int32(4), seed=np.int64(3), batch_size=np.int64(4),
                              shuffle_buffer=np.int64(100),
                              crops=sw.Crops(pad=np.bool_(False)),
                              order=sw.Order(shuffle=np.bool_(True)),
                              select=sw.Select(split="train", split_seed=np.int64(2),
                                               split_fractions=[np.float32(0.5), np.float32(0.25), np.float32(0.25)]))
        return sw.WindowLoader(ds, num_workers=0)

    full = [b["start"].tolist() for b in make()]
    loader = make()
    it = iter(loader)
    for _ in range(3):
        next(it)
    again = make()
    again.load_state_dict(loader.state_dict())
    assert [b["start"].tolist() for b in again] == full[3:]
