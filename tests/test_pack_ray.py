"""Packing on a local Ray cluster (2 CPUs, one per test module): the same bytes as a local pack, a Ray
Dataset as a source, a killed task retried without a duplicate, a corrupt input named."""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
import streamwin as sw  # noqa: E402
from engine_cases import (check_byte_identical, check_corrupt_input_is_named, check_dataset_object,  # noqa: E402
                          check_killed_task_is_retried)


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_ray_packs_the_bytes_of_a_local_pack(tmp_path):
    check_byte_identical("ray", tmp_path)


def test_a_ray_dataset_gives_the_sequences_of_the_files_it_was_read_from(tmp_path):
    check_dataset_object(lambda src: ray.data.read_parquet(src).repartition(5), 5, tmp_path, seed=3)  # a unit per block
    ds = ray.data.read_parquet(str(tmp_path / "src"))
    with pytest.raises(sw.PackError, match="packed by its own engine, 'ray'"):
        sw.pack(ds, str(tmp_path / "x"), engine="dask", id_column="id", progress=False)


def test_a_ray_task_killed_midway_is_retried_without_a_duplicate(tmp_path):
    check_killed_task_is_retried("ray", tmp_path)


def test_a_corrupt_input_is_named_and_the_old_dataset_stays(tmp_path):
    check_corrupt_input_is_named("ray", tmp_path)
