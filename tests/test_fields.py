"""Per-sequence fields (labels, covariates, timestamps) at pack time and in every batch; where=; transforms.

Every check compares with a reference computed here from the original arrays and meta dicts,
never with streamwin's own columns: each window's field value must be its sequence's meta
value (its ``time`` the sequence's start + the window's start x freq), whatever the batch kind
(plain windows, drawn crops, packed rows, a mix), the delivery (in-process, workers,
device="cpu") and the interruption (resume at every step, elastic 2 -> 3).
"""
from __future__ import annotations

import datetime as dt
import json
import os
import warnings

import numpy as np
import pandas as pd
import pytest

import streamwin as sw
from streamwin.errors import ManifestError, PackError

STORES = ["kobe", "osaka", "nara", "kyoto"]


def corpus(n=36, seed=0, stores=STORES, prefix="s"):
    """(items to pack, key -> meta, key -> array): unequal lengths, a label, a store, a weight, start and freq."""
    rng = np.random.default_rng(seed)
    items, meta, arrays = [], {}, {}
    for i in range(n):
        key = f"{prefix}{i}"
        arr = rng.normal(size=(20 + 9 * i,)).astype(np.float32)
        m = {"label": i % 4, "store": stores[i % len(stores)], "w": 0.25 * i, "ok": bool(i % 2),
             "start": np.datetime64("2021-03-01T00:00") + np.timedelta64(37 * i, "m"),
             "freq": dt.timedelta(minutes=15 if i % 3 else 60)}
        items.append((key, arr, m))
        meta[key], arrays[key] = m, arr
    return items, meta, arrays


def ns(value) -> int:
    return int(np.datetime64(value, "ns").astype(np.int64))


def expected_time(m, start) -> int:
    return ns(m["start"]) + start * int(m["freq"].total_seconds() * 1e9)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("fields")
    items, meta, arrays = corpus()
    url = str(root / "a")
    sw.pack(items, url, progress=False, shard_bytes=6000)
    items_b, meta_b, arrays_b = corpus(12, seed=1, stores=["nara", "sapporo"], prefix="b")
    url_b = str(root / "b")
    sw.pack(items_b, url_b, progress=False, shard_bytes=6000)
    return url, meta, arrays, url_b, meta_b, arrays_b


def check_batch(b, metas, vocab, names=("label", "store", "w", "ok", "time")):
    """Every window's (crop's) fields against its sequence's meta; returns the windows checked."""
    keys, starts = list(b["key"]), b["start"].tolist()
    source = b["source"].tolist() if "source" in b else [0] * len(keys)
    for i, (key, start, src) in enumerate(zip(keys, starts, source)):
        m = metas[src][key]
        for name in names:
            got = b[name][i].item()
            want = {"store": lambda: vocab.index(m["store"]), "time": lambda: expected_time(m, start)}.get(
                name, lambda: m[name])()
            assert got == want, (name, key, start, got, want)
    return len(keys)


KINDS = {"plain": {}, "crops": dict(crops=sw.Crops(min_window=8, window_multiple=4), horizon=3),
         "packed": dict(crops=sw.Crops(pack_length=64, min_window=8, window_multiple=4))}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["inprocess", "workers", "device"])
def test_every_window_carries_its_sequences_fields(packed, kind, how):
    url, meta, *_ = packed
    ds = sw.WindowDataset(url, window=16, stride=8, batch_size=8, **KINDS[kind],
                          select=sw.Select(fields=["label", "store", "w", "ok", "time"]))
    kw = {"inprocess": dict(num_workers=0), "workers": dict(num_workers=2), "device": dict(num_workers=0, device="cpu")}
    loader = sw.WindowLoader(ds, **kw[how])
    seen = 0
    for b in loader:
        assert b["label"].dtype == b["time"].dtype == b["store"].dtype == __import__("torch").int64
        assert b["ok"].dtype == __import__("torch").bool and b["w"].dtype == __import__("torch").float64
        seen += check_batch(b, [meta], ds.vocabulary("store"))
        if kind == "packed":
            assert len(b["label"]) == len(b["start"]) == len(b["key"])  # per crop, cut like start
    loader.close()
    assert seen > 20
    assert ds.vocabulary("store") == tuple(sorted(STORES))


