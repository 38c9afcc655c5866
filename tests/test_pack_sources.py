"""Sources beyond files of arrays: Arrow IPC files (file and stream formats), Hugging Face datasets,
pyarrow Tables and pandas DataFrames, variates-first rows, and fsspec URLs and globs as inputs.

Each gives the sequences computed here from the same rows (or those of the parquet file it was read
from), independently of streamwin's readers."""
from __future__ import annotations

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

import streamwin as sw
from engine_cases import row_table, sequences
from streamwin.errors import PackError


def chronos(rng_seed: int = 0, n: int = 25) -> pa.Table:
    return row_table(np.random.default_rng(rng_seed), n)


def want_of(table: pa.Table) -> dict[str, np.ndarray]:
    """The sequences of a Chronos-style table: key = id, values = target, computed from Python lists."""
    return {i: np.asarray(t, dtype=np.float32) for i, t in zip(table.column("id").to_pylist(),
                                                               table.column("target").to_pylist())}


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k


@pytest.mark.parametrize("kind", ["file", "stream", "feather"])
def test_arrow_ipc_files_are_a_format(tmp_path, kind):
    table = chronos(1)
    (tmp_path / "src").mkdir()
    path = tmp_path / "src" / ("t.feather" if kind == "feather" else "t.arrow")
    if kind == "feather":
        feather.write_feather(table, path)
    else:
        with pa.OSFile(str(path), "wb") as sink:
            with (pa.ipc.new_file if kind == "file" else pa.ipc.new_stream)(sink, table.schema) as writer:
                writer.write_table(table, max_chunksize=7)
    m = sw.pack(str(tmp_path / "src"), str(tmp_path / "ds"), id_column="id", progress=False)
    # the timestamp list column is not numeric: left out; the target list is the one value column
    assert m.value_columns == ("target",) and m.left_out_columns == {"id": "id column", "timestamp": "not a list column"}
    assert_same(sequences(str(tmp_path / "ds")), want_of(table))
    (tmp_path / "src" / "bad.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(PackError, match="bad.arrow: not an Arrow IPC file or stream"):
        sw.pack(str(tmp_path / "src" / "bad.arrow"), str(tmp_path / "bad"), id_column="id", progress=False)


def test_hugging_face_datasets_give_the_sequences_of_their_files(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    table = chronos(2, n=60)
    pq.write_table(table, tmp_path / "c.parquet")
    want = want_of(table)
    ds = datasets.Dataset.from_parquet(str(tmp_path / "c.parquet"), cache_dir=str(tmp_path / "hf"))
    from streamwin.packing import sources

    monkeypatch.setattr(sources, "ROWS_BYTES", 8 << 10)  # several units of rows
    m = sw.pack(ds, str(tmp_path / "ds"), id_column="id", list_column="target", progress=False)
    assert len({s.name.split("-")[2] for s in m.shards}) > 3
    assert_same(sequences(str(tmp_path / "ds")), want)
    # in two worker processes: the same bytes
    sw.pack(ds, str(tmp_path / "ds2"), id_column="id", list_column="target", workers=2, progress=False)
    assert (tmp_path / "ds" / "index.json").read_bytes() == (tmp_path / "ds2" / "index.json").read_bytes()
    monkeypatch.setattr(sources, "ITERABLE_ROWS", 16)
    stream = datasets.Dataset.from_parquet(str(tmp_path / "c.parquet"), cache_dir=str(tmp_path / "hf")).to_iterable_dataset()
    sw.pack(stream, str(tmp_path / "it"), id_column="id", list_column="target", progress=False)
    assert_same(sequences(str(tmp_path / "it")), want)
    # without id_column: keys count rows across units
    sw.pack(ds.select_columns(["target"]), str(tmp_path / "noid"), progress=False)
    assert list(sequences(str(tmp_path / "noid"))) == [f"row_{i}" for i in range(60)]


def test_tables_and_dataframes_in_memory(tmp_path):
    pd = pytest.importorskip("pandas")
    table = chronos(3, n=10)
    sw.pack(table, str(tmp_path / "arrow"), id_column="id", list_column="target", progress=False)
    assert_same(sequences(str(tmp_path / "arrow")), want_of(table))
    long = pd.DataFrame({"series": ["b", "a", "b", "a"], "t": [1, 0, 0, 1], "v": [2.0, 3.0, 1.0, 4.0]})
    sw.pack(long, str(tmp_path / "pandas"), id_column="series", order_column="t", progress=False)
    assert_same(sequences(str(tmp_path / "pandas")), {"b": np.array([1.0, 2.0]), "a": np.array([3.0, 4.0])})
    with pytest.raises(PackError, match=r"unknown option\(s\) \['field'\] for format 'table'"):
        sw.pack(long, str(tmp_path / "x"), field="v", progress=False)
    with pytest.raises(PackError, match="engine must be None, 'ray' or 'dask', got 'spark'"):
        sw.pack(long, str(tmp_path / "x"), engine="spark", id_column="series", progress=False)


def test_variates_first_rows_become_steps_by_features(tmp_path):
    rng = np.random.default_rng(6)
    arrays = [rng.normal(size=(3, int(t))).astype(np.float32) for t in rng.integers(1, 50, size=12)]  # [F][T]
    table = pa.table({"item_id": [f"i{k}" for k in range(12)], "target": [a.tolist() for a in arrays]})
    pq.write_table(table, tmp_path / "lotsa.parquet")
    m = sw.pack(str(tmp_path / "lotsa.parquet"), str(tmp_path / "ds"), id_column="item_id", variates_first=True,
                progress=False)
    assert m.step_shape == (3,)
    got = sequences(str(tmp_path / "ds"))
    assert_same(got, {f"i{k}": np.ascontiguousarray(a.T).astype(np.float64) for k, a in enumerate(arrays)})
    # steps first (the default) reads each inner list as one step: these rows' steps differ in width
    with pytest.raises(PackError, match="inner lists must all have one length"):
        sw.pack(str(tmp_path / "lotsa.parquet"), str(tmp_path / "plain"), id_column="item_id", progress=False)
    ragged = pa.table({"item_id": ["x"], "target": [[[1.0, 2.0], [3.0]]]})
    pq.write_table(ragged, tmp_path / "ragged.parquet")
    with pytest.raises(PackError, match=r"ragged.parquet, column 'target', row 0: its variates have different lengths"):
        sw.pack(str(tmp_path / "ragged.parquet"), str(tmp_path / "r"), id_column="item_id", variates_first=True,
                progress=False)


def test_fsspec_urls_and_globs_work_where_paths_do(tmp_path):
    fs = fsspec.filesystem("memory")
    table = chronos(7, n=12)
    for f, part in enumerate((table.slice(0, 5), table.slice(5))):
        with fs.open(f"/corpus/train-{f}.parquet", "wb") as out:
            pq.write_table(part, out)
    fs.pipe("/corpus/README.md", b"not data")
    sw.pack("memory://corpus/train-*.parquet", str(tmp_path / "glob"), id_column="id", list_column="target",
            progress=False)
    assert_same(sequences(str(tmp_path / "glob")), want_of(table))
    with pytest.raises(PackError, match="no file matches memory://corpus/test-"):
        sw.pack("memory://corpus/test-*.parquet", str(tmp_path / "none"), id_column="id", progress=False)
    hf = fsspec.core.url_to_fs("hf://datasets/autogluon/chronos_datasets")[0]  # hf:// resolves (no network used)
    assert type(hf).__name__ == "HfFileSystem"


def test_the_readme_chronos_corpus_packs_end_to_end(tmp_path):
    """docs/packing.md, "Packing a corpus on a cluster": its first python block runs as pasted (Dask, a LocalCluster)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    page = (repo / "docs" / "packing.md").read_text()
    section = page.split("## Packing a corpus on a cluster", 1)[1]
    block = re.search(r"^```python\n(.*?)^```", section, flags=re.M | re.S).group(1)
    (tmp_path / "chronos.py").write_text(block)
    r = subprocess.run([sys.executable, "chronos.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=dict(__import__("os").environ, PYTHONPATH=str(repo)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"^1000 series, [\d,]+ steps, \d+ shards, columns \('target',\)$", r.stdout, flags=re.M), r.stdout
    m = sw.load_manifest(str(tmp_path / "data" / "chronos"))
    assert len({s.name.split("-")[2] for s in m.shards}) == 4  # a unit per file


def test_import_streamwin_imports_no_engine():
    """Ray, Dask and datasets are optional extras: only a pack that asks for one imports it."""
    import subprocess
    import sys

    code = ("import sys, streamwin; print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'ray', 'dask', 'distributed', 'datasets', 'pandas'}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
