"""inputs: every format yields the sequences an independent reading of the input expects,
in a deterministic order, from picklable units; bad input is a PackError naming the file."""
from __future__ import annotations

import gzip
import json
import pickle
import sys

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamwin.errors import PackError
from streamwin.packing.inputs import (FORMATS, INPUT_OPTIONS, Batch, InputUnit, detect_format, format_of, list_units,
                                     read_batches, read_unit)


def read_all(source, **kw) -> list[tuple[str, np.ndarray, dict | None]]:
    return [item for unit in list_units(source, **kw) for item in read_unit(unit)]


def assert_items(got, expected) -> None:
    """Same keys in the same order, arrays equal in shape, dtype and values, same meta."""
    assert [k for k, _, _ in got] == [k for k, _, _ in expected]
    for (key, arr, meta), (_, want, want_meta) in zip(got, expected):
        assert arr.shape == want.shape and arr.dtype == want.dtype, key
        np.testing.assert_array_equal(arr, want, err_msg=key)
        assert meta == want_meta, key


def assert_deterministic_and_picklable(source, **kw) -> None:
    units = list_units(source, **kw)
    assert units == list_units(source, **kw)
    assert pickle.loads(pickle.dumps(units)) == units
    first = [(k, a.tobytes(), m) for u in units for k, a, m in read_unit(u)]
    again = [(k, a.tobytes(), m) for u in pickle.loads(pickle.dumps(units)) for k, a, m in read_unit(u)]
    assert first == again


# ---- npy -------------------------------------------------------------------------------------

@pytest.fixture
def npy_dir(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"b.npy": rng.normal(size=(5, 3)).astype(np.float32), "a.npy": np.arange(7, dtype=np.int64),
              "sub/c.v2.npy": rng.integers(0, 9, size=(4, 2, 2)).astype(np.uint16)}
    for rel, arr in arrays.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        np.save(tmp_path / rel, arr)
    (tmp_path / ".hidden.npy").write_bytes(b"junk")  # hidden files are skipped
    (tmp_path / "README.md").write_text("not data")  # other suffixes are skipped
    return tmp_path, arrays


def test_npy_directory(npy_dir):
    root, arrays = npy_dir
    expected = [("a", arrays["a.npy"], None), ("b", arrays["b.npy"], None),
                ("sub__c_v2", arrays["sub/c.v2.npy"], None)]
    assert detect_format(root) == "npy"
    assert_items(read_all(root), expected)
    assert [u.name for u in list_units(root)] == ["a.npy", "b.npy", "sub/c.v2.npy"]
    assert_deterministic_and_picklable(root)


def test_npy_headers_are_parsed_once_per_distinct_header(tmp_path, monkeypatch):
    """Many .npy files of one dtype and shape: the header is parsed once, the arrays are numpy's."""
    from streamwin.formats import npy as npyfmt
    from streamwin.packing.inputs import npy as npy_inputs

    npy_inputs.plain_npy_cached.cache_clear()
    calls = []
    parse = npyfmt.parse_npy_header
    monkeypatch.setattr(npyfmt, "parse_npy_header", lambda head: calls.append(head) or parse(head))
    arrays = {f"s{i}": np.arange(i, i + 6, dtype=np.float32).reshape(3, 2) for i in range(5)}
    arrays["t"] = np.arange(4, dtype=">i4")  # big-endian: numpy's own reader
    for key, arr in arrays.items():
        np.save(tmp_path / f"{key}.npy", arr)
    assert_items(read_all(tmp_path), [(k, a, None) for k, a in arrays.items()])
    assert len(calls) == 2


def test_npy_single_file_and_list(npy_dir):
    root, arrays = npy_dir
    assert_items(read_all(root / "b.npy"), [("b", arrays["b.npy"], None)])
    # a list keeps its order; names are relative to the deepest folder holding all entries
    got = read_all([str(root / "sub"), str(root / "a.npy")])
    assert_items(got, [("sub__c_v2", arrays["sub/c.v2.npy"], None), ("a", arrays["a.npy"], None)])


