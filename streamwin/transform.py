"""A user's transform of every batch, run where the batch is gathered: in the worker, before the hand-off.

``WindowLoader(ds, transform=fn)`` calls ``fn(batch, rng)`` on each batch: a dict of numpy
arrays (every field of the batch but ``seq``; ``key`` is made later, from ``seq``), and
``rng``, a ``WindowRandom`` (window_random.py) whose draws give row i from window i's own
stream, keyed by (seed, epoch, the window), so a random transform gives a window the same
values on any number of ranks and workers and after any resume. It returns a dict of numpy
arrays, each with the batch's rows as its first dimension (a packed batch's per-crop fields:
their crops): what the batch then holds (``key`` is added; ``source`` and, for packed rows,
``crops`` are carried over from the input). Its outputs' keys, shapes and dtypes are learned
once, from ``fn`` on a batch of zeros of the dataset's layout (on a thread of its own, so
that a transform that hangs there is named within ``timeout``), and the batch slots are
sized for them; a later batch whose output differs is an error naming the key. The
transform's work is then the worker's, and the trainer's hand-off stays one slot number.
"""
from __future__ import annotations

import _thread
import copy
import sys
import traceback
import warnings
from typing import Any, Callable

import numpy as np
import torch

from streamwin.batch import BatchLayout
from streamwin.window_random import WindowRandom, batch_keys

CARRIED = ("source", "crops")  # carried from the input batch to the output (keys decode by source; crops cut)
HIDDEN = ("seq",)  # not shown to the transform: becomes ``key``
TIMEOUT_S = 600.0  # WindowLoader's default timeout: seconds with no batch from a worker before it is an error
WARN_S = 60.0  # a wait this long (or half the timeout, if less) is warned about, naming who and where


def warn_after(timeout: float | None) -> float:
    """Seconds of waiting after which a wait is warned about: WARN_S, or half of a shorter ``timeout``."""
    return WARN_S if timeout is None else min(WARN_S, timeout / 2)