def test_device_cpu_with_workers_matches(packed):
    url, meta, *_ = packed
    ds = sw.WindowDataset(url, window=16, batch_size=8,
                          crops=sw.Crops(pack_length=64, min_window=8), select=sw.Select(fields=["label", "time"]))
    got = list(sw.WindowLoader(ds, num_workers=1, device="cpu"))
    for b in got:
        check_batch(b, [meta], (), names=("label", "time"))


def test_a_mix_maps_codes_to_one_vocabulary_and_fills(packed, tmp_path):
    url, meta, _, url_b, meta_b, _ = packed
    ds = sw.WindowDataset([url, url_b], window=16, batch_size=8, select=sw.Select(fields=["label", "store", "time"]))
    vocab = ds.vocabulary("store")
    assert vocab == tuple(sorted(set(STORES) | {"nara", "sapporo"}))
    for nw in (0, 1):
        n = sum(check_batch(b, [meta, meta_b], vocab, ("label", "store", "time")) for b in
                sw.WindowLoader(ds, num_workers=nw))
        assert n > 50
    bare = str(tmp_path / "bare")
    sw.pack([(f"z{i}", np.ones(40, np.float32)) for i in range(6)], bare, progress=False)
    with pytest.raises(ValueError, match=r"bare has no field 'label' .*fill="):
        sw.WindowDataset([url, bare], window=16, select=sw.Select(fields=["label"]))
    ds = sw.WindowDataset([url, bare], window=16, batch_size=8,
                          select=sw.Select(fields=["label", "store"], fill={"label": -1, "store": "unknown"}))
    vocab = ds.vocabulary("store")
    for b in sw.WindowLoader(ds, num_workers=0):
        for key, src, lab, st in zip(b["key"], b["source"].tolist(), b["label"].tolist(), b["store"].tolist()):
            want = (meta[key]["label"], meta[key]["store"]) if src == 0 else (-1, "unknown")
            assert (lab, vocab[st]) == want


def test_field_names_are_checked(packed):
    url, *_ = packed
    for name, match in [("x", "batch key"), ("start", "ask for 'time'"), ("nope", "no field 'nope'"),
                        ("tags", "no field")]:
        with pytest.raises(ValueError, match=match):
            sw.WindowDataset(url, window=16, select=sw.Select(fields=[name]))
    with pytest.raises(KeyError, match="not a str field"):
        sw.WindowDataset(url, window=16, select=sw.Select(fields=["label"])).vocabulary("label")


def batches(loader, names=("label", "time", "x")):
    return [{k: np.asarray(b[k]).copy() for k in names} | {"key": list(b["key"])} for b in loader]


