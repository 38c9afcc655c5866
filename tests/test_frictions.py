"""What a new user tripped on (issue 29, item 5), each through the real part: the example scripts run as
subprocesses (torchrun with gloo where it is about torchrun), the command line through its main, pack on files.

* a wrong --data or a checkpoint of another --stride: one line per process, exit 2, no traceback of ours;
* a CSV with its time column named order_column: the other numeric columns are the values;
* a mix with a dataset too short for the crop: which dataset, its longest sequence, what to pass (--pad);
* SIGTERM under slurm/train.sbatch (the whole process group, as SLURM signals it): the ranks save, the
  script exits 0 although torchrun exits 1;
* one wording for num_workers: the CLI's help and output, the examples' --workers;
* typos: `inspect --windw` gets inspect's usage and "did you mean '--window'", a mistyped keyword of
  every public function or class gets the close name, `pack(dict)` says to pass its items;
* the example models' losses on flat-window series stay sane (before: 1e4 and more).
"""
from __future__ import annotations

import inspect
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import streamwin as sw
from streamwin.cli.args import WORKERS_HELP
from streamwin.cli.main import main as cli_main
from streamwin.packing.inputs import INPUT_OPTIONS
from test_examples import EXAMPLES, LAUNCH_TIMEOUT, ROOT, clean_env, free_port, sequences

W, H = 32, 4


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("frictions") / "ds")
    sw.pack(list(sequences().items()), url, shard_bytes=20_000, progress=False)
    return url


@pytest.fixture(scope="module")
def short(tmp_path_factory) -> tuple[str, int]:
    """A dataset whose sequences are all shorter than a 32-step crop, and its longest length."""
    rng = np.random.default_rng(5)
    seqs = [(f"c{i:02d}", rng.standard_normal((int(rng.integers(8, 30)), 2)).astype(np.float32)) for i in range(12)]
    url = str(tmp_path_factory.mktemp("frictions") / "short")
    sw.pack(seqs, url, progress=False)
    return url, max(len(a) for _, a in seqs)


