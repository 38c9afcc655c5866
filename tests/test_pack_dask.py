"""Packing on a Dask LocalCluster (2 worker processes, one per test module): the same bytes as a local
pack, a Dask DataFrame as a source, a killed task retried without a duplicate, a corrupt input named."""
from __future__ import annotations

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")
dd = pytest.importorskip("dask.dataframe")
import streamwin as sw  # noqa: E402
from engine_cases import (check_byte_identical, check_corrupt_input_is_named, check_dataset_object,  # noqa: E402
                          check_killed_task_is_retried, sequences, write_inputs)


@pytest.fixture(scope="module", autouse=True)
def client():
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
    with distributed.Client(cluster) as c:  # pack finds this client: its tasks go to this cluster
        yield c
    cluster.close()


def test_dask_packs_the_bytes_of_a_local_pack(tmp_path):
    check_byte_identical("dask", tmp_path)


def test_a_dask_dataframe_gives_the_sequences_of_the_files_it_was_read_from(tmp_path):
    check_dataset_object(lambda src: dd.read_parquet(src).repartition(npartitions=3), 3, tmp_path, seed=4)
    # the long layout: each id's rows in one partition (set_index puts them there)
    path, options = write_inputs(tmp_path / "in")["parquet_long"]
    options = {k: v for k, v in options.items() if k != "shard_bytes"}
    sw.pack(str(path), str(tmp_path / "long-files"), progress=False, **options)
    long = dd.read_parquet(str(path)).set_index("id", sorted=False, npartitions=2)
    sw.pack(long, str(tmp_path / "long-dask"), progress=False, **options)
    want, got = sequences(str(tmp_path / "long-files")), sequences(str(tmp_path / "long-dask"))
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)


def test_a_dask_task_killed_midway_is_retried_without_a_duplicate(tmp_path):
    check_killed_task_is_retried("dask", tmp_path)


def test_a_corrupt_input_is_named_and_the_old_dataset_stays(tmp_path):
    check_corrupt_input_is_named("dask", tmp_path)