def check_timeout(timeout: Any) -> float | None:
    """``timeout`` as seconds > 0, or None (wait for ever); ValueError naming it otherwise."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)) or \
            not 0 < timeout < float("inf"):
        raise ValueError(f"timeout must be None (wait for ever) or seconds > 0, got {timeout!r}")
    return float(timeout)


class Transform:
    """``fn`` with the batch layouts before and after it (the latter learned from ``fn`` on zeros)."""

    def __init__(self, fn: Callable[[dict, WindowRandom], dict], layout: BatchLayout, timeout: float | None = TIMEOUT_S):
        if not callable(fn):
            raise TypeError(f"transform must be a function fn(batch, rng) -> batch, got {type(fn).__name__}")
        self.fn, self.input = fn, layout
        views = layout.views(np.zeros(layout.nbytes, dtype=np.uint8))
        self.rows = len(views["x"])
        self.per_crop = {k: len(v) for k, v in views.items() if "crops" in views and k in layout.per_crop}
        out = self._probe(views, timeout)
        wanted = [(k, v.dtype, v.shape) for k, v in out.items() if k not in CARRIED]
        wanted += [(f.name, f.dtype, f.shape) for f in layout.fields if f.name in HIDDEN + CARRIED]
        self.output = BatchLayout.of(wanted, tuple(k for k in layout.per_crop if k in out or k in HIDDEN + CARRIED))
        self.shapes = {k: (v.dtype, v.shape) for k, v in out.items() if k not in CARRIED}

    def _probe(self, views: dict[str, np.ndarray], timeout: float | None) -> dict:
        """``fn`` on a batch of zeros, on a thread of its own: a warning naming where it is after
        ``warn_after(timeout)`` s, a TimeoutError after ``timeout`` (it would block WindowLoader(...) for ever).
        A bare thread (``_thread``): a threading.Thread leaves a weakref callback behind, where a Ctrl-C is lost."""
        batch = {k: v for k, v in views.items() if k not in HIDDEN}
        rng = WindowRandom(batch_keys(0, 0, views, self.rows))
        result: dict[str, Any] = {}
        done = _thread.allocate_lock()
        done.acquire()

        def run() -> None:
            try:
                result["out"] = self.call(batch, rng, None)
            except BaseException as e:  # raised again on the caller's thread
                result["error"] = e
            finally:
                done.release()
        ident = _thread.start_new_thread(run, ())
        first = warn_after(timeout)
        if not done.acquire(timeout=first):
            warnings.warn(f"streamwin: transform {_name(self.fn)} has not returned for {first:g} s on a batch of "
                          f"zeros (run once to learn its outputs); it is at:\n{thread_stack(ident)}",
                          RuntimeWarning, stacklevel=6)
            if not done.acquire(timeout=-1 if timeout is None else timeout - first):
                raise TimeoutError(f"transform {_name(self.fn)} did not return within timeout={timeout:g} s on a "
                                   "batch of zeros (run once to learn its outputs; WindowLoader(timeout=...) sets the "
                                   f"limit); it is at:\n{thread_stack(ident)}")
        if "error" in result:
            raise result.pop("error")
        return result["out"]

    def call(self, batch: dict, rng: WindowRandom, shapes: dict | None) -> dict:
        """``fn(batch, rng)``, its output checked: a dict of numpy arrays of the batch's rows, of dtypes a tensor
        holds (and of the learned shapes, once known)."""
        out = self.fn(batch, rng)
        if not isinstance(out, dict) or not all(isinstance(k, str) and isinstance(v, np.ndarray) for k, v in out.items()):
            raise TypeError(f"transform {_name(self.fn)} must return a dict of numpy arrays, got "
                            f"{_describe(out)}")
        if "key" in out or "seq" in out:
            raise ValueError(f"transform {_name(self.fn)} returned 'key' or 'seq': the loader makes the keys itself")
        if shapes is None:
            for k, v in out.items():
                if k not in CARRIED:
                    self._check_output(k, v)
            return out
        got = {k for k in out if k not in CARRIED}
        if got != set(shapes):
            raise ValueError(f"transform {_name(self.fn)} returned keys {sorted(got)}, its first batch "
                             f"{sorted(shapes)}: the outputs are fixed after the first batch")
        for k, (dtype, shape) in shapes.items():
            if out[k].dtype != dtype or out[k].shape != shape:
                self._check_output(k, out[k])
                raise ValueError(f"transform {_name(self.fn)} returned {k!r} as {out[k].dtype} {out[k].shape}, "
                                 f"its first batch as {dtype} {shape}: shapes and dtypes are fixed after the "
                                 "first batch (the batch slots are sized once)")
        return out

    def _check_output(self, key: str, value: np.ndarray) -> None:
        """TypeError naming ``key`` for a dtype no tensor holds; ValueError naming it and the counts for an output
        whose first dimension is not the batch's rows (a packed batch's per-crop field: its crops)."""
        try:
            torch.from_numpy(np.empty(0, dtype=value.dtype))
        except (TypeError, RuntimeError, ValueError):
            raise TypeError(f"transform {_name(self.fn)} returned {key!r} as dtype {value.dtype} {value.shape}: a "
                            "batch's arrays live in shared memory as raw bytes and become torch tensors, which "
                            "hold bool, integers, floats and complex; return codes (e.g. np.unique(..., "
                            "return_inverse=True)) or numbers instead") from None
        want = self.per_crop.get(key, self.rows)
        if value.ndim == 0 or len(value) != want:
            got = 0 if value.ndim == 0 else len(value)
            what = f"one a crop of the packed rows: per-crop {key!r} has {want}" if key in self.per_crop else \
                f"its 'key' keeps {want}, one a window"
            raise ValueError(f"transform {_name(self.fn)} returned {key!r} of shape {value.shape}: {got} rows out, "
                             f"{want} in ({what}): a transform keeps the rows (every output's first dimension is "
                             "the batch's rows); select windows with select=sw.Select(where=...) or "
                             "mix=sw.Mix(weights=...) instead")

    def gatherer(self, gatherer: Any, seed: int, epoch: int) -> "TransformGather":
        """``gatherer`` followed by this transform, its draws keyed by (``seed``, ``epoch``, each window)."""
        return TransformGather(gatherer, self, seed, epoch)


class TransformGather:
    """Gathers a batch into a buffer of its own, transforms it, and writes the output into the batch's slot."""

    def __init__(self, gatherer: Any, transform: Transform, seed: int, epoch: int):
        self.gatherer, self.transform, self.seed, self.epoch = gatherer, transform, seed, epoch
        self.views = transform.input.views(np.empty(transform.input.nbytes, dtype=np.uint8))

    def gather(self, parts: list, out: dict[str, np.ndarray], counts: np.ndarray) -> dict[str, np.ndarray]:
        batch = self.gatherer.gather(parts, self.views, counts)
        t = self.transform
        rng = WindowRandom(batch_keys(self.seed, self.epoch, batch, t.rows))
        got = t.call({k: v for k, v in batch.items() if k not in HIDDEN}, rng, t.shapes)
        for k, v in got.items():
            if k not in CARRIED:
                np.copyto(out[k], v)
        for k in HIDDEN + CARRIED:
            if k in out:
                np.copyto(out[k], batch[k])
        return out


def thread_stack(ident: int) -> str:
    """Where thread ``ident`` is now: its Python stack, innermost call last."""
    frame = sys._current_frames().get(ident)
    return "".join(traceback.format_stack(frame)) if frame is not None else "(it has ended)\n"


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _describe(out: Any) -> str:
    if isinstance(out, dict):
        bad = next((k for k, v in out.items() if not isinstance(k, str) or not isinstance(v, np.ndarray)), None)
        return f"a dict whose {bad!r} is a {type(out[bad]).__name__}"
    return f"a {type(out).__name__}"


def check_picklable(fn: Any, method: str) -> None:
    """TypeError naming the transform when worker processes started by ``method`` cannot receive it."""
    import pickle

    try:
        pickle.dumps(fn)
    except Exception as e:
        raise TypeError(f"transform {_name(fn)} cannot be sent to worker processes started by {method!r} ({e}): "
                        "define it at module level (not a lambda or a local function), or use "
                        "multiprocessing_context='fork'") from None


def transformed(dataset: Any, transform: Callable | None, device: Any, num_workers: int, context: Any,
                timeout: float | None = TIMEOUT_S) -> Any:
    """The one dataset a loader holds and its streams run: ``dataset``, with ``transform`` applied to each batch when
    given (refused where it cannot run: in-process device mode; not picklable for spawn or forkserver workers). A
    loader's transform is its own: one that ``dataset`` carries (another loader's ``dataset``) is left behind."""
    if dataset.transform is not None:
        dataset = copy.copy(dataset)
        dataset.transform = None
    if transform is None:
        return dataset
    if device is not None and num_workers == 0:
        raise ValueError("transform runs on the numpy batches workers gather: with device=..., pass "
                         "num_workers >= 1 (in-process device mode cuts batches on the device)")
    if num_workers and context.get_start_method() != "fork":
        check_picklable(transform, context.get_start_method())
    return dataset.transformed(transform, timeout=timeout)
