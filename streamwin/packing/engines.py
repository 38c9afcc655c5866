"""Where the units run: this machine (`parallel`), a Ray cluster or a Dask cluster.

Every engine runs the same function, `unit.pack_unit`, on the same jobs, and hands back the
units' fragments in unit order, so the dataset is byte-identical whichever engine packed
it. Ray and Dask are optional (``pip install 'streamwin[ray]'`` / ``'streamwin[dask]'``) and
imported only when asked for: ``import streamwin`` imports neither.
"""
from __future__ import annotations

from typing import Iterator

from streamwin.errors import PackError
from streamwin.packing.fragments import Fragment
from streamwin.packing.parallel import Job, run_local
from streamwin.packing.unit import Progress


def run_units(engine: str | None, jobs: Iterator[Job], workers: int, address: str | None,
              progress: Progress) -> Iterator[Fragment]:
    """The fragments of every job, in unit order, packed by ``engine`` (None: this machine, ``workers`` processes)."""
    if engine is None:
        if address is not None:
            raise PackError(f"address={address!r} names a cluster: pass engine='ray' or engine='dask' with it")
        return run_local(jobs, workers, progress)
    if engine == "ray":
        from streamwin.packing.cluster_ray import run_ray
        return run_ray(jobs, address, progress)
    if engine == "dask":
        from streamwin.packing.cluster_dask import run_dask
        return run_dask(jobs, address, workers, progress)
    raise PackError(f"engine must be None, 'ray' or 'dask', got {engine!r}")
