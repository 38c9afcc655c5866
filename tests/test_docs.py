"""Every code block of README.md and docs/*.md runs as pasted, or says in the page why it cannot.

A page's ```python and ```bash blocks run in page order in one fresh directory (a later block may
read what an earlier one wrote), with this checkout first on PYTHONPATH and this interpreter's
folder first on PATH (`python`, `streamwin`, `torchrun`); examples/, tools/ and benchmarks/ are
linked into that directory, so repository paths work as in a checkout. A bash block made only of
`make` commands runs as `make -n` in the repository (what it would do, without doing it). A block
that cannot run here carries `<!-- not run: why -->` on the line above it, and is listed below in
NOT_RUN; blocks that another test runs (and checks the output of) are listed in RUN_ELSEWHERE.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]
TIMEOUT = 180  # seconds per block; a block of small data takes a few

#: (page, heading of the block's section, start of its first line): why it cannot run here.
NOT_RUN = {
    ("README.md", "From nothing to a resumed DDP run", "make setup"): "creates .venv",
    ("docs/packing.md", "Packing a corpus on a cluster", 'sw.pack("s3://bucket/raw'): "Ray, Dask, S3, the HF Hub",
    ("docs/remote.md", "Reading from object storage", "import streamwin as sw"): "an S3 bucket",
}
#: (page, heading, start of first line): the test that runs the block and checks what it prints.
RUN_ELSEWHERE = {
    ("README.md", "Quick start", "import numpy as np"): "tests/test_readme.py::test_quick_start_runs_as_pasted",
    ("docs/resume.md", "Elastic resume", "import numpy as np"):
        "tests/test_readme.py::test_elastic_resume_snippet_runs_as_pasted",
    ("docs/mixing.md", "Mixing datasets", "import numpy as np"):
        "tests/test_mix.py::test_readme_mixing_snippet_runs_as_pasted",
    ("docs/pretraining.md", "Pretraining a foundation model", "import numpy as np"):
        "tests/test_pretrain.py::test_readme_pretraining_snippet_runs_as_pasted",
    ("docs/packing.md", "Packing a corpus on a cluster", "import numpy as np"):
        "tests/test_pack_sources.py::test_the_readme_chronos_corpus_packs_end_to_end",
}
#: (page, heading, start of first line): what the block's output must show (stdout and stderr).
EXPECT = {
    ("README.md", "From nothing to a resumed DDP run", "python - <<'PY'"):
        r"resumed from ckpt/sines.pt: step 40, epoch 0",
    ("README.md", "The `streamwin` command", "python -c"): r"merged \d+ shards, 200 sequences",
    ("docs/integrity.md", "Validation, splits, faults, caching", "import streamwin as sw"): r"'skipped_windows': 0",
}
#: What only a cluster, a scheduler or a real bucket runs: a block holding one must be marked.
NEEDS_ELSEWHERE = re.compile(r"\bsbatch\b|\bsrun\b|--nnodes|ray://|s3://bucket|address=\"ray")
FENCE = re.compile(r"^(?:<!-- not run: (?P<why>.+?) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)^```$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    page: str
    heading: str
    lang: str
    code: str
    not_run: str | None

    @property
    def key(self) -> tuple[str, str, str]:
        first = self.code.splitlines()[0]
        for k in (*NOT_RUN, *RUN_ELSEWHERE, *EXPECT):
            if k[:2] == (self.page, self.heading) and first.startswith(k[2]):
                return k
        return (self.page, self.heading, first)


def blocks(page: str) -> list[Block]:
    """The ```python and ```bash blocks of a page, each with the heading it sits under."""
    text = (REPO / page).read_text()
    out = []
    for m in FENCE.finditer(text):
        if m.group("lang") in ("python", "bash"):
            heads = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```$", "", text[:m.start()], flags=re.M | re.S), re.M)
            out.append(Block(page, heads[-1] if heads else "", m.group("lang"), m.group("code"), m.group("why")))
    return out


def only_make(code: str) -> bool:
    lines = [ln.split("#")[0].strip() for ln in code.splitlines()]
    return all(ln.startswith("make ") for ln in lines if ln) and any(lines)


def run_block(block: Block, cwd: Path) -> str:
    """Run one block as pasted; its output, or a failure naming the page, heading and error."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]), MPLBACKEND="Agg")
    for k in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS"):  # under `make test`
        env.pop(k, None)
    if block.lang == "python":
        script = cwd / "block.py"
        script.write_text(block.code)
        cmd, where = [sys.executable, str(script)], cwd
    elif only_make(block.code):
        lines = [ln.split("#")[0].split() for ln in block.code.splitlines() if ln.split("#")[0].strip()]
        cmd = ["bash", "-ec", "\n".join(shlex.join(["make", "--no-print-directory", "-n", *ln[1:]]) for ln in lines)]
        where = REPO
    else:
        cmd, where = ["bash", "-e", "-o", "pipefail", "-c", block.code], cwd
    r = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, (f"{block.page}, under {block.heading!r}: the {block.lang} block starting "
                               f"{block.code.splitlines()[0]!r} fails as pasted:\n"
                               f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r.stdout + r.stderr


def to_run(page: str) -> list[Block]:
    return [b for b in blocks(page) if b.not_run is None and b.key not in RUN_ELSEWHERE]


@pytest.mark.parametrize("page", [p for p in PAGES if to_run(p)])
def test_every_block_of_the_page_runs_as_pasted(page, tmp_path):
    todo = to_run(page)
    for name in ("examples", "tools", "benchmarks"):
        (tmp_path / name).symlink_to(REPO / name)
    for block in todo:
        out = run_block(block, tmp_path)
        if block.key in EXPECT:
            assert re.search(EXPECT[block.key], out), f"{block.key}: no {EXPECT[block.key]!r} in:\n{out[-3000:]}"


def test_blocks_that_do_not_run_here_are_marked_and_listed():
    every = [b for page in PAGES for b in blocks(page)]
    marked = {b.key: b.not_run for b in every if b.not_run is not None}
    assert set(marked) == set(NOT_RUN), f"marked in the pages: {sorted(marked)}; listed here: {sorted(NOT_RUN)}"
    unmarked = [b.key for b in every if b.not_run is None and NEEDS_ELSEWHERE.search(b.code)]
    assert not unmarked, ("these blocks need a cluster, a scheduler or a bucket: "
                          f"mark them `<!-- not run: why -->`: {unmarked}")
    print(f"\n{len(every)} blocks: {len(every) - len(marked) - len(RUN_ELSEWHERE)} run here, "
          f"{len(RUN_ELSEWHERE)} by other tests, {len(marked)} not run:")
    for key, why in sorted(marked.items()):
        print(f"  {key[0]}, {key[1]!r}: {why}")


def test_blocks_run_elsewhere_exist_and_their_tests_too():
    keys = {b.key for page in PAGES for b in blocks(page)}
    assert set(EXPECT) <= keys, f"no block {set(EXPECT) - keys}: update EXPECT"
    for key, test in RUN_ELSEWHERE.items():
        assert key in keys, f"no block {key}: update RUN_ELSEWHERE"
        path, name = test.split("::")
        assert f"def {name}(" in (REPO / path).read_text(), f"{test} does not exist"


def test_every_docs_page_is_linked_from_the_readme():
    readme = (REPO / "README.md").read_text()
    missing = [p for p in PAGES[1:] if f"]({p})" not in readme]
    assert not missing, f"README.md links no {missing}"


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes of a markdown file's headings (lower case, punctuation dropped, spaces -> -)."""
    text = re.sub(r"^```.*?^```$", "", path.read_text(), flags=re.M | re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", [*PAGES, "examples/README.md"])
def test_relative_links_and_their_anchors_resolve(page):
    here = REPO / page
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", here.read_text()):
        if "://" in target:
            continue
        path = here.parent.joinpath(target).resolve() if target else here
        assert path.exists(), f"{page} links {target}, which is not there"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{page} links {target}#{anchor}: no such heading in {path.name}"


#: What belongs in a commit body or benchmarks/results.md, never in a page a user reads: a date, a commit
#: hash, a machine's load, a scratch path of a work tree.
DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b|load average|/work/")


@pytest.mark.parametrize("page", PAGES)
def test_pages_say_how_things_work_not_when_they_were_measured(page):
    prose = re.sub(r"^```.*?^```$", "", (REPO / page).read_text(), flags=re.M | re.S)
    found = [m.group(0) for m in DATED.finditer(prose)]
    assert not found, f"{page} carries dated runs ({found[:5]}): move them to benchmarks/results.md"


def test_the_performance_page_is_a_reference():
    lines = len((REPO / "docs" / "performance.md").read_text().splitlines())
    assert lines <= 300, f"docs/performance.md has {lines} lines: its runs belong in benchmarks/results.md"
