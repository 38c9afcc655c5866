"""The ``inspect`` verb: summarize a dataset, and what a window spec makes of it.

For each dataset: shards, sequences, steps, dtype, value columns, NaN/inf counts and a text
histogram of sequence lengths (``--png`` also draws it). With ``--window``, the epoch's plan
for that spec: windows, short sequences, streams, batches per rank, dropped or repeated
windows. With several datasets and ``--window``, what mixing them makes of an epoch: per
dataset its windows, its share and its repeat factor. Plans come from the library's planner
(pure, no I/O), so inspect is cheap however large the dataset.
"""
from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from streamwin.cli.args import (add_command, add_storage, add_window, int_at_least, storage_options, streams_per_rank,
                                weights_arg)
from streamwin.cli.report import fields_line, growth_line, layout, mb, nonfinite_shards, value_columns
from streamwin.errors import StreamwinError
from streamwin.formats.manifest import Manifest, check_mixable
from streamwin.plan.epoch import make_plan, plan_epoch
from streamwin.plan.options import (DEFAULT_CANONICAL, PlanConfig, WindowSpec, canonical_for, check_canonical,
                                    stream_block)
from streamwin.plan.space import WindowSpace
from streamwin.read.frames import zstd_slice_windows
from streamwin.storage.manifests import load_manifest

SHUFFLE_BUFFER = 10_000  # WindowDataset's default: its read slices are an eighth of it (or more, for zstd)


def cmd_inspect(args: argparse.Namespace) -> int:
    """Summarize each dataset, then what mixing them makes of an epoch."""
    if len(args.url) > 1 and args.png:
        raise StreamwinError("--png draws one dataset's histogram: inspect one URL at a time")
    if args.weights is not None and len(args.weights) != len(args.url):
        raise StreamwinError(f"--weights lists {len(args.weights)} numbers for {len(args.url)} URLs")
    manifests = [load_manifest(url, storage_options(args.storage_option)) for url in args.url]
    try:  # what training would refuse, refused here with the same message
        check_mixable(args.url, manifests)
    except ValueError as e:
        raise StreamwinError(str(e)) from None
    for i, (url, m) in enumerate(zip(args.url, manifests)):
        if i:
            print()
        _inspect_one(url, m, args)
    if len(args.url) > 1 and args.window is not None:
        _inspect_mix(args, manifests)
    return 0


