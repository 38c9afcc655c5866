"""The ``bench`` verb: measure a dataset's loading throughput for a window spec.

Loads batches with ``WindowDataset`` and ``WindowLoader`` on one rank and prints windows/s,
batches/s and MB/s of batch data, the rate taken after the first batch (which pays for the
manifest, the plan and the first reads). The only verb that imports torch: it does so when
it runs, so that the other verbs start at once.
"""
from __future__ import annotations

import argparse
import time
from typing import Any

from streamwin.cli.args import add_command, add_storage, add_window, int_at_least, storage_options
from streamwin.errors import StreamwinError
from streamwin.progress import progress_bar
from streamwin.storage.manifests import load_manifest


def cmd_bench(args: argparse.Namespace) -> int:
    """Load up to ``--batches`` batches on one rank and print the throughput."""
    load_manifest(args.url, storage_options(args.storage_option))  # a store that cannot be read fails before torch
    from streamwin.dataset import WindowDataset  # torch, seconds to import: only the verb that loads batches pays for it
    from streamwin.loader import WindowLoader
    from streamwin.options import Crops, Read

    start = time.perf_counter()
    ds = WindowDataset(args.url, window=args.window, stride=args.stride, horizon=args.horizon,
                       batch_size=args.batch_size, shuffle_buffer=args.shuffle_buffer, seed=args.seed,
                       rank=0, world_size=1, crops=Crops(pad=args.pad),
                       read=Read(storage_options=storage_options(args.storage_option)))
    loader = WindowLoader(ds, num_workers=args.num_workers)
    total = min(len(loader), args.batches) if args.batches else len(loader)
    windows = nbytes = batches = 0
    first = None
    with progress_bar(total=total, desc=f"bench {args.url}", unit="batch", disable=args.no_progress) as bar:
        for batch in loader:
            if first is None:
                first = time.perf_counter()
            windows += len(batch["x"])
            nbytes += batch["x"].nbytes + (batch["y"].nbytes if "y" in batch else 0)
            batches += 1
            bar.update()
            if batches >= total:
                break
    end = time.perf_counter()
    if first is None:
        raise StreamwinError(f"no batches: the dataset at {args.url} has {len(loader)} batches for this window spec "
                             "(try a smaller --window or --batch-size; `streamwin inspect` shows why)")
    # the rate excludes the first batch, which pays for start-up (manifest, plan, first reads)
    steady = max(end - first, 1e-9)
    rate = (windows - len(batch["x"])) / steady if batches > 1 else windows / max(end - start, 1e-9)
    mb_s = (nbytes * (batches - 1) / batches) / 1e6 / steady if batches > 1 else nbytes / 1e6 / max(end - start, 1e-9)
    print(f"{batches:,} batches, {windows:,} windows of {args.window} steps in {end - start:.2f} s "
          f"(first batch after {first - start:.2f} s)")
    print(f"{rate:,.0f} windows/s, {rate / args.batch_size:,.1f} batches/s, {mb_s:,.1f} MB/s of batch data "
          f"(num_workers={args.num_workers})")
    return 0


def add_bench_command(sub: Any) -> None:
    """The subcommand bench, with its options."""
    p = add_command(sub, "bench", cmd_bench, "measure this dataset's loading throughput for a window spec")
    p.add_argument("url")
    add_window(p, required=True)
    p.add_argument("--shuffle-buffer", type=int_at_least(1), default=10_000, help="windows per shuffle block (default 10000)")
    p.add_argument("--batches", type=int_at_least(0), default=200, help="stop after this many batches (0: a whole epoch; default 200)")
    p.add_argument("--no-progress", action="store_true")
    add_storage(p)
