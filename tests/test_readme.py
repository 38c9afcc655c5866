"""README.md stays true: its quick start runs as pasted, its from-nothing path sets up with a
target made for that, its set-up says what it downloads and how to pick torch's CPU build, it
is a front page (short, every CLI verb, every docs page), and what its commands write is ignored
by git. ``section`` and ``code_blocks`` also serve the tests that run docs/ pages' blocks."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import argparse
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def section(title: str, page: str = "README.md") -> str:
    """The text of the section of ``page`` (README.md, docs/....md) whose heading is ``title``, up to the
    next heading of its level or above."""
    text = (REPO / page).read_text()
    m = re.search(rf"^(#+) {re.escape(title)}\n", text, flags=re.M)
    assert m, f"{page} has no section {title!r}"
    level = len(m.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", flags=re.M).search(text, m.end())
    return text[m.end():end.start() if end else len(text)]


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.M | re.S)


def run_snippet(code: str, cwd) -> subprocess.CompletedProcess:
    """A python block of the docs run as pasted, in ``cwd``, with this checkout importable; it must succeed."""
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_quick_start_runs_as_pasted(tmp_path):
    blocks = code_blocks(section("Quick start"), "python")
    assert len(blocks) == 1, "the quick start is one python block"
    r = run_snippet(blocks[0], tmp_path)
    assert re.search(r"\d+ batches per epoch", r.stdout), r.stdout


def test_from_nothing_sets_up_with_make_setup():
    first = code_blocks(section("From nothing to a resumed DDP run"), "bash")[0].splitlines()[0]
    assert first.split("#")[0].split() == ["make", "setup"], first
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # under `make test`
    r = subprocess.run(["make", "--no-print-directory", "-n", "setup", "PYTHON=python3"], cwd=REPO,
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert "-m venv .venv" in r.stdout or "Nothing to be done for 'setup'" in r.stdout or r.stdout == "", r.stdout


def make_n(*args: str) -> str:
    """What ``make -n -B ARGS`` would run here (every command, as if nothing were built)."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # under `make test`
    r = subprocess.run(["make", "--no-print-directory", "-n", "-B", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("index, url", [("", None), ("cpu", "https://download.pytorch.org/whl/cpu"),
                                        ("https://mirror.example/whl/cpu", "https://mirror.example/whl/cpu")])
def test_make_setup_takes_torch_from_the_index_asked_for(index, url):
    """By default pip gets torch where it gets everything (PyPI: the CUDA build on Linux x86_64);
    TORCH_INDEX=cpu or a URL adds that index to both installs that name torch."""
    out = make_n("setup", "PYTHON=python3", *([f"TORCH_INDEX={index}"] if index else []))
    installs = [line for line in out.splitlines() if "pip install" in line and "torch==2.13.0" in line]
    assert len(installs) == 2, out
    for line in installs:
        if url is None:
            assert "index-url" not in line, line
        else:
            assert f"--extra-index-url {url} " in line, line


def test_the_set_up_says_what_torch_it_downloads_and_how_to_pick_the_cpu_build():
    text = " ".join(section("Set-up, demo, tests").split())
    assert "CUDA build" in text and "2.5 GB" in text, text
    assert "make setup TORCH_INDEX=cpu" in text, text


def test_the_readme_is_a_front_page_that_names_every_verb_of_the_cli():
    assert len(README.splitlines()) <= 200, len(README.splitlines())
    peers = section("Against the peers")
    assert "](docs/peers.png)" in peers and "python benchmarks/peers.py" in peers, "the peers' plot, with its command"
    r = subprocess.run([sys.executable, "-m", "streamwin.cli", "--help"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    verbs = re.findall(r"^    (\w+)\s{2,}", r.stdout, flags=re.M)
    assert len(verbs) >= 6, r.stdout
    shown = " ".join(code_blocks(section("The `streamwin` command"), "bash"))
    missing = [v for v in verbs if not re.search(rf"^streamwin {v} ", shown, flags=re.M)]
    assert not missing, f"the README's CLI section has no example of: {missing}"



def test_the_readme_says_what_it_is_and_how_to_start_before_any_measurement():
    """A front page: what streamwin is, the set-up and the quick start come first, within 400 words, and no
    percentage of one mode against another stands on it (measurements go to docs/ and benchmarks/results.md)."""
    before = README.split("\n## Quick start\n", 1)[0]
    assert len(before.split()) <= 400, f"{len(before.split())} words before the quick start"
    assert not re.search(r"\d%", README), re.findall(r".{0,40}\d%", README)

def test_make_demo_writes_under_the_data_folder_the_readme_names():
    """The demo's 170 MB go where the README says, under the git-ignored data/ (before: ./demo_data, unsaid)."""
    assert "examples/demo.py --data data/demo/stdlib" in make_n("demo")
    text = " ".join(section("Set-up, demo, tests").replace("#", " ").split())  # comments over lines joined
    assert "about 170 MB in data/demo" in text and "`make clean` removes it" in text, text
    assert "data/demo" in make_n("clean")


@pytest.mark.parametrize("path", ["data/sines/index.json", "data/quickstart/shard-000000.tar", "ckpt/sines.pt",
                                  "data/npy/s000.npy", "data/sensors.csv",
                                  "demo_data/stdlib/index.json", "bench_data/full/x.npy", "data/demo/stdlib/index.json",
                                  "data/demo/demo_ckpt.pt"])
def test_what_the_readme_and_the_demo_write_is_ignored_by_git(path):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    r = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO, timeout=60)
    assert r.returncode == 0, f"{path} is not ignored by .gitignore"


def test_elastic_resume_snippet_runs_as_pasted(tmp_path):
    blocks = code_blocks(section("Elastic resume", "docs/resume.md"), "python")
    assert len(blocks) == 1
    r = run_snippet(blocks[0], tmp_path)
    m = re.search(r"batches per rank: \[(\d+), (\d+), (\d+)\] after 10, len (\d+)", r.stdout)
    assert m and len(set(m.groups()[:3])) == 1 and int(m.group(4)) == 10 + int(m.group(1)) > 10, r.stdout


def test_canonical_resume_snippet_replays_the_uninterrupted_jobs_global_batches(tmp_path):
    blocks = code_blocks(section("One order for every world: canonical streams", "docs/resume.md"), "python")
    assert len(blocks) == 1
    r = run_snippet(blocks[0], tmp_path)
    m = re.search(r"steps after 10: (\d+), len (\d+), the uninterrupted job's global batches: True", r.stdout)
    assert m and int(m.group(2)) == 10 + int(m.group(1)) > 10, r.stdout


class _Parsed(Exception):
    """Raised instead of parsing: carries the example's parser out of its main()."""


def parser_of(script: str, monkeypatch) -> argparse.ArgumentParser:
    """The argument parser an example builds, caught where it would parse (nothing of the example runs)."""
    spec = importlib.util.spec_from_file_location(f"example_{script[:-3]}", REPO / "examples" / script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    spec.loader.exec_module(module)

    def caught(self, args=None, namespace=None):
        raise _Parsed(self)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    with pytest.raises(_Parsed) as got:
        module.main([])
    return got.value.args[0]


@pytest.mark.parametrize("script", ["train_ddp.py", "train_lightning.py", "hpo_optuna.py", "train_cuda_graph.py"])
def test_the_examples_readme_states_each_scripts_defaults(script, monkeypatch):
    """examples/README.md: every default it states for a script (its "Defaults:" line, and "`--x`
    ... (default N" in its prose) is the default of that script's parser."""
    text = _example_section(script)
    stated = re.findall(r"`(--[\w-]+) ([^`]+)`", text.split("Defaults:", 1)[1].split("\n\n", 1)[0])
    stated += re.findall(r"`(--[\w-]+)(?: [A-Z]+)?`[^`(]*\(default:? ([\w.]+)", text)
    assert len(stated) >= 5, text
    parser = parser_of(script, monkeypatch)
    for option, value in stated:
        default = parser.get_default(option[2:].replace("-", "_"))
        assert str(default) == value, f"examples/README.md says {option} defaults to {value}; {script}: {default}"
    assert "DataLoader workers per rank" not in text


def _example_section(script: str) -> str:
    text = (REPO / "examples" / "README.md").read_text()
    m = re.search(rf"^## {re.escape(script)}:.*?\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert m, f"examples/README.md has no section for {script}"
    return m.group(1)
