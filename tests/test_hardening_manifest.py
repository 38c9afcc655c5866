"""index.json as input (issue 28, items 5, 7 and 8): sealed against edits, counts checked, URLs that are no dataset.

* A manifest carries ``content_sha256``, the sha256 of its other fields as canonical JSON: a
  hand edit that leaves every field valid (two members' offsets swapped, which would train one
  sequence's values under the other's key) is refused on load, naming the file and the fix;
  so is an edit of the columns file a version 2 manifest names (its sha256 is checked). Every
  writer seals (pack, pack with workers, parts + merge, index); a manifest written before the
  seal existed loads with a warning.
* Its top-level counts must agree with the shards it lists; 100,000 nested ``[`` is a
  ManifestError, not a RecursionError.
* A dataset URL that is no dataset fails when the WindowDataset is made; one that names a
  file (index.json itself, a shard) fails at once (no retries) and says to pass the directory.
"""
from __future__ import annotations

import base64
import gc
import json
import time
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest

import streamwin as sw
from streamwin.errors import ManifestError
from streamwin.formats.manifest import content_checksum

pytestmark = pytest.mark.timeout(180)


def pack_twins(root: Path, **kw) -> Path:
    """A dataset whose sequences a and b have the same length (and so the same member size and header)."""
    rng = np.random.default_rng(3)
    seqs = [("a", np.full((50, 2), 1.0, np.float32)), ("b", np.full((50, 2), 2.0, np.float32)),
            *((f"s{i}", rng.standard_normal((int(rng.integers(20, 90)), 2)).astype(np.float32)) for i in range(6))]
    sw.pack(seqs, str(root), progress=False, **kw)
    return root


def read_doc(root: Path) -> dict:
    return json.loads((root / "index.json").read_text())


def write_doc(root: Path, doc: dict) -> None:
    (root / "index.json").write_text(json.dumps(doc))


def swap_offsets(doc: dict) -> None:
    """Swap the ``offset`` of sequences 0 and 1 in an inline (version 1) manifest, every field staying valid."""
    col = np.frombuffer(zlib.decompress(base64.b64decode(doc["columns"]["offset"])), "<i8").copy()
    col[[0, 1]] = col[[1, 0]]
    doc["columns"]["offset"] = base64.b64encode(zlib.compress(col.tobytes())).decode()


def first_windows(url: str) -> dict[str, np.ndarray]:
    loader = sw.WindowLoader(sw.WindowDataset(url, window=50, batch_size=1, order=sw.Order(shuffle=False)))
    return {b["key"][0]: b["x"][0].numpy().copy() for b in loader}


def test_swapped_offsets_are_refused_naming_the_file(tmp_path):
    root = pack_twins(tmp_path / "ds")
    assert first_windows(str(root))["a"][0, 0] == 1.0
    doc = read_doc(root)
    swap_offsets(doc)
    write_doc(root, doc)
    with pytest.raises(ManifestError) as e:  # before: a's windows came with b's values (2.0), no error
        first_windows(str(root))
    assert f"{root}/index.json" in str(e.value) and "streamwin index" in str(e.value)
    with pytest.raises(ManifestError, match="content_sha256"):
        sw.load_manifest(str(root))


def test_an_edited_columns_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("streamwin.storage.manifests.COLUMNAR_FROM", 1)  # the columnar form for a small dataset
    root = pack_twins(tmp_path / "ds")
    m = sw.load_manifest(str(root))
    spec = read_doc(root)["columns_file"]
    path = root / spec["name"]
    data = bytearray(path.read_bytes())
    at = spec["layout"]["offset"][0]
    data[at : at + 16] = data[at + 8 : at + 16] + data[at : at + 8]  # offsets of sequences 0 and 1 swapped
    path.write_bytes(bytes(data))
    assert m.offset[0] != m.offset[1]
    with pytest.raises(ManifestError, match=f"{spec['name']} is damaged or was changed"):
        sw.load_manifest(str(root))


