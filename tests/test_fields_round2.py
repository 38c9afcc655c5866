"""Per-sequence fields that refuse what they cannot mean: durations of every unit, timestamps out of range, one rule
for missing values in every input format, and ``where=`` values checked strictly against the field.

References are computed here from the values packed (numpy's own unit arithmetic, the meta dicts), never
from streamwin's columns.
"""
from __future__ import annotations

import datetime as dt
import json
import sys
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streamwin as sw
from streamwin.errors import PackError
from streamwin.packing.pack import MissingValuesWarning

UNITS = ["ns", "us", "ms", "s", "m", "h", "D", "W"]


def batch_fields(url, names):
    """key -> {field: value} of every window the loader yields (each sequence's value, once per window)."""
    ds = sw.WindowDataset(url, window=2, batch_size=2, select=sw.Select(fields=names))
    out = {}
    for b in sw.WindowLoader(ds, num_workers=0):
        for i, key in enumerate(b["key"]):
            out.setdefault(key, {n: b[n][i].item() for n in names})
    return out


def members_json(url) -> dict[str, dict]:
    """The ``<key>.json`` members of a dataset's shards, as JSON holds them."""
    out = {}
    for shard in Path(url).glob("*.tar"):
        with tarfile.open(shard) as tf:
            for m in tf.getmembers():
                if m.name.endswith(".json"):
                    out[m.name[:-5]] = json.loads(tf.extractfile(m).read())
    return out


# -- durations: every unit is a duration, read back as the same one ----------------------------------------

@pytest.mark.parametrize("unit", UNITS + ["timedelta", "pandas"])
def test_a_duration_of_any_unit_packs_as_a_duration_and_reads_back_the_same(tmp_path, unit):
    def value(i):
        if unit == "timedelta":
            return dt.timedelta(hours=i, microseconds=7 * i)
        if unit == "pandas":
            return pd.Timedelta(hours=i, nanoseconds=3 * i)
        return np.timedelta64(5 * i + 1, unit)

    items = [(f"d{i}", np.arange(6, dtype=np.float32), {"gap": value(i)}) for i in range(5)]
    url = str(tmp_path / "d")
    m = sw.pack(items, url, progress=False)
    assert m.fields.kinds == {"gap": "duration"}
    want = {k: pd.Timedelta(meta["gap"]).value for k, _, meta in items}  # pandas' own ns
    assert {k: v["gap"] for k, v in batch_fields(url, ["gap"]).items()} == want
    for k, v in batch_fields(url, ["gap"]).items():  # the same duration, in numpy's own terms
        assert pd.Timedelta(np.timedelta64(v["gap"], "ns")) == pd.Timedelta(dict((a, c) for a, _, c in items)[k]["gap"])
    assert {k: j["gap"] for k, j in members_json(url).items()} == want  # the .json members: ns


def test_calendar_durations_and_fractions_of_a_ns_are_left_out_saying_why(tmp_path):
    items = [(f"c{i}", np.ones(4, np.float32), {"months": np.timedelta64(i + 1, "M"), "years": np.timedelta64(1, "Y"),
                                                "tiny": np.timedelta64(1500 + i, "ps"), "whole": np.timedelta64(2000, "ps")})
             for i in range(3)]
    m = sw.pack(items, str(tmp_path / "c"), progress=False)
    assert m.fields.kinds == {"whole": "duration"} and m.fields.columns["whole"].tolist() == [2, 2, 2]
    assert "calendar unit" in m.fields.left_out["months"] and "calendar unit" in m.fields.left_out["years"]
    assert "not a whole number of ns" in m.fields.left_out["tiny"] and "'c0'" in m.fields.left_out["tiny"]


# -- timestamps out of what int64 ns hold: left out, naming the sequence, never wrapped ------------------------

@pytest.mark.parametrize("value", [dt.datetime(3000, 1, 1), np.datetime64("3000-01-01"), dt.date(1500, 5, 5),
                                   np.datetime64("2262-04-12", "D"), pd.Timestamp("2262-04-11").to_pydatetime()
                                   + dt.timedelta(days=1)])
