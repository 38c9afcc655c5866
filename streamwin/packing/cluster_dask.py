"""Packing on a Dask cluster: each unit a Dask task; a Dask DataFrame's partitions as units.

`run_dask` submits `unit.pack_unit` once per unit (to the scheduler at ``address``, else the
client this process already has, else a ``distributed.LocalCluster`` of ``workers`` processes
started for this pack and closed after it), at most IN_FLIGHT_PER_THREAD tasks per worker
thread at a time, and yields the fragments in unit order. The scheduler runs again a task
whose worker died (up to its ``allowed-failures``); the rerun writes the same shards under
the same names. A task's exception is raised here as the original error.

`dask_units` lists a DataFrame's partitions in order, each a Delayed that the task computes
on its worker: a partition never comes to the driver. In the long layout a sequence must lie
within one partition (``ddf.set_index(id_column)`` puts each id in one).
"""
from __future__ import annotations

import collections
from typing import Any, Iterator

import dask
import distributed
from distributed import Client, LocalCluster, get_client

from streamwin.packing.fragments import Fragment
from streamwin.packing.inputs import InputUnit
from streamwin.packing.parallel import Job
from streamwin.packing.unit import Progress, pack_unit

IN_FLIGHT_PER_THREAD = 2


def _client(address: str | None, workers: int) -> tuple[Client, LocalCluster | None]:
    """The client to pack with, and the LocalCluster made for it (to close after), if one was."""
    if address is not None:
        return Client(address), None
    try:
        return get_client(), None
    except ValueError:  # no client in this process: a local cluster of its own
        cluster = LocalCluster(n_workers=max(2, workers), threads_per_worker=1, processes=True,
                               dashboard_address=None)
        return Client(cluster), cluster


def run_dask(jobs: Iterator[Job], address: str | None, workers: int, progress: Progress) -> Iterator[Fragment]:
    """The fragments of every job, in unit order, each packed by a Dask task."""
    client, cluster = _client(address, workers)
    threads = sum(client.nthreads().values()) or 1
    pending: collections.deque = collections.deque()
    try:
        for job, data in jobs:
            if dask.is_dask_collection(data):
                pending.append(client.compute(dask.delayed(pack_unit)(job, data)))
            else:
                pending.append(client.submit(pack_unit, job, data, pure=False))
            if len(pending) >= IN_FLIGHT_PER_THREAD * threads:
                yield _result(pending.popleft(), progress)
        while pending:
            yield _result(pending.popleft(), progress)
    finally:  # a running task cannot be stopped: let those in flight end before the pack removes what they wrote
        distributed.wait(list(pending))
        if cluster is not None:
            client.close()
            cluster.close()


def _result(future: Any, progress: Progress) -> Fragment:
    fragment = future.result()
    progress(fragment.nbytes, fragment.sequences)
    return fragment


def dask_units(ddf: Any, opts: tuple) -> Iterator[tuple[int, tuple[InputUnit, ...], Any]]:
    """(number, input unit, partition Delayed) per partition of a Dask DataFrame, in order."""
    for number, part in enumerate(ddf.to_delayed()):
        name = f"partition{number:06d}"
        yield number, (InputUnit("table", f"Dask DataFrame {name}", name, opts),), part
