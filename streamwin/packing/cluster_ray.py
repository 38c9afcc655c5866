"""Packing on a Ray cluster: each unit a Ray task; a Ray Dataset's blocks as units.

`run_ray` submits `unit.pack_unit` once per unit as a Ray task (to the cluster at ``address``,
else the one this process is connected to, else a local one started with ``ray.init()``),
at most IN_FLIGHT_PER_CPU tasks per CPU of the cluster at a time, and yields the fragments in
unit order as they complete. Ray retries a task whose worker died (``max_retries``); a retry
writes the same shards under the same names, so nothing is duplicated. A task's exception is
raised here as the original error (a PackError naming the input file).

`ray_units` lists a Ray Dataset's blocks in order (its context's ``preserve_order`` is set
while it runs, so the numbering is the same every run) and passes each block to its task as an ObjectRef:
the block goes from the object store to the worker, never through the driver.
"""
from __future__ import annotations

import collections
from typing import Any, Iterator

import ray

from streamwin.packing.fragments import Fragment
from streamwin.packing.inputs import InputUnit
from streamwin.packing.parallel import Job
from streamwin.packing.unit import Progress, pack_unit

IN_FLIGHT_PER_CPU = 2
MAX_RETRIES = 3  # a task whose worker process died is run again (same shards, same names)


def connect(address: str | None) -> None:
    """Connect to the cluster at ``address``, or the running one, or start a local one."""
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)


@ray.remote(max_retries=MAX_RETRIES)
def _pack_task(job, data=None) -> Fragment:
    return pack_unit(job, data)


def run_ray(jobs: Iterator[Job], address: str | None, progress: Progress) -> Iterator[Fragment]:
    """The fragments of every job, in unit order, each packed by a Ray task."""
    connect(address)
    limit = max(2, IN_FLIGHT_PER_CPU * int(ray.cluster_resources().get("CPU", 1)))
    pending: collections.deque = collections.deque()
    try:
        for job, data in jobs:
            pending.append(_pack_task.remote(job, data))
            if len(pending) >= limit:
                yield _result(pending.popleft(), progress)
        while pending:
            yield _result(pending.popleft(), progress)
    finally:  # stop the tasks in flight (their workers are killed) before the pack removes what they wrote
        for ref in pending:
            ray.cancel(ref, force=True)
        if pending:
            ray.wait(list(pending), num_returns=len(pending), timeout=60)


def _result(ref: Any, progress: Progress) -> Fragment:
    try:
        fragment = ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        raise cause from None
    progress(fragment.nbytes, fragment.sequences)
    return fragment


def ray_units(ds: Any, opts: tuple) -> Iterator[tuple[int, tuple[InputUnit, ...], Any]]:
    """(number, input unit, block ObjectRef) per block of a Ray Dataset, in dataset order."""
    connect(None)
    options = ds.context.execution_options  # the dataset runs with the context it was made with
    saved = options.preserve_order
    options.preserve_order = True  # blocks in dataset order, so units are numbered alike every run
    try:
        number = 0
        for bundle in ds.iter_internal_ref_bundles():
            for ref in bundle.block_refs:
                name = f"block{number:06d}"
                yield number, (InputUnit("table", f"Ray Dataset {name}", name, opts),), ref
                number += 1
    finally:
        options.preserve_order = saved