def test_a_timestamp_out_of_range_is_left_out_naming_the_sequence(tmp_path, value):
    items = [("early", np.ones(4, np.float32), {"t": dt.datetime(2000, 1, 1), "label": 0}),
             ("late", np.ones(4, np.float32), {"t": value, "label": 1})]
    url = str(tmp_path / "t")
    m = sw.pack(items, url, progress=False)  # before: OverflowError, or (numpy) a day of 1830 stored silently
    assert m.fields.kinds == {"label": "int"}
    assert "outside what int64 ns hold" in m.fields.left_out["t"] and "'late'" in m.fields.left_out["t"]
    with pytest.raises(ValueError, match=r"no field 't' \(it was left out when packing: .*outside .*'late'"):
        sw.WindowDataset(url, window=2, select=sw.Select(fields=["t"]))
    assert members_json(url)["late"]["t"].startswith(("3000", "1500", "2262"))  # the .json member keeps the date


def test_a_table_timestamp_out_of_range_is_left_out_not_wrapped(tmp_path):
    far = np.array(["2021-01-01", "3000-01-01"], dtype="datetime64[us]")
    pq.write_table(pa.table({"id": ["a", "a", "b"], "v": [1.0, 2.0, 3.0], "born": pa.array(far[[0, 0, 1]])}),
                   tmp_path / "x.parquet")
    m = sw.pack(str(tmp_path / "x.parquet"), str(tmp_path / "x"), id_column="id", value_columns=["v"],
                meta_columns=["born"], progress=False)
    assert m.fields is None or "born" not in m.fields.kinds
    assert "outside what int64 ns hold" in m.fields.left_out["born"] and "'b'" in m.fields.left_out["born"]
    steps = np.array(["2261-12-31T23:00", "2262-05-01T00:00", "2262-05-01T01:00"], dtype="datetime64[us]")
    pq.write_table(pa.table({"id": ["a", "b", "b"], "t": pa.array(steps), "v": [1.0, 2.0, 3.0]}), tmp_path / "y.parquet")
    m = sw.pack(str(tmp_path / "y.parquet"), str(tmp_path / "y"), id_column="id", order_column="t", progress=False)
    assert "outside what int64 ns hold" in m.fields.left_out["start"] and "'b'" in m.fields.left_out["start"]
    with pytest.raises(PackError, match="order column 't' of id 'b': 2262-05-01"):
        sw.pack(str(tmp_path / "y.parquet"), str(tmp_path / "y2"), id_column="id", order_column="t",
                regular_order=True, progress=False)


# -- missing values: one rule for every input format ---------------------------------------------------------

LABELS = {"s0": 0, "s1": 1, "s2": None, "s3": 1}  # s2 has none
SITES = {"s0": "kobe", "s1": None, "s2": "nara", "s3": "kobe"}  # s1 has none
SCORES = {"s0": 0.5, "s1": 1.5, "s2": 2.5, "s3": 3.5}  # every sequence has one: stored


