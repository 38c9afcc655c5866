"""The plan, pure (numpy only, no I/O): which windows each stream yields, in which order, how many batches.

In: per-sequence lengths and shard boundaries (from the manifest), the window spec, the split,
seed, epoch, world size, workers, batch size and mixing weights. Out: a plan whose blocks name
global window indices, and the window space that maps them to (sequence, start step).
"""
from streamwin.plan.epoch import Plan, PlanConfig, WindowSpec, make_plan

__all__ = ["Plan", "PlanConfig", "WindowSpec", "make_plan"]