def launch(cmd: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    proc = subprocess.run(cmd, cwd=ROOT, env=env or clean_env(MASTER_PORT=str(free_port())), capture_output=True,
                          text=True, timeout=LAUNCH_TIMEOUT)
    return proc.returncode, proc.stdout + proc.stderr


def torchrun(script: str, *args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            os.path.join(EXAMPLES, script), *args]


def ours(out: str) -> list[str]:
    """The lines the example printed (its log lines), without torchrun's."""
    return [line for line in out.splitlines() if re.match(r"\d\d:\d\d:\d\d \[rank \d\]", line)]


# ---- failures: one line per process, exit 2 --------------------------------------------------------

def test_train_ddp_with_no_dataset_at_data_says_it_in_one_line_per_rank_and_exits_2(tmp_path):
    """Before: 141 lines, 5 tracebacks (each rank's, chained, and torchrun's), exit 1 from every rank."""
    code, out = launch(torchrun("train_ddp.py", "--data", "no/such/path", "--ckpt", str(tmp_path / "c.pt")))
    lines = ours(out)
    assert len(lines) == 2 and {ln[10:16] for ln in lines} == {"rank 0", "rank 1"}, out[-4000:]
    for line in lines:
        assert "error: ManifestError: no index.json at no/such/path" in line and "(check --data)" in line
    assert "[rank0]" not in out and "[rank1]" not in out, out[-4000:]  # no rank's traceback
    assert out.count("Traceback") == 1 and "ChildFailedError" in out, out[-4000:]  # torchrun's own report
    codes = re.findall(r"exitcode\s+: (-?\d+)", out)  # the ranks torchrun saw ended (the other it stops)
    assert codes and set(codes) == {"2"} and code == 1, out[-4000:]  # its ranks exited 2, so torchrun exits 1


def test_train_ddp_resumed_with_another_stride_names_the_checkpoints_and_exits_2(data, tmp_path):
    ckpt = str(tmp_path / "c.pt")
    script = [sys.executable, os.path.join(EXAMPLES, "train_ddp.py"), "--data", data, "--ckpt", ckpt, "--window",
              str(W), "--horizon", str(H), "--batch-size", "8"]
    code, out = launch([*script, "--stride", "16", "--stop-after", "2"])
    assert code == 0, out[-3000:]
    assert torch.load(ckpt, weights_only=True)["args"]["stride"] == 16
    code, out = launch([*script, "--stride", "8"])
    assert code == 2 and "Traceback" not in out, out[-3000:]
    assert len(out.splitlines()) == 1 and "error: StateMismatchError: cannot resume exactly" in out, out
    assert "stride: in checkpoint 16 / now 8" in out and f"{ckpt} was written with --stride 16" in out, out
    assert "another --ckpt" in out


# ---- pack: order_column names the time column, the other numeric columns are the values ------------

def test_a_csv_with_its_order_column_named_takes_the_other_numeric_columns_as_values(tmp_path):
    """docs/packing.md: pass `value_columns=[...]`, an `order_column` for a time column, or "*". Before:
    order_column="t" alone was refused ("leaves 6 numeric columns")."""
    rng = np.random.default_rng(2)
    names = ["a", "b", "c", "d", "e", "f"]
    rows = []  # (id, t, six values), written in a shuffled order: order_column sorts each id's rows
    for sid in ("m1", "m0", "m2"):
        for t in range(int(rng.integers(3, 9))):
            rows.append((sid, t, *rng.normal(size=6).round(3)))
    shuffled = [rows[i] for i in rng.permutation(len(rows))]
    path = tmp_path / "six.csv"
    path.write_text("id,t," + ",".join(names) + "\n" + "".join(
        f"{r[0]},{r[1]}," + ",".join(map(str, r[2:])) + "\n" for r in shuffled))
    m = sw.pack(str(path), str(tmp_path / "ds"), id_column="id", order_column="t", progress=False)
    assert m.value_columns == tuple(names)  # file order; id and order column excluded
    first_seen = list(dict.fromkeys(r[0] for r in shuffled))
    ds = sw.WindowDataset(str(tmp_path / "ds"), window=3, stride=1000, batch_size=1, rank=0,
                          world_size=1, order=sw.Order(shuffle=False))
    got = {b["key"][0]: b["x"][0].numpy() for b in sw.WindowLoader(ds, num_workers=0)}
    assert list(m.keys(range(m.num_sequences))) == first_seen
    for sid in first_seen:
        want = np.array([r[2:] for r in sorted((r for r in rows if r[0] == sid), key=lambda r: r[1])])
        np.testing.assert_allclose(got[sid], want[:3], rtol=1e-6)
    with pytest.raises(sw.PackError, match=r"leaves 7 numeric columns, 't', 'a'.*order_column=\.\.\."):
        sw.pack(str(path), str(tmp_path / "ds2"), id_column="id", progress=False)  # is t a time or a value? asked
    # a column with one value per id beside the values (a label): a feature of no step, asked as well
    labelled = tmp_path / "labelled.csv"
    label = {"m0": 3, "m1": 1, "m2": 3}
    labelled.write_text("id,t,label," + ",".join(names) + "\n" + "".join(
        f"{r[0]},{r[1]},{label[r[0]]}," + ",".join(map(str, r[2:])) + "\n" for r in shuffled))
    with pytest.raises(sw.PackError, match=r"'label' holds one value per id .* value_columns=\['a', 'b', 'c', 'd', "
                                           r"'e', 'f'\], or pass value_columns='\*'"):
        sw.pack(str(labelled), str(tmp_path / "ds3"), id_column="id", order_column="t", progress=False)


# ---- a mix with a dataset shorter than the crop ------------------------------------------------------

def test_a_mix_with_a_dataset_too_short_for_the_window_says_which_why_and_what_to_pass(data, short):
    url, longest = short
    with pytest.raises(ValueError) as e:
        len(sw.WindowLoader(sw.WindowDataset([data, url], window=W, stride=W // 2, rank=0, world_size=1,
                                             batch_size=4, mix=sw.Mix(weights=[0.8, 0.2]),
                                             crops=sw.Crops(jitter=True, min_window=8, window_multiple=4,
                                                            pack_length=64)), num_workers=0))
    msg = str(e.value)
    assert msg.startswith(f"{url!r} has no windows but a share of ")
    assert f"its longest sequence has {longest} steps, fewer than the {W} a window reads" in msg
    assert "pad=True" in msg and f"window={(longest // 4) * 4} or less" in msg, msg
    assert "WindowSpec(" not in msg


PRETRAIN = ["--patch", "4", "--window", str(W), "--min-window", "8", "--pack-length", "64", "--batch-size", "4",
            "--weights", "0.8,0.2"]


def test_pretrain_example_says_a_short_dataset_in_one_line_and_trains_with_pad(data, short, tmp_path):
    url, longest = short
    cmd = [sys.executable, os.path.join(EXAMPLES, "pretrain.py"), "--data", f"{data},{url}", "--ckpt",
           str(tmp_path / "p.pt"), *PRETRAIN, "--stop-after", "2"]
    code, out = launch(cmd)
    assert code == 2 and "Traceback" not in out and len(out.splitlines()) == 1, out[-3000:]
    assert f"pretrain: error: ValueError: {url!r} has no windows" in out and f"has {longest} steps" in out
    assert "Pass --pad" in out and f"--window {(longest // 4) * 4} or less" in out, out
    code, out = launch([*cmd, "--pad"])
    assert code == 0 and "stopping at step 2" in out, out[-3000:]


# ---- SIGTERM: the ranks save; torchrun exits 1; slurm/train.sbatch exits 0 ------------------------------

def test_sigterm_to_the_sbatch_process_group_saves_every_rank_and_the_job_exits_0(data, tmp_path):
    """As SLURM cancels or preempts a job: SIGTERM to every process of it (the batch script, torchrun, the
    ranks). torchrun exits 1 (SignalException) whatever its ranks did; the script says the ranks saved and
    exits 0. Before: it exited 1, and stopped waiting for torchrun as soon as the signal came."""
    ckpt = str(tmp_path / "run.pt")
    env = clean_env(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0", SLURM_NNODES="1", SLURM_NODEID="0",
                    SLURM_NTASKS_PER_NODE="1", SRUN="none", PYTHON=sys.executable, DATA=data, CKPT=ckpt,
                    NPROC_PER_NODE="2", MASTER_PORT=str(free_port()))
    cmd = ["bash", os.path.join(EXAMPLES, "slurm", "train.sbatch"), "--window", str(W), "--horizon", str(H),
           "--batch-size", "4", "--epochs", "100", "--log-every", "1", "--ckpt-every", "1000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "epoch 0 step" in line:  # training: every rank has its handler
                os.killpg(proc.pid, signal.SIGTERM)
                break
        lines += proc.stdout.readlines()
        proc.wait(timeout=LAUNCH_TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = "".join(lines)
    stopped = re.search(r"stopping at step (\d+) \(signal SIGTERM\)", out)
    assert stopped, out[-4000:]
    step = int(stopped.group(1))
    assert "SignalException" in out, out[-4000:]  # torchrun's exit 1
    assert f"every rank saved at step {step} (signal SIGTERM): exit 0 (torchrun exited 1" in out, out[-4000:]
    assert proc.returncode == 0, out[-4000:]
    assert torch.load(ckpt, weights_only=True)["step"] == step
    assert open(ckpt + ".stopped").read() == f"step {step} (signal SIGTERM)\n"


# ---- one wording for num_workers ------------------------------------------------------------------

def test_num_workers_has_one_true_wording_in_the_cli_and_the_examples(data, capsys):
    """Before: inspect's help said "DataLoader workers per rank", its output "1 worker(s)" for 0 workers."""
    assert "not DataLoader workers" in WORKERS_HELP and "trainer's process" in WORKERS_HELP
    assert cli_main(["inspect", "--help"]) == 0
    helptext = " ".join(capsys.readouterr().out.split())
    assert " ".join(WORKERS_HELP.split()) in helptext and "DataLoader workers per rank" not in helptext
    for n, said in ((0, "2 rank(s) x 1 stream in the trainer's process"),
                    (3, "2 rank(s) x 3 worker processes, a stream each")):
        assert cli_main(["inspect", data, "--window", "16", "--world-size", "2", "--num-workers", str(n)]) == 0
        out = capsys.readouterr().out
        # the dataset's canonical streams (as summary() says), then what this world runs
        assert re.search(rf"streams\s+8 canonical \(.*\); here {re.escape(said)}\n", out), out
        assert "worker(s)" not in out
    sys.path.insert(0, EXAMPLES)
    try:
        import pretrain
        import train_ddp
    finally:
        sys.path.remove(EXAMPLES)
    assert train_ddp.WORKERS_HELP == WORKERS_HELP
    for module in (train_ddp, pretrain):
        with pytest.raises(SystemExit):
            module.parse_args(["--help"])
        assert " ".join(WORKERS_HELP.split()) in " ".join(capsys.readouterr().out.split()), module.__name__


# ---- typos: the subcommand's usage, the close name -------------------------------------------------

def test_a_mistyped_inspect_option_gets_inspects_usage_and_the_close_option(data, capsys):
    """Before: the top-level usage (`streamwin [-h] COMMAND ...`), no hint."""
    code = cli_main(["inspect", data, "--windw", "16"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("usage: streamwin inspect "), err
    assert "streamwin inspect: error: unrecognized arguments: --windw 16; did you mean '--window'?" in err, err
    assert cli_main(["inspect", data, "--window=16", "--num-wokers=1"]) == 2  # --opt=value too
    assert "did you mean '--num-workers'?" in capsys.readouterr().err


PUBLIC_CALLERS = ("pack", "merge", "compact", "verify", "index_shards", "prefetch", "load_manifest", "make_plan",
                  "ShardCache", "WindowSpec", "PlanConfig", "WindowDataset", "WindowLoader", "Crops", "Order", "Select",
                  "Mix", "Read")
NOT_CALLED_BY_USERS = {"Manifest", "Plan"}  # returned by streamwin, not built by its users


def test_every_public_function_and_class_suggests_the_keyword_a_typo_meant(data):
    """Before: Python's "got an unexpected keyword argument" with no hint, or, for pack, "unknown option(s)
    ['shard_byte'] for format 'iterable'; accepted: none"."""
    public = {n for n in sw.__all__ if callable(getattr(sw, n)) and not (
        isinstance(getattr(sw, n), type) and issubclass(getattr(sw, n), Exception))}
    assert public - NOT_CALLED_BY_USERS == set(PUBLIC_CALLERS)
    for name in PUBLIC_CALLERS:
        params = [p.name for p in inspect.signature(getattr(sw, name)).parameters.values()
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and len(p.name) > 4]
        assert params, name
        for param in params:
            typo = param[:-1] if param[-1] != "s" else param[:-2] + "s"  # shard_bytes -> shard_byts
            with pytest.raises((TypeError, sw.PackError)) as e:
                getattr(sw, name)(**{typo: 1})
            assert str(e.value) == f"{name}() got an unexpected keyword argument {typo!r}; did you mean {param!r}?"
    with pytest.raises(sw.PackError, match=r"^pack\(\) got an unexpected keyword argument 'shard_byte'; did you mean "
                                           r"'shard_bytes'\?$"):
        sw.pack([("a", np.zeros(3))], "memory://frictions/x", shard_byte=1 << 20)
    with pytest.raises(TypeError, match=r"got an unexpected keyword argument 'zzz'$"):
        sw.WindowSpec(4, 2, zzz=1)  # nothing close: no hint
    with pytest.raises(TypeError, match="got unexpected arguments: zzz"):
        sw.WindowLoader(sw.WindowDataset(data, window=W), zzz=1)  # **kwargs: left to WindowLoader's own check
    assert "window" in inspect.signature(sw.WindowDataset).parameters  # the signature is still the class's


def test_input_options_pass_pack_and_a_mistyped_one_gets_the_format_option(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("id,t,v\na,0,1.5\na,1,2.5\n")
    with pytest.raises(sw.PackError, match=r"unknown option\(s\) \['value_column'\] for format 'csv'; accepted: "
                                           r"\[.*\]; did you mean 'value_columns'\?$"):
        sw.pack(str(path), str(tmp_path / "ds"), id_column="id", value_column="v", progress=False)
    for option in INPUT_OPTIONS:  # every format's option reaches the format's check, none taken for a typo of pack's
        with pytest.raises(sw.PackError) as e:
            sw.pack([("a", np.zeros(3))], str(tmp_path / "x"), **{option: 1}, progress=False)
        assert "unknown option(s)" in str(e.value) and "for format 'iterable'" in str(e.value), option


def test_pack_of_a_dict_says_to_pass_its_items(tmp_path):
    """Before: "iterable item 0: expected (key, array) or (key, array, meta), got str"."""
    seqs = {"a": np.arange(5.0), "b": np.arange(7.0)}
    with pytest.raises(sw.PackError, match=r"not a dict: for key -> array, pass its items, pack\(d\.items\(\), "
                                           r"\.\.\.\); for a table's columns .* pandas\.DataFrame\(d\)"):
        sw.pack(seqs, str(tmp_path / "ds"), progress=False)
    m = sw.pack(seqs.items(), str(tmp_path / "ds"), progress=False)
    assert m.keys(range(m.num_sequences)) == ["a", "b"] and m.length.tolist() == [5, 7]


# ---- the example models on flat windows -------------------------------------------------------------

def appliance(n: int, rng: np.random.Generator) -> np.ndarray:
    """An appliance's current: off (exactly 0 A) or on (a level with a ripple), in runs of 30 to 150 steps."""
    runs, on = [], False
    while sum(map(len, runs)) < n:
        k = int(rng.integers(30, 150))
        runs.append(rng.uniform(1, 5) + 0.3 * np.sin(np.arange(k) * 0.5) + 0.02 * rng.standard_normal(k) if on
                    else np.zeros(k))
        on = not on
    return np.concatenate(runs)[:n].astype(np.float32)


def test_the_example_forecaster_trains_sanely_on_flat_windows(tmp_path):
    """Windows of an appliance switched off are flat: scaled by std + 1e-5, the step that follows one made
    losses of 1e9 (median 2e9 here before); floored at half the batch's deviation they stay below 10."""
    rng = np.random.default_rng(0)
    url = str(tmp_path / "appliance")
    sw.pack([(f"f{i:02d}", appliance(int(rng.integers(300, 800)), rng)) for i in range(30)], url, progress=False)
    sys.path.insert(0, EXAMPLES)
    try:
        from train_ddp import Forecaster, features_of, forecast_loss
    finally:
        sys.path.remove(EXAMPLES)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ds = sw.WindowDataset(url, window=W, stride=16, horizon=8, batch_size=32, seed=0, rank=0, world_size=1)
        torch.manual_seed(0)
        model = Forecaster(W, 8, features_of(ds))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader, losses = sw.WindowLoader(ds, num_workers=0), []
        for epoch in range(2):
            loader.set_epoch(epoch)
            for batch in loader:
                flat = (batch["x"].std(1) == 0).float().mean().item()
                loss = forecast_loss(model, batch, torch.device("cpu"))
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert flat > 0.1  # flat windows are common here
    assert len(losses) > 40 and max(losses) < 10, max(losses)
    assert np.mean(losses[-10:]) < np.mean(losses[:10])  # and it learns


def test_the_pretrain_example_normalizes_a_flat_crop_without_blowing_up():
    sys.path.insert(0, EXAMPLES)
    try:
        import pretrain
    finally:
        sys.path.remove(EXAMPLES)
    x = torch.zeros(2, 16, 1)
    x[0, 8:] = 3.0  # row 0: a flat crop at 0, then a crop at 3; row 1: a varying crop
    x[1, :, 0] = torch.sin(torch.arange(16.0))
    seg = torch.tensor([[1] * 8 + [2] * 8, [1] * 16])
    out = pretrain.crop_normalized(x, seg, torch.ones_like(x, dtype=torch.bool))
    assert torch.isfinite(out).all()
    assert out[0].abs().max() == 0  # flat crops: at their mean
    values = x[:, :, 0].numpy().astype(np.float64)
    floor = 0.5 * values.std()  # half the batch's deviation
    crop = values[1]
    want = (crop - crop.mean()) / max(crop.std(), floor)
    np.testing.assert_allclose(out[1, :, 0].numpy(), want, rtol=1e-4, atol=1e-6)
    x[0, :8] = 0.0
    x[0, 8:, 0] = 1e-4 * torch.randn(8, generator=torch.Generator().manual_seed(0))  # near-flat noise
    assert pretrain.crop_normalized(x, seg, torch.ones_like(x, dtype=torch.bool))[0].abs().max() < 1e-2  # not ~1
