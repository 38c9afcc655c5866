"""Imports point one way, down the data flow; torch stays out of the pure modules."""
from __future__ import annotations

import ast
import pathlib

import streamwin

PKG = pathlib.Path(streamwin.__file__).parent
# each module may import only modules listed before it
ORDER = ["errors", "keys", "manifest", "npyfmt", "storage", "mapped", "plan", "mix", "split", "sources", "pack", "index",
         "cache", "read", "batch", "nodes", "world", "dataset", "device", "slots", "workers", "passes", "loader", "cli", "__init__"]
TORCH_ALLOWED = {"batch", "nodes", "world", "dataset", "device", "slots", "workers", "passes", "loader", "cli", "__init__"}


def imports(module: str) -> set[str]:
    tree = ast.parse((PKG / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                found |= {node.module} if node.module else {a.name for a in node.names}
            elif node.module:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_every_module_is_in_the_order():
    assert sorted(p.stem for p in PKG.glob("*.py")) == sorted(ORDER)


def test_imports_point_down_the_flow():
    for i, module in enumerate(ORDER):
        local = {m.split(".")[0] for m in imports(module) if m.split(".")[0] in ORDER}
        later = local - set(ORDER[:i])
        assert not later, f"streamwin.{module} imports {later}, which come after it in the data flow"


def test_torch_only_where_the_loader_lives():
    for module in ORDER:
        heavy = {m for m in imports(module) if m.split(".")[0] in ("torch", "torchdata")}
        if module not in TORCH_ALLOWED:
            assert not heavy, f"streamwin.{module} imports {heavy}: pure modules stay free of torch"
    assert not any("stateful_dataloader" in m for mod in ORDER if mod not in ("loader", "__init__") for m in imports(mod))


def test_pack_knows_nothing_of_the_read_side():
    assert not {"read", "batch", "nodes", "dataset", "loader", "plan"} & imports("pack")


def test_public_names_are_sorted_and_exist():
    assert streamwin.__all__ == sorted(streamwin.__all__)
    assert all(hasattr(streamwin, n) for n in streamwin.__all__)
