"""streamwin: stream sliding windows of variable-length sequences from tar shards into DDP.

    import streamwin as sw
    sw.pack(sequences, "s3://bucket/corpus/")
    loader = sw.WindowLoader(sw.WindowDataset("s3://bucket/corpus/", window=512, stride=256, batch_size=64))
"""
from streamwin.storage.cache import ShardCache, prefetch
from streamwin.errors import ManifestError, PackError, ShardError, StateMismatchError, StreamwinError
from streamwin.packing.scan import index_shards, verify
from streamwin.formats.manifest import Manifest
from streamwin.options import Crops, Mix, Order, Read, Select
from streamwin.packing.compact import compact
from streamwin.packing.pack import pack
from streamwin.packing.parts import merge
from streamwin.plan.epoch import Plan, make_plan
from streamwin.plan.options import PlanConfig, WindowSpec
from streamwin.storage.manifests import load_manifest

__version__ = "0.1.0"


def __getattr__(name: str):
    """WindowDataset and WindowLoader load torch (seconds): import them only when asked for,
    so that `streamwin pack`, `merge`, `index`, `verify` and `inspect` start at once."""
    if name == "WindowDataset":
        from streamwin.dataset import WindowDataset
        return WindowDataset
    if name == "WindowLoader":
        from streamwin.loader import WindowLoader
        return WindowLoader
    raise AttributeError(f"module 'streamwin' has no attribute {name!r}")
__all__ = sorted([
    "Crops", "Manifest", "ManifestError", "Mix", "Order", "PackError", "Plan", "PlanConfig", "Read", "Select",
    "ShardCache", "ShardError", "StateMismatchError", "StreamwinError", "WindowDataset", "WindowLoader", "WindowSpec",
    "compact", "index_shards", "load_manifest", "make_plan", "merge", "pack", "prefetch", "verify",
])
