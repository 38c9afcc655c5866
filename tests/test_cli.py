"""The streamwin command line: every subcommand runs and returns its exit code; the numbers it
prints match ones computed here; bad input is one clear line on stderr and exit code 2."""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import numpy as np
import pytest

import streamwin as sw
from streamwin.cli.args import parse_size
from streamwin.cli.main import main
from streamwin.formats.manifest import content_checksum


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
    units = {}  # each unit's shards: all but its last hold at least --shard-size
    for shard in m.shards:
        units.setdefault(shard.name.split("-")[2], []).append(shard.bytes)
    assert len(units) > 1 and all(b >= 20_000 for sizes in units.values() for b in sizes[:-1])


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
        code, out, err = run(capsys, "pack", str(src), str(dest), "--part", f"{i}/3", "--shard-size", "20KB",
                             "--no-progress")
        assert code == 0, err
        assert f"part {i}/3: packed" in out and "streamwin merge" in out
    code, out, err = run(capsys, "merge", str(dest))
    assert code == 0, err
    m = sw.load_manifest(str(dest))
    assert sorted(m.key(i) for i in range(m.num_sequences)) == sorted(arrays)
    assert f"merged {len(m.shards)} shards, 24 sequences" in out
    for i in (0, 2):
        assert run(capsys, "pack", str(src), str(tmp_path / "two"), "--part", f"{i}/3", "--shard-size", "20KB",
                   "--no-progress")[0] == 0
    code, out, err = run(capsys, "merge", str(tmp_path / "two"))
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
    indexed, packed_doc = (json.loads((d / "index.json").read_text()) for d in (copy, packed))
    assert indexed == {**packed_doc, "dropped_empty": 0, "content_sha256": content_checksum({**packed_doc,
                                                                                          "dropped_empty": 0})}
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


@pytest.mark.parametrize("world, workers, canonical", [(1, 0, None), (2, 0, None), (4, 2, None), (3, 1, None),
                                                      (2, 3, ("8,3", (8, 3))), (2, 0, ("none", None))])
def test_inspect_plans_what_the_dataset_plans(packed, capsys, world, workers, canonical):
    """inspect's numbers are WindowDataset.summary()'s for the same options: its canonical streams included."""
    opts = ["--window", "16", "--stride", "8", "--batch-size", "4", "--world-size", str(world), "--num-workers",
            str(workers)] + (["--canonical", canonical[0]] if canonical else [])
    code, out, err = run(capsys, "inspect", str(packed), *opts)
    assert code == 0, err
    order = None if canonical is None else sw.Order(canonical=canonical[1])
    ds = sw.WindowDataset(str(packed), window=16, stride=8, batch_size=4, world_size=world, rank=0, order=order)
    want = ds.summary(num_workers=workers)
    streams = re.search(r"streams\s+(\d+)( canonical \((\d+) rank slot\(s\) x (\d+) step phase)?", out)
    assert int(streams.group(1)) == want["streams"], out  # before: 2 (2 ranks x 1 stream) where summary said 8
    assert (None if streams.group(2) is None else (int(streams.group(3)), int(streams.group(4)))) == want["canonical"]
    assert re.search(rf"per epoch\s+{want['windows_per_epoch']:,}\n", out)
    assert re.search(rf"batches per rank\s+{want['batches_per_rank']:,} ", out)
    assert re.search(rf"dropped windows\s+{want['dropped_windows']:,} ", out)


def _cli(*argv: str, stderr=subprocess.PIPE) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(sw.__file__).parent.parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "streamwin.cli", *argv], stdout=subprocess.DEVNULL,
                            stderr=stderr, env=env)