def _write(fmt: str, root: Path) -> tuple[str, dict]:
    """The same four sequences with the same missing values, in format ``fmt``: (input, pack options)."""
    keys = list(LABELS)
    if fmt in ("csv", "csv_stdlib"):
        lines = ["id,t,v,label,site,score"] + [f"{k},{t},{t * 0.5},{'' if LABELS[k] is None else LABELS[k]},"
                                               f"{SITES[k] or ''},{SCORES[k]}" for k in keys for t in range(5)]
        (root / "x.csv").write_text("\n".join(lines) + "\n")
        return str(root / "x.csv"), dict(id_column="id", order_column="t", value_columns=["v"],
                                         meta_columns=["label", "site", "score"])
    if fmt in ("parquet", "parquet_rows"):
        rows = fmt == "parquet_rows"
        reps = 1 if rows else 5
        table = {"id": [k for k in keys for _ in range(reps)],
                 "v": [[0.5 * t for t in range(5)] for _ in keys] if rows else [0.5 * t for _ in keys for t in range(5)],
                 "label": pa.array([LABELS[k] for k in keys for _ in range(reps)], pa.int64()),
                 "site": pa.array([SITES[k] for k in keys for _ in range(reps)], pa.string()),
                 "score": [SCORES[k] for k in keys for _ in range(reps)]}
        pq.write_table(pa.table(table), root / "x.parquet")
        return str(root / "x.parquet"), dict(id_column="id", meta_columns=["label", "site", "score"],
                                             **({} if rows else dict(value_columns=["v"])))
    if fmt == "jsonl":
        docs = []
        for k in keys:
            doc = {"id": k, "tokens": [1, 2, 3, 4, 5], "label": LABELS[k], "score": SCORES[k]}
            if SITES[k] is not None:  # a key it lacks, where the label is a null
                doc["site"] = SITES[k]
            docs.append(json.dumps(doc))
        (root / "x.jsonl").write_text("\n".join(docs) + "\n")
        return str(root / "x.jsonl"), {}
    if fmt == "dataframe":
        return pd.DataFrame({"id": [k for k in keys for _ in range(5)], "v": [0.5 * t for _ in keys for t in range(5)],
                             "label": [LABELS[k] for k in keys for _ in range(5)],
                             "site": [SITES[k] for k in keys for _ in range(5)],
                             "score": [SCORES[k] for k in keys for _ in range(5)]}), \
            dict(id_column="id", value_columns=["v"], meta_columns=["label", "site", "score"])
    nan = float("nan")  # the API: None, NaN and a key the meta dict lacks are all missing
    return [(k, np.arange(5, dtype=np.float32),
             {"label": nan if LABELS[k] is None else LABELS[k], "score": SCORES[k],
              **({"site": SITES[k]} if SITES[k] else {})} | ({"site": None} if k == "s1" else {})) for k in keys], {}


