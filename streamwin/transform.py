"""A user's transform of every batch, run where the batch is gathered: in the worker, before the hand-off.

``WindowLoader(ds, transform=fn)`` calls ``fn(batch, rng)`` on each batch: a dict of numpy
arrays (every field of the batch but ``seq``; ``key`` is made later, from ``seq``), and
``rng``, a numpy Generator seeded from (seed, epoch, stream, batch of the stream), so a random
transform gives the same batch again after a resume. It returns a dict of numpy arrays: what
the batch then holds (``key`` is added; ``source`` and, for packed rows, ``crops`` are carried
over from the input). Its outputs' keys, shapes and dtypes are learned once, from ``fn`` on a
batch of zeros of the dataset's layout, and the batch slots are sized for them; a later batch
whose output differs is an error naming the key. The transform's work is then the worker's,
and the trainer's hand-off stays one slot number.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from streamwin.batch import BatchLayout

CARRIED = ("source", "crops")  # carried from the input batch to the output (keys decode by source; crops cut)
HIDDEN = ("seq",)  # not shown to the transform: becomes ``key``


class Transform:
    """``fn`` with the batch layouts before and after it (the latter learned from ``fn`` on zeros)."""

    def __init__(self, fn: Callable[[dict, np.random.Generator], dict], layout: BatchLayout):
        if not callable(fn):
            raise TypeError(f"transform must be a function fn(batch, rng) -> batch, got {type(fn).__name__}")
        self.fn, self.input = fn, layout
        views = layout.views(np.zeros(layout.nbytes, dtype=np.uint8))
        out = self.call({k: v for k, v in views.items() if k not in HIDDEN}, np.random.default_rng(0), None)
        wanted = [(k, v.dtype, v.shape) for k, v in out.items() if k not in CARRIED]
        wanted += [(f.name, f.dtype, f.shape) for f in layout.fields if f.name in HIDDEN + CARRIED]
        self.output = BatchLayout.of(wanted, tuple(k for k in layout.per_crop if k in out or k in CARRIED))
        self.shapes = {k: (v.dtype, v.shape) for k, v in out.items() if k not in CARRIED}

    def call(self, batch: dict, rng: np.random.Generator, shapes: dict | None) -> dict:
        """``fn(batch, rng)``, its output checked: a dict of numpy arrays (of the learned shapes, once known)."""
        out = self.fn(batch, rng)
        if not isinstance(out, dict) or not all(isinstance(k, str) and isinstance(v, np.ndarray) for k, v in out.items()):
            raise TypeError(f"transform {_name(self.fn)} must return a dict of numpy arrays, got "
                            f"{_describe(out)}")
        if "key" in out or "seq" in out:
            raise ValueError(f"transform {_name(self.fn)} returned 'key' or 'seq': the loader makes the keys itself")
        if shapes is not None:
            got = {k for k in out if k not in CARRIED}
            if got != set(shapes):
                raise ValueError(f"transform {_name(self.fn)} returned keys {sorted(got)}, its first batch "
                                 f"{sorted(shapes)}: the outputs are fixed after the first batch")
            for k, (dtype, shape) in shapes.items():
                if out[k].dtype != dtype or out[k].shape != shape:
                    raise ValueError(f"transform {_name(self.fn)} returned {k!r} as {out[k].dtype} {out[k].shape}, "
                                     f"its first batch as {dtype} {shape}: shapes and dtypes are fixed after the "
                                     "first batch (the batch slots are sized once)")
        return out

    def gatherer(self, gatherer: Any, seed: int, epoch: int, stream: int, first_batch: int) -> "TransformGather":
        """``gatherer`` followed by this transform, for stream ``stream`` of ``epoch`` from batch ``first_batch``."""
        return TransformGather(gatherer, self, (seed, epoch, stream), first_batch)


class TransformGather:
    """Gathers a batch into a buffer of its own, transforms it, and writes the output into the batch's slot."""

    def __init__(self, gatherer: Any, transform: Transform, key: tuple[int, int, int], first_batch: int):
        self.gatherer, self.transform, self.key, self.batch = gatherer, transform, key, first_batch
        self.views = transform.input.views(np.empty(transform.input.nbytes, dtype=np.uint8))

    def gather(self, parts: list, out: dict[str, np.ndarray], counts: np.ndarray) -> dict[str, np.ndarray]:
        batch = self.gatherer.gather(parts, self.views, counts)
        rng = np.random.default_rng([*self.key, self.batch])
        self.batch += 1
        t = self.transform
        got = t.call({k: v for k, v in batch.items() if k not in HIDDEN}, rng, t.shapes)
        for k, v in got.items():
            if k not in CARRIED:
                np.copyto(out[k], v)
        for k in HIDDEN + CARRIED:
            if k in out:
                np.copyto(out[k], batch[k])
        return out


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


def transformed(dataset: Any, transform: Callable | None, device: Any, num_workers: int, context: Any) -> Any:
    """The dataset a loader's streams run: ``dataset`` itself, or with ``transform`` applied to each batch
    (refused where it cannot run: in-process device mode; not picklable for spawn or forkserver workers)."""
    if transform is None:
        return dataset
    if device is not None and num_workers == 0:
        raise ValueError("transform runs on the numpy batches workers gather: with device=..., pass "
                         "num_workers >= 1 (in-process device mode cuts batches on the device)")
    if num_workers and context.get_start_method() != "fork":
        check_picklable(transform, context.get_start_method())
    return dataset.transformed(transform)
