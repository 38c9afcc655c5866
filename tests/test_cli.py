"""The streamwin command line: every subcommand runs and returns its exit code; the numbers it
prints match ones computed here; bad input is one clear line on stderr and exit code 2."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import streamwin as sw
from streamwin.cli import main, parse_size


REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def npy_src(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    root = tmp_path_factory.mktemp("src")
    rng = np.random.default_rng(0)
    arrays = {}
    for i in range(24):
        arr = rng.normal(size=(int(rng.integers(10, 600)), 3)).astype(np.float32)
        np.save(root / f"s{i:02d}.npy", arr)
        arrays[f"s{i:02d}"] = arr
    np.save(root / "zz.npy", np.zeros((0, 3), np.float32))
    return root, arrays


@pytest.fixture(scope="module")
def packed(npy_src, tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("ds") / "ds"
    assert main(["pack", str(npy_src[0]), str(dest), "--shard-size", "20KB", "--no-progress"]) == 0
    return dest


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_parse_size():
    assert parse_size("256MB") == 256_000_000
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("64M") == 64 << 20
    assert parse_size("1.5 kb") == 1500
    assert parse_size("4096") == 4096
    for bad in ("", "MB", "12XB", "-5", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def test_pack_prints_what_it_wrote(npy_src, tmp_path, capsys):
    src, arrays = npy_src
    code, out, err = run(capsys, "pack", str(src), str(tmp_path / "d"), "--shard-size", "20KB", "--workers", "2",
                         "--no-progress", "--verify")
    assert code == 0, err
    m = sw.load_manifest(str(tmp_path / "d"))
    nbytes = sum(p.stat().st_size for p in (tmp_path / "d").glob("*.tar"))
    steps = sum(len(a) for a in arrays.values())
    assert f"packed 24 sequences ({steps:,} steps, float32 [T, 3]) into {len(m.shards)} shards, {nbytes / 1e6:,.1f} MB" in out
    assert "skipped 1 empty" in out and "MB/s" in out
    assert re.search(rf"verified {len(m.shards)} shards, 24 sequences", out)
    assert all(s.bytes >= 20_000 for s in m.shards[:-1])


def test_pack_options(tmp_path, capsys):
    src = tmp_path / "jsonl"
    src.mkdir()
    (src / "a.jsonl").write_text("\n".join(json.dumps({"id": f"r{i}", "toks": list(range(i + 1)), "lang": "en"})
                                           for i in range(5)))
    code, out, err = run(capsys, "pack", str(src), str(tmp_path / "d"), "--option", "field=toks", "--cast", "int64",
                         "--compression", "zstd", "--no-progress")
    assert code == 0, err
    m = sw.load_manifest(str(tmp_path / "d"))
    assert m.dtype == np.int64 and m.compression == "zstd" and list(m.length) == [1, 2, 3, 4, 5]
    code, out, err = run(capsys, "pack", str(src), str(tmp_path / "e"), "--option", "nosuch=1", "--no-progress")
    assert code == 2 and "unknown option" in err and "Traceback" not in err
    code, out, err = run(capsys, "pack", str(src), str(tmp_path / "e"), "--option", "field=toks", "--empty", "error",
                         "--format", "npy", "--no-progress")
    assert code == 2 and err.startswith("streamwin pack: error:")


def test_parts_and_merge(npy_src, tmp_path, capsys):
    src, arrays = npy_src
    dest = tmp_path / "parts"
    for i in range(3):
        code, out, err = run(capsys, "pack", str(src), str(dest), "--part", f"{i}/3", "--no-progress")
        assert code == 0, err
        assert f"part {i}/3: packed" in out and "streamwin merge" in out
    code, out, err = run(capsys, "merge", str(dest))
    assert code == 0, err
    m = sw.load_manifest(str(dest))
    assert sorted(m.key(i) for i in range(m.num_sequences)) == sorted(arrays)
    assert f"merged {len(m.shards)} shards, 24 sequences" in out
    os.unlink(dest / "index.part00001-of-00003.json")
    code, out, err = run(capsys, "merge", str(dest))
    assert code == 2 and "index.part00001-of-00003.json" in err
    code, out, err = run(capsys, "pack", str(src), str(dest), "--part", "3/3", "--no-progress")
    assert code == 2 and "0 <= i < n" in err


def test_verify_and_index(packed, tmp_path, capsys):
    code, out, err = run(capsys, "verify", str(packed), "--no-progress")
    assert code == 0 and out.startswith("verified ") and "24 sequences" in out
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in packed.glob("*.tar"):
        (copy / p.name).write_bytes(p.read_bytes())
    code, out, err = run(capsys, "index", str(copy), "--no-progress")
    assert code == 0 and "indexed" in out and "24 sequences" in out
    assert (copy / "index.json").read_bytes() == (packed / "index.json").read_bytes().replace(
        b'"dropped_empty":1', b'"dropped_empty":0')
    shard = sorted(copy.glob("*.tar"))[1]
    data = bytearray(shard.read_bytes())
    data[700] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, out, err = run(capsys, "verify", str(copy), "--no-progress")
    assert code == 2 and "FAILED" in err and shard.name in err
    code, out, err = run(capsys, "index", str(tmp_path / "empty-dir"), "--no-progress")
    assert code == 2 and "no shards matching" in err


def expected_plan_numbers(lengths, window, stride, horizon, batch, world, workers):
    """Windows per epoch, batches per rank and dropped windows, from the formulas of design.md."""
    span = window + horizon
    total = int(sum((length - span) // stride + 1 for length in lengths if length >= span))
    streams = world * max(1, workers)
    per_stream = batch * ((total // streams) // batch)
    return total, per_stream // batch * max(1, workers), total - streams * per_stream


def test_inspect(packed, npy_src, tmp_path, capsys):
    _, arrays = npy_src
    lengths = [len(a) for a in arrays.values()]
    code, out, err = run(capsys, "inspect", str(packed), "--window", "32", "--stride", "16", "--horizon", "4",
                         "--batch-size", "8", "--world-size", "3", "--num-workers", "2", "--png", str(tmp_path / "h.png"))
    assert code == 0, err
    total, per_rank, dropped = expected_plan_numbers(lengths, 32, 16, 4, 8, 3, 2)
    assert re.search(rf"sequences\s+24\b", out) and re.search(rf"steps\s+{sum(lengths):,}", out)
    assert re.search(rf"per epoch\s+{total:,}\n", out)
    assert re.search(rf"batches per rank\s+{per_rank:,} ", out)
    assert re.search(rf"dropped windows\s+{dropped:,} ", out)
    assert "float32 [T, 3]" in out
    # the histogram's counts add up to the sequences
    rows = re.findall(r"^\s+\[[\d,]+, [\d,]+\)\s+([\d,]+)", out, flags=re.M)
    assert sum(int(c.replace(",", "")) for c in rows) == 24
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench(packed, capsys):
    code, out, err = run(capsys, "bench", str(packed), "--window", "16", "--batch-size", "4", "--batches", "5",
                         "--no-progress")
    assert code == 0, err
    assert "5 batches, 20 windows" in out and "windows/s" in out and "MB/s" in out
    code, out, err = run(capsys, "bench", str(packed), "--window", "100000", "--no-progress")
    assert code == 2 and "no batches" in err


def test_bad_urls_and_usage(tmp_path, capsys):
    code, out, err = run(capsys, "inspect", str(tmp_path / "nothing-here"))
    assert code == 2 and "no index.json" in err and "Traceback" not in err
    code, out, err = run(capsys, "verify", "nosuchproto://bucket/x", "--no-progress")
    assert code == 2 and "nosuchproto" in err
    code, out, err = run(capsys, "pack", str(tmp_path / "missing-src"), str(tmp_path / "d"), "--no-progress")
    assert code == 2 and "missing-src" in err
    assert run(capsys, "pack")[0] == 2  # argparse usage errors
    assert run(capsys, "pack", "a", "b", "--shard-size", "lots")[0] == 2
    assert run(capsys, "frobnicate")[0] == 2
    code, out, err = run(capsys, "--help")
    assert code == 0 and "pack" in out and "inspect" in out
    code, out, err = run(capsys, "pack", "--help")  # what tools/pack_shards.py --help shows
    assert code == 0 and "--shard-size" in out and "--part" in out


def test_module_and_tool_entry_points(npy_src, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "streamwin.cli", "inspect", str(tmp_path / "none")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "no index.json" in r.stderr
    dest = tmp_path / "via-tool"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "pack_shards.py"), str(npy_src[0]), str(dest),
                        "--shard-size", "1MiB", "--no-progress"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "packed 24 sequences" in r.stdout
    m = sw.load_manifest(str(dest))
    assert m.num_sequences == 24 and len(m.shards) == 1


def test_s3_with_storage_options(npy_src, s3_server, s3_bucket, capsys):
    url = f"{s3_bucket}/cli"
    opts = ["--storage-option", "key=testing", "--storage-option", "secret=testing",
            "--storage-option", f"client_kwargs.endpoint_url={s3_server.endpoint_url}",
            "--storage-option", "client_kwargs.region_name=us-east-1"]
    code, out, err = run(capsys, "pack", str(npy_src[0]), url, "--shard-size", "30KB", "--no-progress", "--verify", *opts)
    assert code == 0, err
    assert "packed 24 sequences" in out and "verified" in out
    code, out, err = run(capsys, "inspect", url, *opts)
    assert code == 0 and re.search(r"sequences\s+24\b", out)
    code, out, err = run(capsys, "inspect", f"{s3_bucket}/nothing", *opts)
    assert code == 2 and "no index.json" in err