@pytest.mark.parametrize("fmt", ["api", "csv", "csv_stdlib", "parquet", "parquet_rows", "jsonl", "dataframe"])
def test_a_missing_value_is_the_same_in_every_input_format(tmp_path, monkeypatch, fmt):
    if fmt == "csv_stdlib":
        monkeypatch.setitem(sys.modules, "pyarrow.csv", None)
    source, opts = _write(fmt, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = sw.pack(source, str(tmp_path / "out"), progress=False, **opts)
    f = m.fields
    assert f.kinds.get("score") == "float" and "label" not in f.kinds and "site" not in f.kinds  # before: '' a class
    assert f.left_out["label"] == "missing in sequence 's2'" and f.left_out["site"] == "missing in sequence 's1'"
    said = [str(w.message) for w in caught if issubclass(w.category, MissingValuesWarning)]
    assert len(said) == 1 and "'label' in 1 of 4 (the first 's2')" in said[0] and \
        "'site' in 1 of 4 (the first 's1')" in said[0], said
    got = batch_fields(str(tmp_path / "out"), ["score"])
    assert {k: v["score"] for k, v in got.items()} == SCORES


def test_missing_values_are_counted_over_units_and_workers(tmp_path):
    root = tmp_path / "in"
    root.mkdir()
    for u in range(3):  # unit 1 has no 'site' at all; unit 2 a null label in one of its sequences
        docs = [{"id": f"u{u}k{i}", "tokens": [1, 2, 3], "label": None if (u, i) == (2, 1) else i,
                 **({} if u == 1 else {"site": "ab"[i % 2]})} for i in range(4)]
        (root / f"p{u}.jsonl").write_text("\n".join(map(json.dumps, docs)) + "\n")
    for workers in (1, 2):
        with pytest.warns(MissingValuesWarning) as caught:
            m = sw.pack(str(root), str(tmp_path / f"w{workers}"), workers=workers, progress=False)
        text = str(caught[0].message)
        assert "'label' in 1 of 12 (the first 'u2k1')" in text and "'site' in 4 of 12 (the first 'u1k0')" in text
        assert m.fields.kinds == {} and set(m.fields.left_out) == {"label", "site"}


def test_a_field_every_sequence_has_packs_without_a_warning(tmp_path):
    items = [(f"k{i}", np.ones(3, np.float32), {"label": i, "site": "", "t": np.datetime64("2020-01-01")})
             for i in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", MissingValuesWarning)
        m = sw.pack(items, str(tmp_path / "ok"), progress=False)
    assert m.fields.kinds == {"label": "int", "site": "str", "t": "time"}
    assert m.fields.vocabulary["site"] == ("",)  # an empty string the caller gave is a value: only CSV cells are not


# -- where=: strict values, named when they match nothing, an empty selection said to be one ---------------------

@pytest.fixture(scope="module")
def selectable(tmp_path_factory):
    """12 sequences: label i % 3 (int), ok (bool), site (str, kobe where label 0, else nara or osaka), w (float),
    t (time), gap (duration); and a second source with labels 5 and 6 only."""
    root = tmp_path_factory.mktemp("where")
    metas = {}
    for i in range(12):
        metas[f"k{i}"] = {"label": i % 3, "ok": bool(i % 2), "site": "kobe" if i % 3 == 0 else ["nara", "osaka"][i % 2],
                          "w": i * 0.5, "t": np.datetime64("2020-01-01") + np.timedelta64(i, "D"),
                          "gap": np.timedelta64(i % 2 + 1, "h")}
    sw.pack([(k, np.arange(30, dtype=np.float32), m) for k, m in metas.items()], str(root / "a"), progress=False)
    other = {f"o{i}": {"label": 5 + i % 2, "ok": True, "site": "nara", "w": 1.0, "t": np.datetime64("2021-01-01"),
                       "gap": np.timedelta64(1, "h")} for i in range(4)}
    sw.pack([(k, np.arange(30, dtype=np.float32), m) for k, m in other.items()], str(root / "b"), progress=False)
    return str(root / "a"), metas, str(root / "b"), other


def kept_keys(url, where) -> set[str]:
    ds = sw.WindowDataset(url, window=30, batch_size=1, seed=0, select=sw.Select(where=where))
    return {k for b in sw.WindowLoader(ds, num_workers=0) for k in b["key"]}


@pytest.mark.parametrize("field, value, kind", [
    ("label", 1.5, "int"), ("label", 0.999, "int"), ("label", 1.0, "int"), ("label", "1", "int"),
    ("label", "01", "int"), ("label", " 1", "int"), ("label", "1.0", "int"), ("label", "yes", "int"),
    ("label", True, "int"), ("ok", 0.5, "bool"), ("ok", 1, "bool"), ("ok", "yes", "bool"), ("site", 1, "str"),
    ("w", "0.5", "float"), ("w", True, "float"), ("t", "2020-01-02", "time"), ("t", 5, "time"),
    ("gap", 3600 * 10**9, "duration"), ("gap", np.datetime64("2020-01-01"), "duration"),
    ("label", np.timedelta64(1, "ns"), "int")])
def test_where_refuses_a_value_of_another_type_naming_the_field(selectable, field, value, kind):
    url, *_ = selectable
    with pytest.raises(TypeError) as e:  # before: 1.5 kept label 1, 0.5 the False ones, "yes" a bare int() error
        sw.WindowDataset(url, window=4, select=sw.Select(where={field: [value]}))
    text = str(e.value)
    assert f"where[{field!r}] holds {value!r}" in text and f"field {field!r} is {kind}" in text, text
    assert "nothing is converted" in text


def test_where_takes_python_and_numpy_values_of_the_fields_kind(selectable):
    url, metas, *_ = selectable
    want = {k for k, m in metas.items() if m["label"] == 1}
    for value in (1, np.int64(1), np.int32(1), np.uint8(1)):
        assert kept_keys(url, {"label": [value]}) == want
    assert kept_keys(url, {"ok": [np.bool_(True)]}) == {k for k, m in metas.items() if m["ok"]}
    assert kept_keys(url, {"w": [1, 2.5]}) == {k for k, m in metas.items() if m["w"] in (1.0, 2.5)}  # ints: floats
    day = np.datetime64("2020-01-04")
    for value in (day, pd.Timestamp("2020-01-04"), dt.date(2020, 1, 4), dt.datetime(2020, 1, 4)):
        assert kept_keys(url, {"t": [value]}) == {k for k, m in metas.items() if m["t"] == day}
    for value in (np.timedelta64(2, "h"), np.timedelta64(120, "m"), dt.timedelta(hours=2), pd.Timedelta("2h")):
        assert kept_keys(url, {"gap": [value]}) == {k for k, m in metas.items() if m["gap"] == np.timedelta64(2, "h")}


def test_where_names_the_values_no_sequence_holds(selectable):
    url, *_ = selectable
    with pytest.raises(ValueError, match=r"where\['site'\]: no sequence holds 'kobee' \(field 'site' is str; its "
                                         r"strings: 'kobe', 'nara', 'osaka'; did you mean 'kobe'\?\)"):
        sw.WindowDataset(url, window=4,
                         select=sw.Select(where={"site": ["kobe", "kobee"]}))  # before: kept the kobe ones silently
    with pytest.raises(ValueError, match=r"where\['label'\]: no sequence holds 7, 9 \(field 'label' is int; its "
                                         r"values: 0, 1, 2\)"):
        sw.WindowDataset(url, window=4, select=sw.Select(where={"label": [1, 7, 9]}))
    with pytest.raises(ValueError, match=r"no sequence holds np.datetime64\('2030-01-01'\) .*its values: "
                                         r"2020-01-01T00:00:00.000000000, "):
        sw.WindowDataset(url, window=4, select=sw.Select(where={"t": [np.datetime64("2030-01-01")]}))


def test_an_empty_selection_says_it_is_the_selection_not_the_window(selectable):
    url, metas, url_b, _ = selectable
    with pytest.raises(ValueError) as e:  # each value is held, but never both: label 0 is always kobe
        sw.WindowDataset(url, window=4, select=sw.Select(where={"label": [0], "site": ["nara"]}))
    text = str(e.value)
    assert "keeps no sequence of" in text and "label in [0]: 4 of its 12 sequences" in text
    assert "site in ['nara']: 4 of its 12 sequences, none in all of them" in text and "the selection is empty" in text
    with pytest.raises(ValueError, match=f"keeps no sequence of {url_b}: label in \\[1\\]: 0 of its 4 sequences"):
        sw.WindowDataset([url, url_b], window=4,
                         select=sw.Select(where={"label": [1]}))  # held in the first source only
    both = sw.WindowDataset([url, url_b], window=30, batch_size=1, select=sw.Select(where={"label": [1, 5]}))
    keys = {k for b in sw.WindowLoader(both, num_workers=0) for k in b["key"]}
    assert keys <= {k for k, m in metas.items() if m["label"] == 1} | {"o0", "o2"}  # (a few windows dropped)
    assert any(k.startswith("o") for k in keys) and any(k.startswith("k") for k in keys)


def test_a_field_time_needs_start_and_freq_said_in_one_sentence(tmp_path):
    url = str(tmp_path / "m1_nofreq")
    sw.pack([("a", np.ones(8, np.float32))], url, progress=False)
    with pytest.raises(ValueError) as e:
        sw.WindowDataset(url, window=2, select=sw.Select(fields=["time"]))
    assert str(e.value) == ("select=sw.Select(fields=['time']): fields: 'time' (each window's start + offset x freq) "
                            f"needs the fields 'start' and 'freq', and {url} has no field 'start' (its fields are "
                            "none)")  # before: "has 'time' needs"


def test_where_and_fill_on_a_source_without_the_field(selectable, tmp_path):
    """A source without the field takes its fill, as stored: a NaN fill of a float field, a timestamp fill matched
    by a timestamp in where=."""
    url, metas, *_ = selectable
    bare = str(tmp_path / "bare")
    sw.pack([(f"n{i}", np.arange(30, dtype=np.float32)) for i in range(3)], bare, progress=False)
    ds = sw.WindowDataset([url, bare], window=30, batch_size=1,
                          select=sw.Select(fields=["w"], fill={"w": float("nan")}))
    got = {k: float(w) for b in sw.WindowLoader(ds, num_workers=0) for k, w in zip(b["key"], b["w"])}
    assert all(np.isnan(w) for k, w in got.items() if k.startswith("n")) and any(k.startswith("n") for k in got)
    assert all(w == metas[k]["w"] for k, w in got.items() if k.startswith("k"))
    day = dt.datetime(2020, 1, 4)
    ds = sw.WindowDataset([url, bare], window=30, batch_size=1,
                          select=sw.Select(fields=["t"], fill={"t": day}, where={"t": [day]}))
    keys = {k for b in sw.WindowLoader(ds, num_workers=0) for k in b["key"]}
    assert {k for k in keys if k.startswith("k")} <= {"k3"} and {k for k in keys if k.startswith("n")}