def same(a, b):
    return len(a) == len(b) and all(x["key"] == y["key"] and all(np.array_equal(x[k], y[k]) for k in x if k != "key")
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_at_every_step_is_bitwise(packed, workers):
    url, meta, *_ = packed
    ds = sw.WindowDataset(url, window=16, batch_size=8,
                          crops=sw.Crops(pack_length=48, min_window=8), select=sw.Select(fields=["label", "time"]))
    full = batches(sw.WindowLoader(ds, num_workers=workers))
    loader = sw.WindowLoader(ds, num_workers=workers)
    states = [json.loads(json.dumps(loader.state_dict()))]
    for _ in loader:
        states.append(json.loads(json.dumps(loader.state_dict())))
    loader.close()
    for k, state in enumerate(states):
        again = sw.WindowLoader(ds, num_workers=workers)
        again.load_state_dict(state)
        again.set_epoch(0)  # at the epoch's end: an empty pass
        assert same(batches(again), full[k:]), f"resumed after {k} batches"
        again.close()


def test_elastic_resume_two_to_three_ranks_keeps_fields(packed):
    url, meta, *_ = packed

    def group(world):
        select = sw.Select(fields=["label", "store", "time"])
        return [sw.WindowLoader(sw.WindowDataset(url, window=16, batch_size=4, rank=r, world_size=world, select=select),
                                num_workers=0) for r in range(world)]
    old = group(2)
    its = [iter(x) for x in old]
    for _ in range(3):
        for it in its:
            check_batch(next(it), [meta], old[0].dataset.vocabulary("store"), ("label", "store", "time"))
    state = old[0].state_dict()
    for x in old:
        x.close()
    new = group(3)
    counts = []
    for x in new:
        x.load_state_dict(state)
        counts.append(sum(check_batch(b, [meta], x.dataset.vocabulary("store"), ("label", "store", "time"))
                          for b in x))
    assert len(set(counts)) == 1 and counts[0] > 0


def test_where_keeps_the_sequences_and_reads_none_of_the_others(tmp_path):
    rng = np.random.default_rng(3)
    # long sequences (96 KB each, more than the reader merges across), labels in runs of three
    items = [(f"q{i:02d}", rng.normal(size=(24_000,)).astype(np.float32), {"label": (i // 3) % 4}) for i in range(24)]
    url = str(tmp_path / "q")
    sw.pack(items, url, progress=False, shard_bytes=1 << 20)
    kept = {k: a for k, a, m in items if m["label"] in (1, 3)}
    ds = sw.WindowDataset(url, window=512, stride=512, batch_size=16,
                          select=sw.Select(fields=["label"], where={"label": [1, 3]}))
    loader = sw.WindowLoader(ds, num_workers=0)
    seen = set()
    for b in loader:
        for key, start, x in zip(b["key"], b["start"].tolist(), b["x"].numpy()):
            assert key in kept and np.array_equal(x, kept[key][start : start + 512])
            seen.add((key, start))
    want = {(k, s) for k, a in kept.items() for s in range(0, len(a) - 511, 512)}
    assert len(seen) > 0.9 * len(want) and seen <= want
    read = loader.stats()["bytes_read"]
    kept_bytes = sum(a.nbytes for a in kept.values())
    smallest_excluded = min(a.nbytes for k, a, m in items if k not in kept)
    assert read < kept_bytes + smallest_excluded // 2, (read, kept_bytes)  # no excluded sequence's bytes
    assert ds.plan_inputs()["where"] == {"label": [1, 3]}
    state = loader.state_dict()
    with pytest.raises(Exception, match="where"):  # a checkpoint of another selection is refused
        sw.WindowLoader(sw.WindowDataset(url, window=512, stride=512, batch_size=16), num_workers=0).load_state_dict(state)


def test_where_resumes_exactly(packed):
    url, *_ = packed
    ds = sw.WindowDataset(url, window=16, batch_size=4,
                          select=sw.Select(fields=["label", "store"], where={"store": ["nara", "kobe"]}))
    full = batches(sw.WindowLoader(ds, num_workers=0), ("label", "store", "x"))
    assert {ds.vocabulary("store")[int(s)] for b in full for s in b["store"]} == {"nara", "kobe"}
    loader = sw.WindowLoader(ds, num_workers=0)
    it = iter(loader)
    for _ in range(3):
        next(it)
    again = sw.WindowLoader(ds, num_workers=0)
    again.load_state_dict(loader.state_dict())
    assert same(batches(again, ("label", "store", "x")), full[3:])


def scale_tokens(batch, rng):
    """Chronos-style: mean scaling, quantisation to tokens, random masking; and who ran it."""
    x = batch["x"]
    scale = np.abs(x).mean(axis=1, keepdims=True) + 1e-3
    tokens = np.clip(np.round(x / scale * 8), -64, 64).astype(np.int64) + 64
    tokens[rng.random(tokens.shape) < 0.15] = 0
    return {"tokens": tokens, "label": batch["label"], "pid": np.full(len(x), os.getpid(), dtype=np.int64)}


@pytest.mark.parametrize("workers", [0, 1])
def test_transform_runs_in_the_worker_and_resumes_bitwise(packed, workers):
    url, meta, *_ = packed
    ds = sw.WindowDataset(url, window=16, batch_size=8, select=sw.Select(fields=["label"]))
    full = [dict(b) for b in sw.WindowLoader(ds, num_workers=workers, transform=scale_tokens)]
    assert set(full[0]) == {"tokens", "label", "pid", "key"}
    pids = {int(b["pid"][0]) for b in full}
    assert (pids == {os.getpid()}) if workers == 0 else (os.getpid() not in pids)
    for b in full:
        assert [meta[k]["label"] for k in b["key"]] == b["label"].tolist()
    loader = sw.WindowLoader(ds, num_workers=workers, transform=scale_tokens)
    states = [loader.state_dict()]
    for _ in loader:
        states.append(loader.state_dict())
    for k in (1, len(full) // 2, len(full) - 1):
        again = sw.WindowLoader(ds, num_workers=workers, transform=scale_tokens)
        again.load_state_dict(states[k])
        rest = list(again)
        assert len(rest) == len(full) - k
        assert all(np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(full[k:], rest)), k
        again.close()


def changes_shape(batch, rng):
    return {"x": batch["x"][: 8 if batch["start"].sum() >= 0 and not batch["x"].any() else 4]}


def not_a_dict(batch, rng):
    return [batch["x"]]


def test_transform_errors_name_the_problem(packed):
    url, *_ = packed
    ds = sw.WindowDataset(url, window=16, batch_size=8)
    with pytest.raises(ValueError, match=r"returned 'x' of shape \(4, 16\): 4 rows out, 8 in"):
        list(sw.WindowLoader(ds, num_workers=0, transform=changes_shape))
    with pytest.raises(TypeError, match="must return a dict of numpy arrays"):
        sw.WindowLoader(ds, num_workers=0, transform=not_a_dict)
    with pytest.raises(TypeError, match="cannot be sent to worker processes started by 'spawn'"):
        sw.WindowLoader(ds, num_workers=1, transform=lambda b, r: b, multiprocessing_context="spawn")
    with pytest.raises(ValueError, match="num_workers >= 1"):
        sw.WindowLoader(ds, num_workers=0, device="cpu", transform=scale_tokens)


# -- pack: where the fields come from, and how the manifest keeps them -----------------------------------

def test_meta_kinds_and_left_out_keys(tmp_path):
    items = [(f"k{i}", np.ones(5, np.float32), {"a": i, "b": "x" if i else 1, "c": [1], "d": i * 0.5 if i else 0,
                                               **({"late": 1} if i else {}), "time": 3, "when": dt.date(2020, 1, i + 1)})
             for i in range(4)]
    m = sw.pack(items, str(tmp_path / "d"), progress=False)
    assert m.fields.kinds == {"a": "int", "d": "float", "when": "time"}
    assert set(m.fields.left_out) == {"b", "c", "late", "time"}
    assert "missing in the sequences before 'k1'" in m.fields.left_out["late"]
    assert m.fields.columns["when"].tolist() == [ns(f"2020-01-0{i + 1}") for i in range(4)]
    with pytest.raises(ValueError, match="left out when packing: .*missing"):
        sw.WindowDataset(str(tmp_path / "d"), window=2, select=sw.Select(fields=["late"]))


def long_table(rows_per_id=(10, 12, 7), irregular=False, varying=False):
    rows = []
    for i, n in enumerate(rows_per_id):
        for t in range(n):
            hours = t + (1 if irregular and i == 1 and t > 4 else 0)
            rows.append({"id": f"u{i}", "t": pd.Timestamp("2022-05-01") + pd.Timedelta(hours=hours), "v": float(t),
                         "label": i if not (varying and t == 3) else 9, "site": "ab"[i % 2]})
    return pd.DataFrame(rows)


def test_table_meta_columns_and_time_from_the_order_column(tmp_path):
    long_table().to_parquet(tmp_path / "x.parquet")
    url = str(tmp_path / "x")
    m = sw.pack(str(tmp_path / "x.parquet"), url, id_column="id", order_column="t", meta_columns=["label", "site"],
                progress=False)
    assert m.fields.kinds == {"freq": "duration", "label": "int", "site": "str", "start": "time"}
    assert m.value_columns == ("v",)
    assert m.fields.columns["freq"].tolist() == [3600 * 10**9] * 3
    ds = sw.WindowDataset(url, window=4, stride=1, batch_size=2, select=sw.Select(fields=["label", "site", "time"]))
    for b in sw.WindowLoader(ds, num_workers=0):
        for key, start, t, x in zip(b["key"], b["start"].tolist(), b["time"].tolist(), b["x"].numpy()):
            assert t == ns(pd.Timestamp("2022-05-01") + pd.Timedelta(hours=int(x[0])))  # v = the step's hour
    long_table(varying=True).to_parquet(tmp_path / "y.parquet")
    with pytest.raises(PackError, match=r"meta column 'label' changes within id 'u0' \(0, then 9\)"):
        sw.pack(str(tmp_path / "y.parquet"), str(tmp_path / "y"), id_column="id", order_column="t",
                meta_columns=["label"], progress=False)
    long_table(irregular=True).to_parquet(tmp_path / "z.parquet")
    m = sw.pack(str(tmp_path / "z.parquet"), str(tmp_path / "z"), id_column="id", order_column="t", meta_columns=["label"],
                progress=False)
    assert "irregular in id 'u1'" in m.fields.left_out["start"]
    with pytest.raises(ValueError, match="'time' .* needs the fields 'start' and 'freq', and .* has no field 'start' "
                                         ".*irregular in id 'u1'"):
        sw.WindowDataset(str(tmp_path / "z"), window=2, select=sw.Select(fields=["time"]))
    with pytest.raises(PackError, match="irregular in id 'u1'"):
        sw.pack(str(tmp_path / "z.parquet"), str(tmp_path / "z2"), id_column="id", order_column="t",
                regular_order=True, progress=False)


def test_parts_merge_and_workers_carry_fields_with_vocabularies_merged(tmp_path):
    for i, stores in enumerate((["kobe", "osaka"], ["nara"], ["osaka", "aomori"])):
        rows = [{"id": f"p{i}_{j}", "t": t, "v": float(t), "store": stores[j % len(stores)], "label": j}
                for j in range(4) for t in range(6)]
        pd.DataFrame(rows).to_parquet(tmp_path / f"in{i}.parquet")
    src = [str(tmp_path / f"in{i}.parquet") for i in range(3)]
    opts = dict(id_column="id", order_column="t", meta_columns=["store", "label"], progress=False)
    one = sw.pack(src, str(tmp_path / "one"), **opts)
    two = sw.pack(src, str(tmp_path / "two"), workers=2, **opts)
    for i in range(3):
        sw.pack(src, str(tmp_path / "parts"), part=f"{i}/3", **opts)
    merged = sw.merge(str(tmp_path / "parts"))
    assert one.fields.vocabulary["store"] == ("aomori", "kobe", "nara", "osaka")
    for m in (two, merged, sw.load_manifest(str(tmp_path / "parts"))):
        assert m.fields.kinds == one.fields.kinds and m.fields.vocabulary == one.fields.vocabulary
        for name in one.fields.kinds:
            assert np.array_equal(m.fields.columns[name], one.fields.columns[name]), name
    stores = [one.fields.vocabulary["store"][c] for c in one.fields.columns["store"]]
    assert stores[:4] == ["kobe", "osaka", "kobe", "osaka"] and stores[4:8] == ["nara"] * 4


def test_columnar_manifest_keeps_fields_sealed_and_checked(packed, tmp_path):
    from streamwin.formats.manifest import parse_manifest
    from streamwin.storage.manifests import write_manifest
    from streamwin.storage.urls import url_to_fs

    url, meta, *_ = packed
    m = sw.load_manifest(url)
    fs, root = url_to_fs(str(tmp_path))
    write_manifest(fs, root, m, columnar=True)  # as a dataset past COLUMNAR_FROM sequences
    c = sw.load_manifest(str(tmp_path))
    assert c.fields.kinds == m.fields.kinds
    for name in m.fields.kinds:
        assert np.array_equal(c.fields.columns[name], m.fields.columns[name])
    doc = json.loads((tmp_path / "index.json").read_text())
    assert "field:label" in doc["columns_file"]["layout"]
    text = (open(f"{url}/index.json").read())
    doc = json.loads(text)
    doc["fields"]["kinds"]["label"] = "float"  # an edit that keeps the field well-formed: the seal refuses it
    with pytest.raises(ManifestError, match="changed after streamwin wrote it"):
        parse_manifest(json.dumps(doc))
    del doc["content_sha256"]
    doc["fields"]["vocabulary"]["store"] = ["kobe"]  # codes outside the vocabulary: named
    doc["fields"]["kinds"]["label"] = "int"
    with pytest.raises(ManifestError, match="fields.values.store holds codes outside its vocabulary"):
        parse_manifest(json.dumps(doc))
    doc = json.loads(text)
    del doc["fields"], doc["content_sha256"]  # an older manifest: no fields
    assert parse_manifest(json.dumps(doc)).fields is None


def test_inspect_lists_fields(packed, capsys):
    from streamwin.cli.main import main

    url, *_ = packed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main(["inspect", url, "--window", "16"])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("fields"))
    assert "label int 0..3" in line and "store str (4 values)" in line and "ok bool False..True" in line
    assert "start time 2021-03-01T00:00:00.000000000.." in line


def test_row_tables_take_meta_columns_per_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    starts = [pd.Timestamp("2020-01-01"), pd.Timestamp("2021-06-01"), pd.Timestamp("2022-01-01")]
    pq.write_table(pa.table({"id": ["a", "b", "c"], "target": [[1.0, 2, 3], [4.0, 5], [6.0, 7, 8, 9]],
                             "start": pa.array(starts), "cat": ["x", "y", "x"]}), tmp_path / "t.parquet")
    m = sw.pack(str(tmp_path / "t.parquet"), str(tmp_path / "o"), id_column="id", meta_columns=["start", "cat"],
                progress=False)
    assert m.value_columns == ("target",) and m.fields.kinds == {"cat": "str", "start": "time"}
    assert m.fields.columns["start"].tolist() == [ns(s) for s in starts]
    assert [m.fields.vocabulary["cat"][c] for c in m.fields.columns["cat"]] == ["x", "y", "x"]


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("workers", [0, 1])
def test_fields_on_cuda(packed, workers):
    url, meta, *_ = packed
    for kw in ({}, dict(crops=sw.Crops(pack_length=64, min_window=8, window_multiple=4))):
        ds = sw.WindowDataset(url, window=16, batch_size=8, **kw, select=sw.Select(fields=["label", "store", "time"]))
        for b in sw.WindowLoader(ds, num_workers=workers, device="cuda"):
            assert b["label"].is_cuda and b["time"].is_cuda
            check_batch({k: (v.cpu() if hasattr(v, "cpu") else v) for k, v in b.items()}, [meta],
                        ds.vocabulary("store"), ("label", "store", "time"))
