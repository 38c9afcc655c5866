"""README.md stays true: its quick start runs as pasted, its from-nothing path sets up with a
target made for that, and what its commands write is ignored by git."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def section(title: str) -> str:
    """The text of the README section whose heading is ``title``, up to the next heading of its level."""
    m = re.search(rf"^(#+) {re.escape(title)}\n(.*?)(?=^#{{1,2}} |\Z)", README, flags=re.M | re.S)
    assert m, f"README.md has no section {title!r}"
    return m.group(2)


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.M | re.S)


def test_quick_start_runs_as_pasted(tmp_path):
    blocks = code_blocks(section("Quick start"), "python")
    assert len(blocks) == 1, "the quick start is one python block"
    r = subprocess.run([sys.executable, "-c", blocks[0]], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr[-3000:]
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


@pytest.mark.parametrize("path", ["data/sines/index.json", "data/quickstart/shard-000000.tar", "ckpt/sines.pt",
                                  "demo_data/stdlib/index.json", "bench_data/full/x.npy"])
def test_what_the_readme_and_the_demo_write_is_ignored_by_git(path):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    r = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO, timeout=60)
    assert r.returncode == 0, f"{path} is not ignored by .gitignore"


def test_elastic_resume_snippet_runs_as_pasted(tmp_path):
    blocks = code_blocks(section("Elastic resume"), "python")
    assert len(blocks) == 1
    r = subprocess.run([sys.executable, "-c", blocks[0]], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"batches per rank: \[(\d+), (\d+), (\d+)\] after 10, len (\d+)", r.stdout)
    assert m and len(set(m.groups()[:3])) == 1 and int(m.group(4)) == 10 + int(m.group(1)) > 10, r.stdout
