"""A transform's output is refused where it cannot mean a batch: rows dropped or added, dtypes no tensor holds; a
worker's error reads as it would in one process (issue 43: items 2, 10, and a KeyError quoted twice)."""
from __future__ import annotations

import os
import warnings
from collections import Counter

import numpy as np
import pytest

import streamwin as sw
from conftest import make_sequences, opened, our_children


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("checks") / "ds")
    sw.pack(list(make_sequences(40).items()), url, progress=False)
    return url


def dataset(url, **kw):
    return sw.WindowDataset(url, window=16, stride=8, batch_size=32, **kw)


def drops_a_row(batch, rng):
    return {"x": batch["x"][:31]}


def doubles_x(batch, rng):
    return {"x": np.concatenate([batch["x"], batch["x"]]), "label": batch["start"]}


def drops_a_row_later(batch, rng):
    return {"x": batch["x"][:31] if batch["x"].any() else batch["x"]}


def objects(batch, rng):
    return {"x": batch["x"].astype(object)}


def objects_later(batch, rng):
    return {"x": batch["x"].astype(object) if batch["x"].any() else batch["x"]}


def strings(batch, rng):
    return {"x": batch["x"], "name": np.array(["a"] * len(batch["x"]))}


def a_missing_column_later(batch, rng):
    return {"x": batch["no_such_column"] if batch["x"].any() else batch["x"]}


def reshapes_later(batch, rng):
    x = batch["x"]
    return {"x": x[:, :8] if x.any() else x}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_transform_that_changes_the_rows_is_refused_naming_the_key_and_counts(url, workers):
    with pytest.raises(ValueError, match=r"drops_a_row returned 'x' of shape \(31, 16, 3\): 31 rows out, 32 in "
                                         r"\(its 'key' keeps 32, one a window\): a transform keeps the rows"):
        sw.WindowLoader(dataset(url), num_workers=workers, transform=drops_a_row)
    with pytest.raises(ValueError, match=r"doubles_x returned 'x' of shape \(64, 16, 3\): 64 rows out, 32 in"):
        sw.WindowLoader(dataset(url), num_workers=workers, transform=doubles_x)
    loader = opened(sw.WindowLoader(dataset(url), num_workers=workers, transform=drops_a_row_later))
    with pytest.raises(ValueError, match=r"drops_a_row_later returned 'x' of shape \(31, 16, 3\): 31 rows out, 32 in"):
        list(loader)
    loader = opened(sw.WindowLoader(dataset(url), num_workers=workers, transform=reshapes_later))
    with pytest.raises(ValueError, match=r"returned 'x' as float32 \(32, 8, 3\), its first batch as float32 "
                                         r"\(32, 16, 3\): shapes and dtypes are fixed"):
        list(loader)


def test_a_packed_batch_keeps_its_per_crop_fields_whole(url):
    ds = sw.WindowDataset(url, window=16, batch_size=4, crops=sw.Crops(pack_length=48, min_window=8, window_multiple=4))

    def cuts_starts(batch, rng):
        return {"x": batch["x"], "start": batch["start"][:5]}
    with pytest.raises(ValueError, match=r"returned 'start' of shape \(5,\): 5 rows out, \d+ in \(one a crop of the "
                                         r"packed rows: per-crop 'start' has \d+\)"):
        sw.WindowLoader(ds, num_workers=0, transform=cuts_starts)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_output_no_tensor_holds_is_named_with_its_dtype_in_one_process_and_with_workers(url, workers):
    with pytest.raises(TypeError, match=r"transform objects returned 'x' as dtype object \(32, 16, 3\): a batch's "
                                        "arrays live in shared memory"):
        sw.WindowLoader(dataset(url), num_workers=workers, transform=objects)
    with pytest.raises(TypeError, match=r"transform strings returned 'name' as dtype <U1 \(32,\)"):
        sw.WindowLoader(dataset(url), num_workers=workers, transform=strings)
    loader = opened(sw.WindowLoader(dataset(url), num_workers=workers, transform=objects_later))
    with pytest.raises(TypeError, match=r"objects_later returned 'x' as dtype object \(32, 16, 3\)") as e:
        list(loader)
    assert "counters" not in repr(e.value.__context__) and "counters" not in repr(e.value.__cause__)
    loader.close()
    assert not our_children()


@pytest.mark.parametrize("workers", [0, 1])
def test_a_missing_column_reads_as_one_key_error(url, workers):
    loader = opened(sw.WindowLoader(dataset(url), num_workers=workers, transform=a_missing_column_later))
    with pytest.raises(KeyError) as e:
        list(loader)
    assert e.value.args == ("no_such_column",) and str(e.value) == "'no_such_column'"


def who(batch, rng):
    return {"x": batch["x"], "pid": np.full(len(batch["x"]), os.getpid(), dtype=np.int64)}


def test_workers_left_idle_by_chunks_of_steps_are_warned_about_with_the_reason(url):
    """A transform sees whole batches, so a rank's workers take chunks of Q = shuffle_buffer / G steps in turn: an
    epoch of fewer steps than workers x Q leaves some with nothing, which the loader says (and why)."""
    loader = opened(sw.WindowLoader(dataset(url), num_workers=2, transform=who))
    with pytest.warns(RuntimeWarning, match=r"1 of this rank's 2 workers get no batch this epoch: a transform sees "
                                            r"whole batches, .* chunks of 313 steps = shuffle_buffer 10000 / global "
                                            r"batch 32 in turn .* this epoch has \d+ steps, 1 chunk\(s\)"):
        pids = Counter(int(b["pid"][0]) for b in loader)
    assert len(pids) == 1  # every batch from one worker process
    loader = opened(sw.WindowLoader(dataset(url, shuffle_buffer=64), num_workers=2, transform=who))  # Q = 2 steps
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pids = Counter(int(b["pid"][0]) for b in loader)
    assert len(pids) == 2 and not [w for w in caught if "get no batch" in str(w.message)]


def doubles(batch, rng):
    return {"x": batch["x"] * 2}


def test_a_loader_holds_one_dataset_that_carries_its_transform(url):
    """``loader.dataset`` is the one dataset a loader plans, checkpoints and streams: with a transform, a copy that
    carries it (the dataset passed in is left as it was), its state the same as without; a loader made of another
    loader's dataset applies only its own transform."""
    ds = dataset(url)
    plain = opened(sw.WindowLoader(ds, num_workers=0))
    loader = opened(sw.WindowLoader(ds, num_workers=0, transform=doubles))
    assert [v for v in vars(loader).values() if isinstance(v, sw.WindowDataset)] == [loader.dataset]
    assert loader.dataset.transform is not None and ds.transform is None and plain.dataset is ds

    def xs(ld):
        return [b["x"].numpy().copy() for b in ld]
    want = xs(plain)
    assert len(want) > 2 and all(np.array_equal(a, 2 * b) for a, b in zip(xs(loader), want, strict=True))
    assert loader.state_dict() == plain.state_dict()
    again = opened(sw.WindowLoader(loader.dataset, num_workers=0))
    assert all(np.array_equal(a, b) for a, b in zip(xs(again), want, strict=True))
    twice = opened(sw.WindowLoader(loader.dataset, num_workers=0, transform=doubles))
    assert all(np.array_equal(a, 2 * b) for a, b in zip(xs(twice), want, strict=True))
