"""Imports point one way, down the data flow; torch stays out of the pure modules."""
from __future__ import annotations

import ast
import pathlib
import sys

import streamwin

PKG = pathlib.Path(streamwin.__file__).parent
# each module may import only modules listed before it (a package's __init__ comes after its modules)
ORDER = [
    "errors", "arguments", "world", "progress",
    "formats.keys", "formats.npy", "formats.tar", "formats.zstd", "formats.sums", "formats.checks", "formats.fields", "formats.times",
    "formats.meta", "formats.framed", "formats.seal", "formats.colfile", "formats.growth",
    "formats.manifest", "formats",
    "storage.urls", "storage.retry", "storage.mapped", "storage.deadline", "storage.ranged", "storage.manifests", "storage.cache", "storage",
    "plan.options", "plan.split", "plan.space", "plan.crops", "plan.rows", "plan.order", "plan.mix", "plan.schedule",
    "plan.streams", "plan.group",
    "plan.canon", "plan.canon_deal", "plan.epoch", "plan",
    "packing.inputs.base", "packing.inputs.zipdir", "packing.inputs.npy", "packing.inputs.metacols", "packing.inputs.tables",
    "packing.inputs.rows", "packing.inputs.parquet", "packing.inputs.arrow", "packing.inputs.frames",
    "packing.inputs.csv", "packing.inputs.jsonl", "packing.inputs.text",
    "packing.inputs.iterable", "packing.inputs.units", "packing.inputs", "packing.nonfinite", "packing.fieldcols",
    "packing.encode",
    "packing.records", "packing.columns", "packing.writer", "packing.tasks", "packing.fragments", "packing.lock",
    "packing.dest", "packing.grow", "packing.unit", "packing.parallel", "packing.cluster_ray", "packing.cluster_dask",
    "packing.parts", "packing.sources", "packing.engines", "packing.append",
    "packing.pack", "packing.compact", "packing.scanner", "packing.scan", "packing",
    "read.ahead", "read.options", "read.block", "read.counts", "read.fetch", "read.members", "read.pieces", "read.segments", "read.runs", "read.frames", "read.sums", "read.verify",
    "read.transport", "read.local", "read.remote", "read.cached", "read.plain", "read.inflate", "read.compressed",
    "read.reader", "read",
    "state", "seqfields", "source", "selection", "crop_stage", "buffers", "batch", "window_random", "transform", "nodes",
    "options", "dataset", "pipeline",
    "feed.stats", "feed.to_device", "feed.device_crops", "feed.device_fields", "feed.device", "feed.slots", "feed.protocol",
    "feed.sizing", "feed.watch", "feed.worker", "feed.stopping", "feed.pool", "feed.context",
    "feed.feeds", "feed.device_feeds", "feed",
    "loader", "cli.args", "cli.report", "cli.pack", "cli.inspect", "cli.bench", "cli.main", "cli", "cli.__main__",
    "__init__", "__main__",
]
PURE = {"errors", "arguments", "progress", "formats", "storage", "plan", "packing", "read", "state", "seqfields", "source",
        "selection", "crop_stage", "window_random", "options"}  # no torch
READ_SIDE = {"plan", "read", "state", "seqfields", "source", "selection", "crop_stage", "buffers", "batch", "window_random",
             "transform", "nodes", "dataset", "pipeline", "feed", "loader"}


def path_of(unit: str) -> pathlib.Path:
    parts = unit.split(".")
    if unit == "__init__":
        return PKG / "__init__.py"
    if (PKG / pathlib.Path(*parts)).is_dir():
        return PKG / pathlib.Path(*parts) / "__init__.py"
    return PKG / pathlib.Path(*parts[:-1]) / f"{parts[-1]}.py"


def imports(unit: str) -> set[str]:
    """Every module ``unit`` imports, as dotted names (streamwin's own without the ``streamwin.`` prefix)."""
    tree = ast.parse(path_of(unit).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{unit}: relative import; streamwin's modules import by absolute path"
            base = node.module or ""
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}  # `from streamwin.formats import npy`
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def own(unit: str) -> set[str]:
    """The streamwin units ``unit`` imports (each the longest listed prefix of what it names)."""
    out = set()
    for name in imports(unit):
        if name == "streamwin" or not name.startswith("streamwin."):
            continue
        parts = name[len("streamwin."):].split(".")
        for k in range(len(parts), 0, -1):
            if ".".join(parts[:k]) in ORDER:
                out.add(".".join(parts[:k]))
                break
    return out


def test_every_module_is_in_the_order():
    found = set()
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG).with_suffix("")
        parts = rel.parts
        found.add(".".join(parts[:-1]) if parts[-1] == "__init__" and len(parts) > 1 else ".".join(parts))
    assert sorted(found) == sorted(ORDER)


def test_imports_point_down_the_flow():
    for i, unit in enumerate(ORDER):
        later = {m for m in own(unit) if m != unit and m not in ORDER[:i]}
        assert not later, f"streamwin.{unit} imports {later}, which come after it in the data flow"


def test_torch_only_where_the_loader_lives():
    for unit in ORDER:
        if unit.split(".")[0] in PURE:
            heavy = {m for m in imports(unit) if m.split(".")[0] in ("torch", "torchdata")}
            assert not heavy, f"streamwin.{unit} imports {heavy}: pure modules stay free of torch"
    assert not any("stateful_dataloader" in m for unit in ORDER if unit not in ("loader", "__init__")
                   for m in imports(unit))


def test_packing_knows_nothing_of_the_read_side():
    for unit in ORDER:
        if unit.startswith("packing"):
            assert not {m.split(".")[0] for m in own(unit)} & READ_SIDE, f"streamwin.{unit} imports the read side"


def test_public_names_are_sorted_and_exist():
    assert streamwin.__all__ == sorted(streamwin.__all__)
    assert all(hasattr(streamwin, n) for n in streamwin.__all__)


def test_modules_and_classes_stay_small():
    """A module over 400 lines or a class over 300 is two things that want to be apart (issue 19)."""
    big = []
    for p in sorted(PKG.rglob("*.py")):
        src = p.read_text()
        if src.count("\n") > 400:
            big.append(f"{p.relative_to(PKG)}: {src.count(chr(10))} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno > 300:
                big.append(f"{p.relative_to(PKG)}: class {node.name} of {node.end_lineno - node.lineno} lines")
    assert not big, big


# torch's own internals that slot reuse needs, as torch's CUDA graph trees use them (no public API tells whether
# any tensor still views a storage): a storage's use count by its address, and a tensor's in-place version
TORCH_INTERNALS = {("feed/slots.py", attr) for attr in ("_C", "_storage_Use_Count", "_cdata", "_version")}


def test_no_module_reaches_into_another_objects_private_attributes():
    """``x._name`` only for x = self or cls, or a standard library module (``os._exit``, ``sys._getframe``: their
    documented API): another object's state is changed through its methods (torch internals: TORCH_INTERNALS)."""
    reach = []
    for p in sorted(PKG.rglob("*.py")):
        tree = ast.parse(p.read_text())
        stdlib = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names
                  if a.name.split(".")[0] in sys.stdlib_module_names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and not (isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"} | stdlib) \
                    and (str(p.relative_to(PKG)), node.attr) not in TORCH_INTERNALS:
                reach.append(f"{p.relative_to(PKG)}:{node.lineno} .{node.attr}")
    assert not reach, reach
