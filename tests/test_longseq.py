"""Long sequences: each shard byte is read about once per epoch, memory does not grow with a sequence.

Layouts mix one long sequence with many short ones. Bytes read are counted twice, by the
loader's stats() and by the loopback HTTP server (bytes it served), and compared with the
shard bytes on disk; windows are checked against naive slices of the original arrays.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import streamwin as sw

W, S, H, B = 16, 1, 2, 32
F = 4  # features: 16 bytes per step


def layout(name: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Sequences of a named layout; values encode (sequence, step) so a misplaced window never matches."""
    rng = np.random.default_rng(seed)
    lengths = {"giant": [150_000], "small": list(rng.integers(5, 400, size=600)),
               "mixed": [120_000] + list(rng.integers(5, 400, size=300))}[name]
    out = {}
    for i, t in enumerate(lengths):
        steps = np.arange(int(t), dtype=np.float32)[:, None] * 1000 + i
        out[f"s{i:04d}"] = np.repeat(steps, F, axis=1)
    return out


def shard_bytes(url: str) -> int:
    return sum(os.path.getsize(os.path.join(url, f)) for f in os.listdir(url) if f.endswith(".tar"))


def check_windows(loader, seqs) -> int:
    """Every yielded window equals the naive slice of its sequence; returns the windows seen."""
    n = 0
    for b in loader:
        x, y = b["x"].numpy(), b["y"].numpy()
        for i, (k, s) in enumerate(zip(b["key"], b["start"].tolist())):
            assert np.array_equal(x[i], seqs[k][s : s + W]), (k, s)
            assert np.array_equal(y[i], seqs[k][s + W : s + W + H]), (k, s)
            n += 1
    return n


def make(url, **kw):
    args = dict(window=W, stride=S, horizon=H, batch_size=B, shuffle_buffer=2048, seed=5) | kw
    return sw.WindowLoader(sw.WindowDataset(url, **args))


@pytest.mark.parametrize("name", ["giant", "small", "mixed"])
def test_epoch_reads_each_byte_about_once_over_http(name, http_server, tmp_path):
    seqs = layout(name)
    url = str(tmp_path / "ds")
    sw.pack(list(seqs.items()), url, shard_bytes=1 << 20, progress=False)
    srv = http_server(tmp_path)
    loader = make(srv.url_for("ds"))
    assert check_windows(loader, seqs) > 0
    total = shard_bytes(url)
    assert srv.stats.bytes_served / total <= 1.25, (srv.stats.bytes_served, total)
    assert loader.stats()["bytes_read"] / total <= 1.25


@pytest.mark.parametrize("name", ["giant", "mixed"])
def test_epoch_reads_each_byte_about_once_locally(name, tmp_path):
    seqs = layout(name)
    url = str(tmp_path / "ds")
    sw.pack(list(seqs.items()), url, shard_bytes=1 << 20, progress=False)
    loader = make(url)
    assert check_windows(loader, seqs) > 0
    assert loader.stats()["bytes_read"] / shard_bytes(url) <= 1.25
