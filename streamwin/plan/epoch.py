"""The plan of one epoch: which windows each stream yields, in which order, and how many batches.

A pure function of (each source's window space and shard boundaries, the window spec, epoch,
seed, world_size, num_workers, batch_size, weights); no I/O, so it is exhaustively testable and
plans 4096 ranks on one machine in milliseconds.

A dataset is a mix of sources; a dataset of one URL is a mix of one. Per source:

1. its share of the epoch's windows (``mix.shares``) in an order of its slices permuted by
   (seed, epoch) (``order.ShareOrder``), the same on every rank;
2. that order dealt over the ``S`` streams in ranges that differ by at most one window, and
   cut into shuffled blocks (``streams.SourcePlan``).

Then the batch quotas (``mix.epoch_quotas``): every stream yields exactly ``J`` batches, batch
``j`` holding ``quotas[j, i]`` windows of source ``i`` (all B of the only source when unmixed),
so every rank yields the same number of batches however skewed the data. With
equalize="drop" fewer than S * batch_size windows of a source are dropped per epoch; with
"pad" the streams are filled with repeats (each marked weight 0).

After an elastic resume the rest of an interrupted epoch (``rest_plan``) is planned the same
way over the new world: each source's order is then what its old streams had not yielded.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from streamwin.arguments import check_keywords
from streamwin.plan.mix import epoch_quotas, normalized, shares
from streamwin.plan.options import PlanConfig
from streamwin.plan.order import ONLY_SOURCE, ShareOrder, cut_slices
from streamwin.plan.rows import RowPlan
from streamwin.plan.space import WindowSpace, array_views
from streamwin.plan.canon_deal import deal_canonical
from streamwin.plan.streams import Plan, RestOrder, SourcePlan, stream_ranges


def deal(config: PlanConfig, epoch: int, weights: Sequence[float], orders: Sequence, spaces: Sequence[WindowSpace],
         generation: int = 0) -> Plan:
    """Deal each source's order over ``config``'s streams and fix the quotas and batch count J."""
    w = normalized(weights)
    keyed = source_keys(len(orders))
    if config.canonical is not None:
        return deal_canonical(config, epoch, w, orders, spaces, keyed, generation)
    ranges = [stream_ranges(o.total, config.num_streams) for o in orders]
    if config.pack_length is not None:
        return _deal_rows(config, epoch, w, orders, spaces, ranges, keyed, generation)
    quotas = epoch_quotas(config, w, [np.diff(r) for r in ranges])
    per_stream = quotas.sum(axis=0)
    plans = tuple(SourcePlan(config, epoch, space, order, r, int(per_stream[i]), generation, source=key)
                  for i, (space, order, r, key) in enumerate(zip(spaces, orders, ranges, keyed)))
    return Plan(config, epoch, w, plans, quotas, generation)


def source_keys(sources: int) -> list[int | None]:
    """What keys each source's shuffles (orders, blocks, crops): its index in a mix, ``ONLY_SOURCE`` for a dataset
    of one (the keys of every state saved before mixing)."""
    return [ONLY_SOURCE] if sources == 1 else list(range(sources))


def _deal_rows(config: PlanConfig, epoch: int, w: np.ndarray, orders: Sequence, spaces: Sequence[WindowSpace],
               ranges: list[np.ndarray], keyed: list, generation: int) -> Plan:
    """``deal`` with packed rows: each stream reads all the windows it owns; the quotas count rows.

    A source's rows in a batch follow its share of the rows every stream fills (its weight times
    its crops' length), so every source's rows run out together and few are left out.
    """
    row_units = config.pack_length // config.spec.window_multiple
    plans, rows = [], []
    for space, order, r, key in zip(spaces, orders, ranges, keyed):
        p = SourcePlan(config, epoch, space, order, r, int(np.diff(r).max(initial=0)), generation, source=key)
        plans.append(p)
        rows.append(RowPlan(p, row_units))
    sizes = [r.per_stream for r in rows]
    filled = np.array([s.sum() for s in sizes], dtype=np.float64)
    quotas = epoch_quotas(config, filled if filled.sum() else w, sizes)
    per_stream = quotas.sum(axis=0)
    plans = tuple(replace(p, rows=r, rows_per_stream=int(per_stream[i])) for i, (p, r) in enumerate(zip(plans, rows)))
    return Plan(config, epoch, w, plans, quotas, generation)


def plan_epoch(config: PlanConfig, epoch: int, spaces: Sequence[WindowSpace], shard_starts: Sequence[np.ndarray],
               weights: Sequence[float] | None = None, epoch_windows: int | None = None,
               names: Sequence[str] | None = None) -> Plan:
    """An epoch's plan from each source's window space and shard boundaries (``names`` for errors)."""
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
    names = names or [f"source {i}" for i in range(len(spaces))]
    windows = [space.total for space in spaces]
    share = shares(sum(windows) if epoch_windows is None else epoch_windows, weights, windows)
    keyed = source_keys(len(spaces))
    orders = []
    for i, (name, space, starts, key) in enumerate(zip(names, spaces, shard_starts, keyed)):
        if share[i] and not windows[i]:
            raise ValueError(no_windows(name, space, int(share[i])))
        slice_lo, slice_len = cut_slices(space.starts(starts), config.slice_windows)
        orders.append(ShareOrder(slice_lo, slice_len, int(share[i]), seed=config.seed, epoch=int(epoch), source=key,
                                 shuffle=config.shuffle))
    if weights is None:
        weights = windows if sum(windows) else [1.0] * len(windows)
    return deal(config, int(epoch), weights, orders, spaces)


def no_windows(name: str, space: WindowSpace, share: int) -> str:
    """Why a source given a share of the epoch has no window, and what to pass instead."""
    spec = space.spec
    steps = space.lengths if space.views is None or not space.n else space.views(np.arange(space.n))[1]
    longest = int(np.max(steps, initial=0))
    span = f"window {spec.window} + horizon {spec.horizon}" if spec.horizon else f"window {spec.window}"
    why = (f"its longest sequence{' (in this split)' if space.views is not None else ''} has {longest} steps, "
           f"fewer than the {spec.span} a window reads ({span})" if space.n else "it has no sequence")
    fits = (longest - spec.horizon) // spec.window_multiple * spec.window_multiple  # the longest window that fits
    smaller = f", or window={fits} or less" if fits > 0 else ""
    if smaller and spec.min_window is not None:  # min_window only draws crop lengths within a window
        smaller += f" (and min_window={min(fits, spec.min_window)} or less)" if spec.min_window > fits else \
            " (min_window only draws crop lengths within the window: it does not lower this)"
    return (f"{name!r} has no windows but a share of {share} windows per epoch: {why}. Pass crops=sw.Crops(pad=True) "
            f"(one window per shorter sequence, padded and masked){smaller}, or leave it out of the mix")


@check_keywords()
def make_plan(lengths: np.ndarray | None, shard_starts: np.ndarray, config: PlanConfig, epoch: int,
              views: tuple[np.ndarray, np.ndarray] | None = None, *, space: WindowSpace | None = None) -> Plan:
    """Plan one epoch of one source. ``shard_starts[k]`` is the first sequence of shard k (with a final total).

    ``views`` = (first step, number of steps) per sequence restricts windows to part of each
    sequence (a split: 0 steps excludes a sequence; a temporal holdout keeps a prefix or suffix).
    ``space``, the source's WindowSpace built once, replaces ``lengths`` and ``views``: then
    planning an epoch costs O(slices), nothing per sequence.
    """
    if space is None:
        space = WindowSpace(np.asarray(lengths, dtype=np.int64), config.spec,
                            None if views is None else array_views(*views))
    elif space.spec != config.spec:
        raise ValueError(f"the window space was built for {space.spec}, the plan asks for {config.spec}")
    return plan_epoch(config, epoch, [space], [shard_starts])


def rest_plan(base: Plan, batches_per_rank: int, config: PlanConfig) -> Plan:
    """The rest of ``base``'s epoch after each rank took ``batches_per_rank`` batches, dealt over ``config``'s world.

    Elastic resume: per source, every window ``base`` had not yielded (and meant to) is dealt once
    over the new streams at the same weights, balanced to the window as in a fresh plan; blocks
    are shuffled anew (the generation joins their RNG key). What the new streams cannot take as
    whole batches (fewer than streams * batch_size) is dropped, or with equalize="pad" filled with
    repeats.
    """
    check_elastic(base.config, config)
    used = base.used(batches_per_rank)
    orders = [RestOrder(p, u) for p, u in zip(base.sources, used)]
    return deal(config, base.epoch, base.weights, orders, [p.space for p in base.sources], base.generation + 1)


def rest_plans(plan: Plan, runs: Sequence, configs: Sequence[PlanConfig], skip: int = 0) -> Plan:
    """``plan`` after the interrupted runs of its epoch (each {"inputs", "batches": taken by then}), the one after
    run r dealt over ``configs[r]``; the first ``skip`` runs only name the data (none was taken in them)."""
    before = [0] + [int(r["batches"]) for r in runs]
    for run, nxt, taken in list(zip(runs, configs, before))[skip:]:
        plan = rest_plan(plan, int(run["batches"]) - taken, nxt)
    return plan


def check_elastic(old: PlanConfig, new: PlanConfig) -> None:
    """Refuse to deal an interrupted epoch's rest under another window spec, seed or shuffle."""
    if new.spec != old.spec or new.seed != old.seed or new.shuffle != old.shuffle:
        raise ValueError("an elastic resume keeps the window spec, seed and shuffle of the interrupted plan")