def _spec_config(args: argparse.Namespace, manifests: list[Manifest]) -> PlanConfig:
    """The window spec and plan config the inspect options ask for: WindowDataset's for them (its canonical
    streams, its default read slices), so that the numbers are those of ``summary()``."""
    spec = WindowSpec(args.window, args.stride or args.window, args.horizon, args.pad)
    canonical = canonical_for(args.canonical, args.world_size)
    slices = max([SHUFFLE_BUFFER // 8, *(zstd_slice_windows(m, spec.stride) for m in manifests)])
    try:
        return PlanConfig(spec=spec, batch_size=args.batch_size, world_size=args.world_size,
                          num_workers=args.num_workers, seed=args.seed, equalize=args.equalize, canonical=canonical,
                          block_windows=stream_block(SHUFFLE_BUFFER, canonical, None), slice_windows=slices)
    except ValueError as e:  # a world or worker count the canonical streams cannot serve
        raise StreamwinError(str(e)) from None


def _streams(cfg: PlanConfig, args: argparse.Namespace) -> str:
    """The streams line: the canonical ones (and what they serve), or one per rank and worker."""
    ranks = f"{args.world_size} rank(s) x {streams_per_rank(args.num_workers)}"
    if cfg.canonical is None:
        return f"{cfg.num_streams:,} ({ranks}; their order depends on the world size and worker count)"
    slots, phases = cfg.canonical
    worlds = ", ".join(str(w) for w in range(1, slots + 1) if slots % w == 0)
    workers = "any workers" if phases == 1 else \
        f"workers {', '.join(str(w) for w in range(1, phases + 1) if phases % w == 0)} or 0"
    return (f"{cfg.num_streams:,} canonical ({slots} rank slot(s) x {phases} step phase(s): the same global batches "
            f"on {worlds} ranks, {workers}); here {ranks}")


def _inspect_mix(args: argparse.Namespace, manifests: list[Manifest]) -> None:
    """What mixing the datasets makes of an epoch: per source its windows, share and repeat factor."""
    cfg = _spec_config(args, manifests)
    spaces = [WindowSpace(m.length, cfg.spec) for m in manifests]
    try:
        plan = plan_epoch(cfg, 0, spaces, [m.shard_starts for m in manifests], args.weights, args.epoch_windows,
                          args.url)
    except ValueError as e:
        raise StreamwinError(str(e)) from None
    print()
    print("mixed        " + ("weights " + ", ".join(f"{w:g}" for w in plan.weights) if args.weights else
                             "no weights: every window of every source once"))
    width = max(len(u) for u in args.url)
    print(f"  {'source':<{width}}  {'windows':>12}  {'share':>12}  {'repeat':>8}")
    for url, p in zip(args.url, plan.sources):
        windows, share = p.space.total, p.total_windows
        repeat = f"{share / windows:.3f}" if windows else "-"
        print(f"  {url:<{width}}  {windows:>12,}  {share:>12,}  {repeat:>8}")
    print(f"  per epoch          {plan.total_windows:,}")
    print(f"  batches per rank   {plan.batches_per_rank:,} (batch size {args.batch_size})")
    print(f"  dropped windows    {plan.dropped_windows:,} ({100 * plan.dropped_windows / max(plan.total_windows, 1):.2f}%)")


def _inspect_one(url: str, m: Manifest, args: argparse.Namespace) -> None:
    """One dataset's summary (and its plan for the window spec)."""
    lengths = m.length
    print(f"dataset      {url}")
    print(f"shards       {len(m.shards):,}  ({mb(sum(s.bytes for s in m.shards))})")
    print(f"sequences    {m.num_sequences:,}  (dropped empty at pack time: {m.dropped_empty:,})")
    print(f"steps        {m.num_steps:,}")
    print(f"dtype        {layout(m)}  ({m.step_bytes} bytes per step)")
    if m.value_columns is not None:
        print(f"columns      {value_columns(m)}")
    if m.fields is not None:
        print(f"fields       {fields_line(m)}")
    if m.growth is not None:
        print(f"grown        {growth_line(m)}")
    if m.nonfinite is None:
        print("NaN/inf      not counted (packed by an older streamwin)")
    elif m.nonfinite.nan or m.nonfinite.inf:
        print(f"NaN/inf      {m.nonfinite.nan:,} NaN, {m.nonfinite.inf:,} inf  (in {nonfinite_shards(m)})")
    else:
        print("NaN/inf      none")
    if len(lengths):
        print(f"length       min {lengths.min():,}  median {int(np.median(lengths)):,}  mean {lengths.mean():,.1f}  "
              f"max {lengths.max():,}")
        print("length histogram (log-spaced bins):")
        for line in length_histogram(lengths):
            print("  " + line)
    if args.window is not None:
        cfg = _spec_config(args, [m])
        spec = cfg.spec
        plan = make_plan(m.length, m.shard_starts, cfg, 0)
        short = int(((m.length < spec.span) & (m.length > 0)).sum())
        print(f"windows      window {spec.window}, stride {spec.stride}, horizon {spec.horizon}"
              + (", padded" if spec.pad else ""))
        print(f"  per epoch          {plan.total_windows:,}")
        print(f"  short sequences    {short:,} " + ("(one padded window each)" if spec.pad else
                                                     f"(shorter than {spec.span} steps: no window)"))
        print(f"  streams            {_streams(cfg, args)}")
        print(f"  batches per rank   {plan.batches_per_rank:,} (batch size {args.batch_size})")
        print(f"  dropped windows    {plan.dropped_windows:,} ({100 * plan.dropped_windows / max(plan.total_windows, 1):.2f}%)")
        if args.equalize == "pad":
            print(f"  repeated windows   {plan.repeated_windows:,}")
    if args.png:
        _histogram_png(lengths, args.png, url)
        print(f"wrote {args.png}")


def length_histogram(lengths: np.ndarray, bins: int = 12, width: int = 40) -> list[str]:
    """Text histogram of sequence lengths in log-spaced bins ``[lo, hi)``."""
    lo, hi = max(int(lengths.min()), 1), int(lengths.max())
    edges = np.unique(np.round(np.geomspace(lo, hi + 1, bins + 1)).astype(np.int64))
    if len(edges) < 2:
        edges = np.array([lo, hi + 1])
    counts, _ = np.histogram(lengths, bins=edges)
    zeros = int((lengths < lo).sum())
    rows = ([("0", zeros)] if zeros else []) + [(f"[{a:,}, {b:,})", int(c)) for a, b, c in zip(edges[:-1], edges[1:], counts)]
    label_w = max(len(label) for label, _ in rows)
    top = max(c for _, c in rows) or 1
    return [f"{label:>{label_w}}  {c:>10,}  {'#' * round(width * c / top)}" for label, c in rows]


def _histogram_png(lengths: np.ndarray, path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise StreamwinError("--png needs matplotlib: pip install 'streamwin[plot]'") from e
    positive = lengths[lengths > 0]
    fig, ax = plt.subplots(figsize=(7, 4))
    if len(positive):
        ax.hist(positive, bins=np.geomspace(positive.min(), positive.max() + 1, 40))
    ax.set_xscale("log")
    ax.set_xlabel("sequence length (steps)")
    ax.set_ylabel("sequences")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_inspect_command(sub: Any) -> None:
    """The subcommand inspect, with its options."""
    p = add_command(sub, "inspect", cmd_inspect, "summarize a dataset, and what a window spec makes of it")
    p.add_argument("url", nargs="+", help="one dataset, or several: then also what mixing them makes of an epoch")
    p.add_argument("--weights", type=weights_arg, help="mixing weights, one per URL (e.g. 0.7,0.3; default: none)")
    p.add_argument("--epoch-windows", type=int_at_least(1), help="windows of a mixed epoch (default: all)")
    add_window(p, required=False)
    p.add_argument("--world-size", type=int_at_least(1), default=1, help="ranks to plan for (default 1)")
    p.add_argument("--equalize", choices=["drop", "pad"], default="drop", help="how ranks get equal batch counts")
    p.add_argument("--canonical", type=canonical_arg, default=DEFAULT_CANONICAL, metavar="auto|none|A,P",
                   help="canonical streams, as sw.Order(canonical=...): auto (the default: (8, 1) where the world "
                        "divides 8), none (one stream per rank and worker), or A,P rank slots and step phases")
    p.add_argument("--png", metavar="FILE", help="also save the length histogram as a PNG (needs matplotlib)")
    add_storage(p)


def canonical_arg(text: str) -> tuple[int, int] | str | None:
    """``--canonical``: auto, none, or two integers A,P."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    try:
        slots, phases = (int(v) for v in text.split(","))
        return check_canonical((slots, phases))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, none or two integers A,P of 1..4096, got {text!r}") from None