def test_npy_refuses_object_and_string_arrays(tmp_path):
    np.save(tmp_path / "obj.npy", np.array([{"x": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(PackError, match="obj.npy") as info:
        read_all(tmp_path)
    assert info.value.__cause__ is not None
    (tmp_path / "obj.npy").unlink()
    np.save(tmp_path / "str.npy", np.array(["a", "b"]))
    with pytest.raises(PackError, match=r"str\.npy.*not numeric"):
        read_all(tmp_path)


def test_npy_from_memory_filesystem():
    fs = fsspec.filesystem("memory")
    arrays = {"z.npy": np.arange(3, dtype=np.int16), "d/y.npy": np.ones((2, 4), dtype=np.float64)}
    for rel, arr in arrays.items():
        with fs.open(f"/swtest/{rel}", "wb") as f:
            np.save(f, arr)
    try:
        expected = [("d__y", arrays["d/y.npy"], None), ("z", arrays["z.npy"], None)]
        assert_items(read_all("memory://swtest"), expected)
        assert all(u.path.startswith("memory://") for u in list_units("memory://swtest"))
        assert_deterministic_and_picklable("memory://swtest")
    finally:
        fs.rm("/swtest", recursive=True)


# ---- npz -------------------------------------------------------------------------------------

def test_npz_file_and_directory(tmp_path):
    a, b = np.arange(4, dtype=np.int32), np.zeros((3, 2), dtype=np.float32)
    np.savez(tmp_path / "x.npz", second=a, first=b)
    (tmp_path / "d").mkdir()
    np.savez(tmp_path / "d" / "y.z.npz", **{"w.1": a})
    # a single file: bare array names, in the order saved
    assert_items(read_all(tmp_path / "x.npz"), [("second", a, None), ("first", b, None)])
    expected = [("d__y_z__w_1", a, None), ("x__second", a, None), ("x__first", b, None)]
    assert_items(read_all(tmp_path), expected)
    assert len(list_units(tmp_path)) == 2
    assert_deterministic_and_picklable(tmp_path)


def test_npz_refuses_object_array_naming_it(tmp_path):
    np.savez(tmp_path / "bad.npz", ok=np.arange(2), bad=np.array([None, 1], dtype=object))
    with pytest.raises(PackError, match=r"bad\.npz, array 'bad'"):
        read_all(tmp_path / "bad.npz")


def npz_reference(path) -> list[tuple[str, np.ndarray, None]]:
    """What numpy itself reads from an .npz, array by array, in archive order."""
    with np.load(path, allow_pickle=False) as npz:
        return [(name, npz[name], None) for name in npz.files]


def test_stored_npz_is_read_in_batches_equal_to_numpy(tmp_path, monkeypatch):
    """np.savez members are read as runs of one dtype and step shape, with no zipfile read per member;
    the arrays are numpy's, whatever their lengths (empty ones too), dtypes and shapes."""
    from streamwin.packing.inputs import npy as npy_inputs

    rng = np.random.default_rng(3)
    arrays = {f"s{i:03d}": rng.normal(size=int(rng.integers(0, 40))).astype(np.float32) for i in range(50)}
    arrays |= {"i8": np.arange(5, dtype=np.int64), "m0": np.ones((3, 2), np.uint8), "m1": np.zeros((0, 2), np.uint8),
               "m2": np.arange(8, dtype=np.uint8).reshape(4, 2), "x.y": np.arange(3, dtype=np.float16)}
    np.savez(tmp_path / "a.npz", **arrays)
    unit, = list_units(tmp_path / "a.npz")
    got = list(read_batches(unit))
    assert all(isinstance(g, Batch) for g in got)
    assert [len(g) for g in got] == [50, 1, 3, 1]  # runs of one dtype and step shape, in archive order
    items = [item for g in got for item in g.items()]
    expected = [(k.replace(".", "_"), a, m) for k, a, m in npz_reference(tmp_path / "a.npz")]
    assert_items(items, expected)
    monkeypatch.setattr(npy_inputs, "NPZ_READ_WHOLE", 1000)  # a larger archive is read member by member
    got = list(read_batches(unit))
    assert not any(isinstance(g, Batch) for g in got)
    assert_items(got, expected)


@pytest.mark.parametrize("names", [["a", "b.c", "d"], ["x", "PK\x01\x02y", "z"], [f"s{i}" for i in range(300)]])
def test_zip_directory_read_with_numpy_matches_zipfile(tmp_path, names):
    """The central directory read with numpy (or entry by entry, when a name holds the entry
    signature's bytes) gives zipfile's members and fields."""
    import zipfile

    from streamwin.packing.inputs import zipdir
    from streamwin.packing.inputs.base import text_key

    path = tmp_path / "a.npz"
    np.savez(path, **{n: np.arange(i % 7, dtype=np.int16) for i, n in enumerate(names)})
    with zipfile.ZipFile(path, "a") as z:
        z.comment = b"a comment"
    data = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        want = [(i.filename, i.flag_bits, i.compress_type, i.CRC, i.file_size, i.compress_size, i.header_offset)
                for i in z.infolist()]
    got_names, cols = zipdir.zip_members(data)
    assert [(n, *row) for n, row in zip(got_names, cols.tolist())] == want
    assert (zipdir.read_directory(data, *_directory_span(data)) is None) == any("PK" in n for n in names)
    unit, = list_units(path)
    assert_items(list(read_unit(unit)), [(text_key(k), a, m) for k, a, m in npz_reference(path)])


def _directory_span(data: bytes) -> tuple[int, int, int]:
    """(start, end, count) of a zip's central directory, read from its end record."""
    import struct

    end = data.rfind(b"PK\x05\x06")
    _, _, _, _, count, _, start, _ = struct.unpack_from("<4s4H2LH", data, end)
    return start, end, count


@pytest.mark.parametrize("case", ["compressed", "big_endian", "fortran", "bad_crc", "not_npy", "scalar"])
def test_npz_the_fast_path_does_not_take_reads_as_numpy_does(tmp_path, case):
    """Members the batch reader cannot take (or a damaged archive) go through numpy's reader, item by item."""
    path = tmp_path / "a.npz"
    arrays = {"a": np.arange(6, dtype=np.float32), "b": np.arange(4, dtype=np.float32)}
    if case == "big_endian":
        arrays["b"] = arrays["b"].astype(">f4")
    if case == "fortran":
        arrays["b"] = np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    if case == "scalar":
        arrays["b"] = np.float32(3)
    (np.savez_compressed if case == "compressed" else np.savez)(path, **arrays)
    if case == "not_npy":
        import zipfile
        with zipfile.ZipFile(path, "a") as z:
            z.writestr("notes.txt", "hello")
    if case == "bad_crc":
        data = bytearray(path.read_bytes())
        at = data.index(np.arange(6, dtype=np.float32).tobytes())
        data[at + 5] ^= 1
        path.write_bytes(bytes(data))
    unit, = list_units(path)
    if case in ("bad_crc", "not_npy", "scalar"):
        with pytest.raises(PackError, match=r"a\.npz"):
            list(read_batches(unit))
        return
    got = list(read_batches(unit))
    assert not any(isinstance(g, Batch) for g in got)
    assert_items(got, npz_reference(path))


# ---- parquet ---------------------------------------------------------------------------------

def test_parquet_long_layout(tmp_path):
    table = pa.table({"sid": ["s2", "s1", "s2", "s1", "s2"], "t": [2, 1, 0, 0, 1],
                      "x": [2.0, 11.0, 0.0, 10.0, 1.0], "y": [20, 110, 0, 100, 10], "note": list("abcde")})
    pq.write_table(table, tmp_path / "long.parquet")
    got = read_all(tmp_path, id_column="sid", order_column="t")
    expected = [("s2", np.array([[0.0, 0], [1, 10], [2, 20]]), None),  # ids in order of first appearance
                ("s1", np.array([[10.0, 100], [11, 110]]), None)]
    assert_items(got, expected)
    # one value column squeezes to [T]; without order_column rows keep file order
    got = read_all(tmp_path, id_column="sid", value_columns=["y"])
    assert_items(got, [("s2", np.array([20, 0, 10]), None), ("s1", np.array([110, 100]), None)])
    got = read_all(tmp_path, id_column="sid", value_columns=["y"], squeeze=False)
    assert got[0][1].shape == (3, 1)
    assert_deterministic_and_picklable(tmp_path, id_column="sid", order_column="t")


def test_parquet_row_layout(tmp_path):
    tokens = [[1, 2, 3], [], [4]]
    pq.write_table(pa.table({"doc": ["a.1", "b", "c"], "tokens": tokens}), tmp_path / "p1.parquet")
    pq.write_table(pa.table({"feat": [[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0]]]}), tmp_path / "p2.pq")
    got = read_all(tmp_path / "p1.parquet", id_column="doc")
    assert_items(got, [(k, np.array(t, dtype=np.int64), None) for k, t in zip(["a_1", "b", "c"], tokens)])
    got = read_all(tmp_path / "p2.pq")  # list-typed column found without options; keys <file>_<row>
    assert_items(got, [("p2_0", np.array([[1.0, 2], [3, 4]]), None), ("p2_1", np.array([[5.0, 6]]), None)])
    for unit in list_units(tmp_path, list_column="tokens")[:1] + list_units(tmp_path / "p2.pq"):
        assert [type(g) for g in read_batches(unit)] == [Batch]  # every row at once, not row by row
    assert [u.name for u in list_units(tmp_path, list_column="tokens")] == ["p1.parquet", "p2.pq"]


def test_parquet_errors_name_the_file(tmp_path, monkeypatch):
    pq.write_table(pa.table({"sid": [1, 1], "name": ["x", "y"]}), tmp_path / "t.parquet")
    with pytest.raises(PackError, match=r"t\.parquet: no column 'id'"):
        read_all(tmp_path, id_column="id")
    with pytest.raises(PackError, match=r"t\.parquet: column 'name' is not numeric"):
        read_all(tmp_path, id_column="sid", value_columns=["name"])
    with pytest.raises(PackError, match=r"t\.parquet: long layout needs id_column"):
        read_all(tmp_path)
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(PackError, match=r"broken\.parquet") as info:
        read_all(tmp_path / "broken.parquet", id_column="sid")
    assert info.value.__cause__ is not None
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(PackError, match=r"pip install 'streamwin\[parquet\]'"):
        read_all(tmp_path, id_column="sid")


# ---- csv -------------------------------------------------------------------------------------

CSV = "id,step,v1,v2\nb,1,1.5,2\na,0,0.5,7\nb,0,1.0,3\n"
CSV_EXPECTED = [("b", np.array([[1.0, 3], [1.5, 2]]), None), ("a", np.array([[0.5, 7]]), None)]


@pytest.mark.parametrize("backend", ["pyarrow", "stdlib"])
def test_csv_long_layout(tmp_path, monkeypatch, backend):
    if backend == "stdlib":
        monkeypatch.setitem(sys.modules, "pyarrow.csv", None)
    (tmp_path / "one.csv").write_text(CSV)
    with gzip.open(tmp_path / "two.csv.gz", "wt") as f:
        f.write("id,step,v1,v2\n7,0,9.0,9\n")
    got = read_all(tmp_path, id_column="id", order_column="step", value_columns="*")
    assert_items(got, CSV_EXPECTED + [("7", np.array([[9.0, 9]]), None)])
    got = read_all(tmp_path / "one.csv", id_column="id", order_column="step", value_columns=["v2"])
    assert_items(got, [("b", np.array([3, 2]), None), ("a", np.array([7]), None)])
    assert_deterministic_and_picklable(tmp_path, id_column="id", order_column="step", value_columns=["v1", "v2"])
    # the order column named: the other numeric columns are the values, in file order
    assert_items(read_all(tmp_path / "one.csv", id_column="id", order_column="step"), CSV_EXPECTED)
    # several numeric columns and neither an order column nor values named: a CSV asks which are values
    with pytest.raises(PackError, match=r"one\.csv: id_column='id' leaves 3 numeric columns, 'step', 'v1', 'v2'.*"
                                        r"order_column="):
        read_all(tmp_path / "one.csv", id_column="id")
    # one left: no doubt, it is the values
    (tmp_path / "uni").mkdir()
    (tmp_path / "uni" / "u.csv").write_text("id,step,v\na,1,2.5\na,0,1.5\n")
    assert_items(read_all(tmp_path / "uni", id_column="id", order_column="step"), [("a", np.array([1.5, 2.5]), None)])


@pytest.mark.parametrize("backend", ["pyarrow", "stdlib"])
def test_value_columns_as_one_string_is_one_column(tmp_path, monkeypatch, backend):
    if backend == "stdlib":
        monkeypatch.setitem(sys.modules, "pyarrow.csv", None)
    (tmp_path / "one.csv").write_text(CSV)
    got = read_all(tmp_path / "one.csv", id_column="id", order_column="step", value_columns="v2")
    assert_items(got, [("b", np.array([3, 2]), None), ("a", np.array([7]), None)])
    pq.write_table(pa.table({"sid": ["s", "s"], "xy": [1.0, 2.0], "x": [5.0, 6.0]}), tmp_path / "p.parquet")
    got = read_all(tmp_path / "p.parquet", id_column="sid", value_columns="xy")
    assert_items(got, [("s", np.array([1.0, 2.0]), None)])


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_pyarrow_reads_memory_it_owns_not_a_python_file(tmp_path, monkeypatch, fmt):
    """A Python file (or bytes) handed to pyarrow's threaded readers is released on one of pyarrow's
    threads after the read returns; at interpreter exit that aborts the process (tests/test_cli.py,
    test_a_table_pack_that_fails_exits_cleanly). pyarrow must get memory it allocated itself."""
    module = pytest.importorskip("pyarrow.csv" if fmt == "csv" else "pyarrow.parquet")
    name = "read_csv" if fmt == "csv" else "read_table"
    given = []
    real = getattr(module, name)

    def spy(src, *args, **kwargs):
        # a reader over memory pyarrow allocated (mutable), not over a Python bytes object (immutable)
        given.append((type(src), src.read_buffer(1).parent.is_mutable if isinstance(src, pa.BufferReader) else None))
        src.seek(0)
        return real(src, *args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    if fmt == "csv":
        (tmp_path / "one.csv").write_text(CSV)
    else:
        pq.write_table(pa.table({"id": ["b", "a", "b"], "step": [1, 0, 0], "v1": [1.5, 0.5, 1.0], "v2": [2, 7, 3]}),
                       tmp_path / "one.parquet")
    assert_items(read_all(tmp_path, id_column="id", order_column="step", value_columns="*"), CSV_EXPECTED)
    assert given == [(pa.BufferReader, True)]


@pytest.mark.parametrize("backend", ["pyarrow", "stdlib"])
def test_csv_errors_name_the_file(tmp_path, monkeypatch, backend):
    if backend == "stdlib":
        monkeypatch.setitem(sys.modules, "pyarrow.csv", None)
    (tmp_path / "c.csv").write_text("id,step,label\na,0,x\n")
    with pytest.raises(PackError, match=r"c\.csv: no column 'seq'"):
        read_all(tmp_path, id_column="seq")
    with pytest.raises(PackError, match=r"c\.csv: column 'label' is not numeric"):
        read_all(tmp_path, id_column="id", value_columns=["step", "label"])
    (tmp_path / "c.csv").write_text("id,step\na,0\nb\n")
    with pytest.raises(PackError, match=r"c\.csv"):
        read_all(tmp_path, id_column="id")
    with pytest.raises(PackError, match="id_column"):
        list_units(tmp_path)


# ---- jsonl -----------------------------------------------------------------------------------

def test_jsonl(tmp_path):
    lines = [{"id": "doc.1", "tokens": [1, 2, 3], "lang": "en", "nested": {"x": 1}},
             {"id": 7, "tokens": [], "score": 0.5},
             {"id": "f", "tokens": [[0.5, 1], [2, 3]]}]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(o) for o in lines) + "\n\n")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"tokens": [2**40]}) + "\n" + json.dumps({"tokens": [5]}) + "\n")
    expected = [("doc_1", np.array([1, 2, 3], dtype=np.int32), {"lang": "en"}),
                ("7", np.array([], dtype=np.int32), {"score": 0.5}),
                ("f", np.array([[0.5, 1], [2, 3]], dtype=np.float32), None),
                ("b_1", np.array([2**40], dtype=np.int64), None),
                ("b_2", np.array([5], dtype=np.int64), None)]
    assert detect_format(tmp_path) == "jsonl"
    assert_items(read_all(tmp_path / "a.jsonl"), expected[:3])
    assert_items(read_all(tmp_path / "b.jsonl.gz", dtype="int64"), expected[3:])
    with pytest.raises(PackError, match=r"b\.jsonl\.gz, line 1, field 'tokens': values do not fit int32"):
        read_all(tmp_path)  # one default dtype for every line: int32 unless told otherwise
    got = read_all(tmp_path / "a.jsonl", key_field="id", meta_fields=["nested"])
    assert [m for _, _, m in got] == [{"nested": {"x": 1}}, None, None]
    assert_deterministic_and_picklable(tmp_path, dtype="float64")


