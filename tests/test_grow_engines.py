"""Appends wherever units run (issue 44, item 1): worker processes, parts + merge, a Dask cluster, the command line.

Each grows a dataset the same way as a pack in one process; the reference is the corpus of
tests/grow_cases.py, read back window by window, and the bytes a one-process append writes.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import grow_cases as gc
import streamwin as sw
from streamwin.cli.main import main

REPO = Path(__file__).resolve().parent.parent
W, S = 16, 8


def files_of(url: str) -> dict[str, bytes]:
    return {n: open(os.path.join(url, n), "rb").read() for n in sorted(os.listdir(url)) if not n.startswith(".")}


def write_npy(folder: Path, items) -> str:
    folder.mkdir(parents=True)
    for key, arr, _ in items:
        np.save(folder / f"{key}.npy", arr)
    return str(folder)


def read(url: str, full: dict) -> list:
    loader = sw.WindowLoader(sw.WindowDataset(url, window=W, stride=S, batch_size=8,
                                              order=sw.Order(equalize="pad", shuffle=False)))
    return sorted(gc.windows(loader, full, W))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The three packs of grow_cases as folders of .npy files (no meta): first, then two extensions."""
    root = tmp_path_factory.mktemp("inputs")
    full = gc.corpus(seed=21)
    return full, [write_npy(root / f"stage{k}", items) for k, items in enumerate(gc.stages(full))]


def grow_with(url: str, folders: list[str], **options) -> str:
    sw.pack(folders[0], url, shard_bytes=6000, progress=False)
    for folder in folders[1:]:
        sw.pack(folder, url, shard_bytes=6000, progress=False, mode="extend", **options)
    return url


def test_worker_processes_append_the_bytes_of_one_process(inputs, tmp_path):
    full, folders = inputs
    one = grow_with(str(tmp_path / "one"), folders)
    two = grow_with(str(tmp_path / "two"), folders, workers=2)
    assert files_of(one) == files_of(two)
    assert read(two, full) == read(str(gc.once(str(tmp_path / "once"), full)), full)


def test_parts_of_an_append_merge_into_the_dataset_one_append_writes(inputs, tmp_path):
    full, folders = inputs
    one = grow_with(str(tmp_path / "one"), folders)
    url = str(tmp_path / "parts")
    sw.pack(folders[0], url, shard_bytes=6000, progress=False)
    for folder in folders[1:]:
        for i in range(2):
            sw.pack(folder, url, shard_bytes=6000, progress=False, mode="extend", part=f"{i}/2")
        m = sw.merge(url)
    assert not [n for n in os.listdir(url) if n.startswith("index.part")]
    assert m.segments is not None and read(url, full) == read(one, full)
    assert sw.load_manifest(url).length.tolist() == sw.load_manifest(one).length.tolist()


def test_parts_of_an_append_to_another_version_of_the_dataset_are_refused(inputs, tmp_path):
    import json
    full, folders = inputs
    url = str(tmp_path / "ds")
    grow_with(url, folders[:2])
    for i in range(2):
        sw.pack(folders[2], url, shard_bytes=6000, progress=False, mode="extend", part=f"{i}/2")
    with pytest.raises(sw.PackError, match="finished part"):  # nothing else commits while parts wait for merge
        sw.compact(url, progress=False)
    side = f"{url}/index.part00001-of-00002.grow.json"
    grows = json.load(open(side))
    json.dump(dict(grows, base="0123456789abcdef"), open(side, "w"))  # packed against another version
    index = open(f"{url}/index.json", "rb").read()
    with pytest.raises(sw.ManifestError, match="packed by different packs"):
        sw.merge(url)
    json.dump(dict(grows, base="0123456789abcdef"), open(f"{url}/index.part00000-of-00002.grow.json", "w"))
    with pytest.raises(sw.ManifestError, match="its parts append to the dataset as it was"):
        sw.merge(url)
    assert open(f"{url}/index.json", "rb").read() == index


def test_a_dask_cluster_appends_the_bytes_of_one_process(inputs, tmp_path):
    distributed = pytest.importorskip("distributed")
    full, folders = inputs
    one = grow_with(str(tmp_path / "one"), folders)
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
    try:
        with distributed.Client(cluster):
            dask = grow_with(str(tmp_path / "dask"), folders, engine="dask")
    finally:
        cluster.close()
    assert files_of(one) == files_of(dask)


def test_the_command_line_appends_extends_and_compacts(inputs, tmp_path, capsys):
    full, folders = inputs
    url = str(tmp_path / "cli")
    assert main(["pack", folders[0], url, "--shard-size", "6000", "--no-progress"]) == 0
    assert main(["pack", folders[1], url, "--append", "--no-progress"]) == 2  # keys there already: refused
    assert "mode='extend' (--extend)" in capsys.readouterr().err
    for folder in folders[1:]:
        assert main(["pack", folder, url, "--extend", "--shard-size", "6000", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "appended" in out and "extended" in out
    assert main(["inspect", url]) == 0
    assert "continuation members" in capsys.readouterr().out
    before = read(url, full)
    assert main(["compact", url, "--no-progress"]) == 0
    assert "compacted" in capsys.readouterr().out
    assert read(url, full) == before and main(["verify", url, "--no-progress"]) == 0
    r = subprocess.run([sys.executable, "-m", "streamwin.cli", "pack", "--help"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert "--append" in r.stdout and "--extend" in r.stdout
