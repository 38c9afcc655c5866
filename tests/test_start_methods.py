"""Start methods: with forkserver, workers fork from a server that has already imported torch
and streamwin, instead of importing them each (as spawn does), so the first batch comes soon.

Run in a fresh interpreter: the fork server is one per process, and its preload list is read
when it starts, so a server started by an earlier test would hide the behaviour."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import streamwin as sw

PROBE = """
import sys
import numpy as np
import streamwin as sw
sw.pack([(f"s{i}", np.arange(50, dtype=np.float32)) for i in range(20)], sys.argv[1], progress=False)
ds = sw.WindowDataset(sys.argv[1], window=8, stride=4, batch_size=4)
loader = sw.WindowLoader(ds, num_workers=2, multiprocessing_context=sys.argv[2])
next(iter(loader))
for p in loader._pool.procs:
    parent = int(open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[1])
    maps = open(f"/proc/{parent}/maps").read()
    print(parent, "libtorch" in maps, parent == __import__("os").getpid())
got = [b["x"].numpy().tobytes() for b in loader]
want = [b["x"].numpy().tobytes() for b in sw.WindowLoader(ds, num_workers=2, multiprocessing_context="fork")]
print("same" if got == want and len(got) > 10 else f"differ {len(got)} {len(want)}")
loader.close()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_forkserver_workers_fork_from_a_server_that_imported_torch(tmp_path, method):
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "ds"), method], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(Path(sw.__file__).parent.parent)})
    assert out.returncode == 0, out.stderr[-3000:]
    *rows, same = [line.split() for line in out.stdout.split("\n") if line.strip()]
    assert len(rows) == 2 and same == ["same"]  # the batches of fork, in order
    if method == "forkserver":  # both forked by one server, not by the trainer, with torch loaded
        assert len({r[0] for r in rows}) == 1 and all(r[1:] == ["True", "False"] for r in rows)
    else:  # spawn is untouched: the trainer starts each worker, a fresh interpreter
        assert all(r[2] == "True" for r in rows)