@pytest.mark.parametrize("line, message", [
    ('{"tokens": [1, 2', r"line 2: invalid JSON"),
    ('{"text": "no tokens"}', r"line 2: expected a JSON object with field 'tokens'"),
    ('{"tokens": ["a", "b"]}', r"line 2, field 'tokens': expected a list of numbers"),
    ('{"tokens": [[1, 2], [3]]}', r"line 2, field 'tokens'"),
    ('{"tokens": [3000000000]}', r"line 2, field 'tokens': values do not fit int32"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, line, message):
    (tmp_path / "bad.jsonl").write_text('{"tokens": [1]}\n' + line + "\n")
    with pytest.raises(PackError, match=r"bad\.jsonl, " + message):
        read_all(tmp_path)


# ---- text ------------------------------------------------------------------------------------

def test_text_files(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "x.c").write_bytes(b"int x;\n")
    (tmp_path / "src" / "x.h").write_bytes("extern int x; // é\n".encode())
    (tmp_path / "empty.txt").write_bytes(b"")
    as_bytes = lambda p: np.frombuffer((tmp_path / p).read_bytes(), dtype=np.uint8)  # noqa: E731
    expected = [("empty_txt", as_bytes("empty.txt"), None), ("src__x_c", as_bytes("src/x.c"), None),
                ("src__x_h", as_bytes("src/x.h"), None)]
    assert_items(read_all(tmp_path, format="text"), expected)
    assert_items(read_all(tmp_path, format="text", suffixes=[".h"]), expected[2:])
    assert detect_format(tmp_path / "empty.txt") == "text"
    assert_deterministic_and_picklable(tmp_path, format="text")


# ---- iterable --------------------------------------------------------------------------------

def test_iterable():
    data = [("a", [1, 2, 3]), ("b", np.ones((2, 3), np.float16), {"split": "train"})]
    assert detect_format(data) == "iterable"
    units = list_units(data)
    assert len(units) == 1 and units[0].format == "iterable"
    expected = [("a", np.array([1, 2, 3]), None), ("b", np.ones((2, 3), np.float16), {"split": "train"})]
    assert_items(read_all(data), expected)
    assert_deterministic_and_picklable(data)
    assert_items(read_all(iter(data)), expected)  # any iterable, read once


@pytest.mark.parametrize("item, message", [
    (("a",), "item 1: expected"),
    (("bad key", [1]), "item 1: invalid sequence key"),
    (("a", ["x", "y"]), r"item 1 \(key 'a'\): dtype <U1 is not numeric"),
    (("a", np.array([object()])), "not numeric"),
    (("a", 5), "scalar"),
    (("a", [1], ["not a dict"]), "meta must be a dict"),
])
def test_iterable_errors(item, message):
    with pytest.raises(PackError, match=message):
        read_all([("ok", [1]), item])


# ---- listing, detection, options -------------------------------------------------------------

def test_every_format_and_option_is_listed():
    """The formats' modules declare them; units lists them all, and the options any of them accepts."""
    assert FORMATS == ("npy", "npz", "parquet", "arrow", "csv", "jsonl", "text", "iterable", "table")
    assert INPUT_OPTIONS == ("dtype", "field", "id_column", "key_field", "list_column", "meta_columns", "meta_fields",
                             "order_column", "regular_order", "squeeze", "suffixes", "value_columns", "variates_first")
    assert [format_of(u).name for u in list_units([("k", np.ones(2))])] == ["iterable"]


def test_unknown_options_and_formats(tmp_path, npy_dir):
    root, _ = npy_dir
    with pytest.raises(PackError, match=r"unknown option\(s\) \['field'\] for format 'npy'; accepted: none"):
        list_units(root, field="x")
    with pytest.raises(PackError, match=r"accepted: \['field', 'key_field', 'dtype', 'meta_fields'\]"):
        list_units(root, format="jsonl", id_column="x")
    with pytest.raises(PackError, match="input of type int is not a path, URL or iterable"):
        detect_format(42)
    with pytest.raises(PackError, match="unknown format"):
        list_units(root, format="hdf5")
    with pytest.raises(PackError, match="not a numpy dtype"):
        list_units(root, format="jsonl", dtype="nonsense")
    with pytest.raises(PackError, match="no such file"):
        list_units(root / "missing")
    with pytest.raises(PackError, match="no parquet files"):
        list_units(root, format="parquet")
    (root / "x.jsonl").write_text("{}\n")
    with pytest.raises(PackError, match="cannot tell the format"):
        detect_format(root)


def test_units_are_plain_values(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(3))
    (unit,) = list_units(tmp_path)
    assert unit == InputUnit("npy", str(tmp_path / "a.npy"), "a.npy", (), single=False, size=(tmp_path / "a.npy").stat().st_size)
    assert hash(unit) == hash(pickle.loads(pickle.dumps(unit)))
    (unit,) = list_units(tmp_path, format="text", suffixes=[".npy"])
    assert unit.options == (("suffixes", (".npy",)),)
    assert set(FORMATS) == {"npy", "npz", "parquet", "arrow", "csv", "jsonl", "text", "iterable", "table"}