def sealed(root: Path) -> bool:
    doc = read_doc(root)
    return doc.get("content_sha256") == content_checksum(doc)


def test_every_writer_seals_its_manifest(tmp_path):
    assert sealed(pack_twins(tmp_path / "plain"))
    assert sealed(pack_twins(tmp_path / "zstd", compression="zstd"))
    assert sealed(pack_twins(tmp_path / "workers", workers=2))
    for i in range(2):
        pack_twins(tmp_path / "parts", part=(i, 2))
    sw.merge(str(tmp_path / "parts"))
    assert sealed(tmp_path / "parts")
    copy = tmp_path / "indexed"
    copy.mkdir()
    for p in (tmp_path / "plain").glob("*.tar"):
        (copy / p.name).write_bytes(p.read_bytes())
    sw.index_shards(str(copy), progress=False)
    assert sealed(copy)


def test_a_manifest_written_before_the_seal_loads_with_a_warning(tmp_path):
    root = pack_twins(tmp_path / "ds")
    doc = read_doc(root)
    del doc["content_sha256"]
    write_doc(root, doc)
    with pytest.warns(RuntimeWarning, match="no checksum of its own content.*streamwin index"):
        ds = sw.WindowDataset(str(root), window=8, batch_size=4)
    assert not ds.manifest.sealed and len(sw.WindowLoader(ds)) > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a sealed one says nothing
        assert sw.WindowDataset(str(pack_twins(tmp_path / "new")), window=8).manifest.sealed


@pytest.mark.parametrize("field", ["num_shards", "num_sequences", "num_steps", "num_bytes"])
def test_top_level_counts_must_match_the_shards(tmp_path, field):
    root = pack_twins(tmp_path / "ds")
    doc = read_doc(root)
    doc[field] += 1
    doc["content_sha256"] = content_checksum(doc)  # sealed again: the count itself is refused
    write_doc(root, doc)
    with pytest.raises(ManifestError, match=f"field {field} says"):
        sw.load_manifest(str(root))


def test_deeply_nested_json_is_a_manifest_error(tmp_path):
    root = tmp_path / "ds"
    root.mkdir()
    (root / "index.json").write_text("[" * 100_000)
    # earlier tests' cyclic garbage collected first: a finalizer the collector would run at the parser's
    # recursion depth (a mapping's munmap through ctypes) fails there for want of stack, an unraisable error
    gc.collect()
    with pytest.raises(ManifestError, match="not valid JSON"):
        sw.load_manifest(str(root))


# -- URLs that are no dataset (item 8) ---------------------------------------------------------------

def test_a_missing_dataset_fails_when_the_dataset_is_made(tmp_path):
    with pytest.raises(ManifestError, match="no index.json at"):
        sw.WindowDataset(str(tmp_path / "no" / "such" / "path"), window=8)


@pytest.mark.parametrize("what", ["index.json", "shard"])
def test_a_file_url_fails_at_once_saying_to_pass_the_directory(tmp_path, what):
    root = pack_twins(tmp_path / "ds")
    name = "index.json" if what == "index.json" else sw.load_manifest(str(root)).shards[0].name
    t0 = time.monotonic()
    with pytest.raises(ManifestError) as e:  # before: NotADirectoryError retried for 6-7 s
        sw.WindowDataset(str(root / name), window=8, read=sw.Read(retry_backoff=0.5))
    took = time.monotonic() - t0
    assert "is a file, not a dataset" in str(e.value) and repr(str(root)) in str(e.value)
    assert took < 2.0, took  # 5 retries from 0.5 s would take 15 s


def test_a_file_url_over_http_says_to_pass_the_directory(tmp_path, http_server):
    root = pack_twins(tmp_path / "ds")
    srv = http_server(str(tmp_path))
    with pytest.raises(ManifestError, match="is a file, not a dataset"):
        sw.WindowDataset(srv.url_for("ds/index.json"), window=8)
