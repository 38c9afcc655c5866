"""The plan, pure (numpy only, no I/O): which windows each stream yields, in which order, how many batches.

In: per source, the sequence lengths and shard boundaries (from its manifest) and the split; the
window spec, seed, epoch, world size, workers, batch size and mixing weights. Out: a ``Plan``
whose per-source ``SourcePlan`` blocks name global window indices of that source's window
space (``WindowSpace``, which maps them to (sequence, start step)), and the batch quotas.
Modules, in import order: options, split, space, crops (where each window's crop starts and how long it
is), rows (packed rows per block), order, mix, schedule (what a process takes per batch: the protocol every
plan's schedule keeps), streams, group, canon, canon_deal, epoch.
"""
from streamwin.plan.epoch import Plan, make_plan, plan_epoch, rest_plan
from streamwin.plan.options import PlanConfig, ShuffleSpec, WindowSpec
from streamwin.plan.space import WindowSpace
from streamwin.plan.streams import SourcePlan

__all__ = ["Plan", "PlanConfig", "ShuffleSpec", "SourcePlan", "WindowSpace", "WindowSpec", "make_plan", "plan_epoch",
           "rest_plan"]