def test_progress_is_plain_lines_in_a_log_and_a_bar_on_a_terminal(npy_src, tmp_path):
    src, _ = npy_src
    for verb in (["pack", str(src), str(tmp_path / "a"), "--shard-size", "20KB"], ["verify", str(tmp_path / "a")]):
        p = _cli(*verb)  # stderr a pipe, as a SLURM or CI log
        err = p.communicate(timeout=120)[1].decode()
        assert p.returncode == 0, err
        assert "\r" not in err, err[:300]  # before: every redraw of tqdm's bar, carriage returns and all
        bars = [line for line in err.splitlines() if line.startswith((f"pack {tmp_path / 'a'}", "verify"))]
        assert 1 <= len(bars) <= 4, err  # at its start, at its end (and every 30 s between)
    main_fd, tty_fd = pty.openpty()  # stderr a terminal (100 columns): tqdm's bar, redrawn in place
    fcntl.ioctl(tty_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    p = _cli("pack", str(src), str(tmp_path / "b"), "--shard-size", "20KB", stderr=tty_fd)
    os.close(tty_fd)
    seen = b""
    while True:
        try:
            chunk = os.read(main_fd, 4096)
        except OSError:  # the terminal closed: the command ended
            break
        if not chunk:
            break
        seen += chunk
    os.close(main_fd)
    assert p.wait(timeout=120) == 0
    assert b"\r" in seen and b"pack " in seen


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


# ---- option errors name the option; library messages in the command line's words ---------------

BAD_OPTIONS = [
    (["inspect", "{ds}", "--window", "0"], "--window"),
    (["inspect", "{ds}", "--window", "2.5"], "--window"),
    (["inspect", "{ds}", "--window", "8", "--stride", "0"], "--stride"),
    (["inspect", "{ds}", "--window", "8", "--horizon", "-1"], "--horizon"),
    (["inspect", "{ds}", "--window", "8", "--batch-size", "0"], "--batch-size"),
    (["inspect", "{ds}", "--window", "8", "--num-workers", "-1"], "--num-workers"),
    (["inspect", "{ds}", "--window", "8", "--seed", "-1"], "--seed"),
    (["inspect", "{ds}", "--window", "8", "--world-size", "0"], "--world-size"),
    (["bench", "{ds}", "--window", "8", "--shuffle-buffer", "0"], "--shuffle-buffer"),
    (["bench", "{ds}", "--window", "8", "--batches", "-1"], "--batches"),
    (["bench", "{ds}", "--window", "8", "--batch-size", "2.5"], "--batch-size"),
    (["pack", "{src}", "{out}", "--workers", "0"], "--workers"),
    (["pack", "{src}", "{out}", "--cast", "nosuch"], "--cast"),
    (["pack", "{src}", "{out}", "--cast", "str"], "--cast"),
    (["pack", "{src}", "{out}", "--part", "3/3"], "--part"),
    (["pack", "{src}", "{out}", "--part", "half"], "--part"),
]


@pytest.mark.parametrize(("argv", "option"), BAD_OPTIONS, ids=[" ".join(x for x in a if "{" not in x) for a, _ in BAD_OPTIONS])
def test_a_bad_option_value_is_named_as_typed(argv, option, packed, npy_src, tmp_path, capsys):
    argv = [a.format(ds=packed, src=npy_src[0], out=tmp_path / "out") for a in argv]
    code, out, err = run(capsys, *argv, "--no-progress") if argv[0] != "inspect" else run(capsys, *argv)
    assert code == 2 and "Traceback" not in err
    assert option in err, err
    python_name = option.lstrip("-").replace("-", "_")
    if python_name != option.lstrip("-"):
        assert python_name not in err, f"the error uses the Python name {python_name}: {err}"
    assert not (tmp_path / "out" / "index.json").exists()


def test_library_errors_use_the_command_lines_option_names(npy_src, tmp_path, capsys):
    code, out, err = run(capsys, "pack", str(npy_src[0]), str(tmp_path / "a"), "--empty", "error", "--no-progress")
    assert code == 2 and "--empty skip" in err and "empty=" not in err, err
    csv_dir = tmp_path / "csv"
    csv_dir.mkdir()
    (csv_dir / "t.csv").write_text("sensor,t,v\na,0,1.5\n")
    code, out, err = run(capsys, "pack", str(csv_dir), str(tmp_path / "b"), "--no-progress")
    assert code == 2 and "--option id_column=" in err and "pass id_column=" not in err, err
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    np.save(mixed / "a.npy", np.zeros(4, np.float32))
    np.save(mixed / "b.npy", np.zeros(4, np.int16))
    code, out, err = run(capsys, "pack", str(mixed), str(tmp_path / "c"), "--no-progress")
    assert code == 2 and "--cast" in err and "cast=" not in err, err


# ---- start-up, pipes, unmerged parts -----------------------------------------------------------

@pytest.mark.parametrize("verb", ["--help", "pack", "inspect", "verify", "merge"])
def test_only_bench_imports_torch(verb, npy_src, packed, tmp_path):
    argv = {"--help": ["--help"], "pack": ["pack", str(npy_src[0]), str(tmp_path / "d"), "--no-progress"],
            "inspect": ["inspect", str(packed), "--window", "16", "--world-size", "2"],
            "verify": ["verify", str(packed), "--no-progress"], "merge": ["merge", str(tmp_path)]}[verb]
    code = ("import sys, streamwin.cli as cli; rc = cli.main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'streamwin ' + sys.argv[1] + ' imported torch'; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert "imported torch" not in r.stderr, r.stderr
    assert r.returncode == (2 if verb == "merge" else 0), r.stderr


def test_inspect_into_a_closed_pipe_prints_no_traceback(packed):
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `| head -1` after its line: every write gets EPIPE
    try:
        r = subprocess.run([sys.executable, "-m", "streamwin.cli", "inspect", str(packed), "--window", "16"],
                           stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=str(REPO)))
    finally:
        os.close(write_end)
    assert r.stderr == "", r.stderr
    assert r.returncode == 141  # as if killed by SIGPIPE, like other Unix tools in a pipe


def test_inspect_piped_into_head(packed):
    cmd = f"{sys.executable} -m streamwin.cli inspect {packed} --window 16 | head -1"
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.stdout == f"dataset      {packed}\n" and r.stderr == "", r.stderr


def test_inspect_names_unmerged_parts_and_what_to_run(npy_src, tmp_path, capsys):
    dest = tmp_path / "parts"
    assert run(capsys, "pack", str(npy_src[0]), str(dest), "--part", "0/3", "--shard-size", "20KB", "--no-progress")[0] == 0
    code, out, err = run(capsys, "inspect", str(dest))
    assert code == 2 and "Traceback" not in err
    assert "pack --part" in err and "1 of 3 parts" in err and "index.part00000-of-00003.json" in err, err
    for i in (1, 2):
        assert run(capsys, "pack", str(npy_src[0]), str(dest), "--part", f"{i}/3", "--shard-size", "20KB",
                   "--no-progress")[0] == 0
    code, out, err = run(capsys, "inspect", str(dest))
    assert code == 2 and "3 of 3 parts" in err and f"streamwin merge {dest}" in err, err
    assert run(capsys, "merge", str(dest))[0] == 0
    code, out, err = run(capsys, "inspect", str(dest))
    assert code == 0 and re.search(r"sequences\s+24\b", out)


# ---- what pack took from a table, and NaN/inf: said at pack time, shown by inspect ----------------

def test_pack_and_inspect_name_the_value_columns_and_the_left_out_ones(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "d.csv").write_text(",sensor,t,temp,humidity,site\n0,a,0,1.5,30,x\n1,a,1,2.0,31,x\n")
    code, out, err = run(capsys, "pack", str(tmp_path / "src"), str(tmp_path / "ds"), "--option", "id_column=sensor",
                         "--no-progress")  # a CSV with no order column named: is t a time or a value? pack asks
    assert code == 2 and "leaves 3 numeric columns, 't', 'temp', 'humidity'" in err, err
    assert "--option order_column=" in err and "--option value_columns=" in err, err
    for values in ([], ["--option", "value_columns=*"]):  # naming the time column says the rest are the values
        code, out, err = run(capsys, "pack", str(tmp_path / "src"), str(tmp_path / "ds"), "--option",
                             "id_column=sensor", "--option", "order_column=t", *values, "--no-progress")
        assert code == 0, err
    assert "value columns: temp, humidity" in out
    assert "left out: '' (pandas index), sensor (id column), t (order column), site (not numeric)" in out
    assert "--option value_columns=" in out  # how to choose others
    code, out, err = run(capsys, "inspect", str(tmp_path / "ds"))
    assert code == 0 and re.search(r"columns\s+temp, humidity  \(left out: '' \(pandas index\)", out), out


def test_pack_prints_nan_counts_and_refuses_them_with_nan_raise(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    np.save(tmp_path / "src" / "a.npy", np.array([[1.0, np.nan], [np.inf, 2.0], [np.nan, 3.0]], np.float32))
    np.save(tmp_path / "src" / "b.npy", np.ones((4, 2), np.float32))
    code, out, err = run(capsys, "pack", str(tmp_path / "src"), str(tmp_path / "ds"), "--no-progress")
    assert code == 0, err
    assert "NaN/inf: 2 NaN and 1 inf values, in 1 of 1 shards (pass --nan raise to refuse them)" in out
    assert "Warning" not in err and "nan=" not in err, err  # said once, in the command line's words
    code, out, err = run(capsys, "inspect", str(tmp_path / "ds"))
    assert code == 0 and re.search(r"NaN/inf\s+2 NaN, 1 inf  \(in 1 of 1 shards\)", out), out
    assert "columns" not in out  # .npy files have no column names
    code, out, err = run(capsys, "pack", str(tmp_path / "src"), str(tmp_path / "ds2"), "--nan", "raise", "--no-progress")
    assert code == 2 and "sequence 'a'" in err and "first at step 0" in err and "--nan count" in err, err
    assert not (tmp_path / "ds2" / "index.json").exists()


def test_inspect_of_a_manifest_from_an_older_streamwin(packed, tmp_path, capsys):
    old = tmp_path / "old"
    old.mkdir()
    for p in packed.iterdir():
        (old / p.name).write_bytes(p.read_bytes())
    doc = json.loads((old / "index.json").read_text())
    del doc["nonfinite"], doc["content_sha256"]  # neither was written then
    (old / "index.json").write_text(json.dumps(doc))
    code, out, err = run(capsys, "inspect", str(old))
    assert code == 0 and re.search(r"NaN/inf\s+not counted \(packed by an older streamwin\)", out), out
    code, out, err = run(capsys, "inspect", str(packed))
    assert code == 0 and re.search(r"NaN/inf\s+none\n", out), out


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_a_table_pack_that_fails_exits_cleanly(tmp_path, fmt):
    """pyarrow's threaded readers used to release the Python file they read from on one of their own
    threads after the read returned; when the process exited right after (an error in the first
    sequence), that thread met a finalizing interpreter and the process aborted (exit 134) in about
    one run of ten. The race needs several runs to show."""
    (tmp_path / "src").mkdir()
    if fmt == "csv":
        (tmp_path / "src" / "d.csv").write_text(",sensor,t,v,site\n0,a,0,1.5,x\n1,a,1,,x\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"sensor": ["a", "a"], "t": [0, 1], "v": [1.5, None]}), tmp_path / "src" / "d.parquet")
    cmd = [sys.executable, "-m", "streamwin.cli", "pack", str(tmp_path / "src"), str(tmp_path / "ds"),
           "--option", "id_column=sensor", "--option", "order_column=t", "--nan", "raise", "--no-progress"]
    for _ in range(12):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert r.returncode == 2 and "terminate called" not in r.stderr, (r.returncode, r.stderr)
        assert r.stderr.startswith("streamwin pack: error: sequence 'a' has 1 NaN")


# ---- object storage that cannot be reached, or refuses us: one line, exit 2, within 10 s ---------

def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STORAGE_VERBS = [["inspect"], ["verify"], ["index"], ["merge"], ["bench", "--window", "8", "--batches", "2"]]


#: ``python -m streamwin.cli`` (as its __main__ runs it), noting in the file named first when the command starts:
#: after the interpreter's start and torch's import, which take seconds more on a loaded machine.
CLI_STARTED = ("import sys, time; from streamwin.cli.main import main; "
               "open(sys.argv.pop(1), 'w').write(repr(time.monotonic())); sys.exit(main())")


@pytest.mark.parametrize("verb", STORAGE_VERBS, ids=[v[0] for v in STORAGE_VERBS])
def test_unreachable_object_storage_fails_fast_in_one_line(verb, tmp_path):
    """Before: index and merge printed ~150 lines of botocore traceback after ~10 s (exit 1)."""
    import time

    endpoint = f"http://127.0.0.1:{_closed_port()}"
    opts = ["--storage-option", "key=testing", "--storage-option", "secret=testing",
            "--storage-option", f"client_kwargs.endpoint_url={endpoint}",
            "--storage-option", "client_kwargs.region_name=us-east-1"]
    started = tmp_path / "started"
    r = subprocess.run([sys.executable, "-c", CLI_STARTED, str(started), verb[0], "s3://bucket/ds", *verb[1:], *opts],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    took = time.monotonic() - float(started.read_text())  # one clock for every process (CLOCK_MONOTONIC)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"streamwin {verb[0]}: error:"), r.stderr[-2000:]
    assert "s3://bucket/ds" in lines[0] and ("connect" in lines[0].lower())
    assert took < 10, took


def test_unreachable_or_forbidden_object_storage_fails_the_loader_fast(s3_server, s3_bucket, s3_fault_proxy):
    import time

    from servers import FaultPlan, s3_storage_options

    opts = s3_storage_options(f"http://127.0.0.1:{_closed_port()}")
    t0 = time.monotonic()
    with pytest.raises(sw.ManifestError, match="cannot connect|connection refused"):
        sw.WindowDataset("s3://bucket/ds", window=8).manifest
    assert time.monotonic() - t0 < 10
    seqs = {f"k{i}": np.arange(100, dtype=np.float32) for i in range(3)}
    sw.pack(list(seqs.items()), f"{s3_bucket}/ds", storage_options=s3_server.storage_options(), progress=False)
    proxy = s3_fault_proxy(FaultPlan(status_503_times=10**6, error_status=403, path_contains="index.json"))
    t0 = time.monotonic()
    with pytest.raises(sw.ManifestError, match="403") as e:
        sw.WindowDataset(f"{s3_bucket}/ds", window=8, read=sw.Read(storage_options=proxy.storage_options())).manifest
    assert time.monotonic() - t0 < 10 and f"{s3_bucket}/ds/index.json" in str(e.value)
    del opts


def test_inspect_refuses_a_mix_that_training_refuses_with_the_same_message(tmp_path, capsys):
    """Before: inspect printed a mixed plan for datasets that WindowDataset refuses to mix."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    sw.pack([(f"a{i}", np.zeros((50, 2), np.float32)) for i in range(4)], a, progress=False)
    sw.pack([(f"b{i}", np.zeros((50, 3), np.float32)) for i in range(4)], b, progress=False)
    with pytest.raises(ValueError) as e:
        sw.WindowDataset([a, b], window=8)
    code, out, err = run(capsys, "inspect", a, b, "--window", "8")
    assert code == 2 and not out
    assert err.strip() == f"streamwin inspect: error: {e.value}"
