"""The verbs that write or check a dataset: ``pack``, ``merge``, ``compact``, ``index`` and ``verify``.

Each is a thin layer over the library function of the same name that prints what it did in
one or two lines; ``pack --verify`` re-reads the shards it wrote, ``pack --append`` and
``--extend`` add to the dataset there. A verify failure lists every failing shard on stderr
and exits with 2.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import Any

from streamwin.cli.args import (add_command, add_storage, dtype_arg, int_at_least, key_value, option_value, parse_size,
                                part_arg, storage_options)
from streamwin.cli.report import continuations, grown, layout, mb, nonfinite_shards, value_columns
from streamwin.errors import ShardError
from streamwin.packing.inputs import FORMATS
from streamwin.packing.compact import compact
from streamwin.packing.pack import MissingValuesWarning, NonFiniteWarning, missing_values, pack
from streamwin.packing.parts import merge
from streamwin.packing.scan import index_shards, verify
from streamwin.storage.urls import reach


def cmd_pack(args: argparse.Namespace) -> int:
    """Pack SRC into DEST and say what was written (then verify it with ``--verify``)."""
    part = args.part
    options = {k: option_value(v) for k, v in args.option or []}
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteWarning)  # said below, in this command line's words
        warnings.simplefilter("ignore", MissingValuesWarning)
        m = pack(args.src, args.dest, shard_bytes=args.shard_size, format=args.format, workers=args.workers,
                 compression=None if args.compression == "none" else args.compression, cast=args.cast,
                 empty=args.empty, nan=args.nan, part=part, storage_options=storage_options(args.storage_option),
                 progress=not args.no_progress, engine=args.engine, address=args.address, overwrite=args.overwrite,
                 create_bucket=args.create_bucket, mode=args.mode, gaps=args.gaps, **options)
    seconds = time.perf_counter() - start
    nbytes = sum(s.bytes for s in m.shards)
    what = f"part {part[0]}/{part[1]}: " if part else ""
    if args.mode is not None and m.growth is not None and len(m.growth.views) > 1:
        print(f"{what}{grown(m)} at {args.dest} in {seconds:.1f} s; it holds {m.num_sequences:,} sequences "
              f"({m.num_steps:,} steps, {layout(m)}) in {len(m.shards):,} shards, {mb(nbytes)}")
    else:
        print(f"{what}packed {m.num_sequences:,} sequences ({m.num_steps:,} steps, {layout(m)}) into "
              f"{len(m.shards):,} shards, {mb(nbytes)}, at {args.dest} in {seconds:.1f} s "
              f"({nbytes / 1e6 / max(seconds, 1e-9):,.1f} MB/s)")
    if m.dropped_empty:
        print(f"skipped {m.dropped_empty:,} empty (zero-length) sequences")
    if m.value_columns is not None:
        print(f"value columns: {value_columns(m)}; to choose: --option value_columns=NAME or "
              """--option 'value_columns=["A","B"]'""")
    if m.nonfinite.nan or m.nonfinite.inf:
        print(f"NaN/inf: {m.nonfinite.nan:,} NaN and {m.nonfinite.inf:,} inf values, in {nonfinite_shards(m)} "
              "(pass --nan raise to refuse them)")
    if m.fields is not None and m.fields.missing:
        print(missing_values(m).removeprefix("streamwin: "))
    if part:
        print(f"when all {part[1]} parts are done: streamwin merge {args.dest}"
              + (f"; then streamwin verify {args.dest}" if args.verify else ""))
        return 0
    if args.verify:
        return _verify(args.dest, args)
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    """Merge the part indexes at DEST into index.json."""
    reach(args.dest, storage_options(args.storage_option))
    m = merge(args.dest, storage_options=storage_options(args.storage_option))
    print(f"merged {len(m.shards):,} shards, {m.num_sequences:,} sequences ({m.num_steps:,} steps, {layout(m)}), "
          f"{mb(sum(s.bytes for s in m.shards))}, into {args.dest.rstrip('/')}/index.json")
    return 0


def cmd_compact(args: argparse.Namespace) -> int:
    """Merge the continuation members of URL's extended sequences into one member each."""
    start = time.perf_counter()
    reach(args.url, storage_options(args.storage_option))
    before = continuations(args.url, storage_options(args.storage_option))
    m = compact(args.url, storage_options=storage_options(args.storage_option), progress=not args.no_progress)
    if not before:
        print(f"{args.url}: no sequence has continuation members; nothing to compact")
        return 0
    seconds = time.perf_counter() - start
    print(f"compacted {before:,} continuation members into their sequences' members in {seconds:.1f} s: "
          f"{len(m.shards):,} shards, {mb(sum(s.bytes for s in m.shards))}; reads are the same byte for byte")
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    """Write index.json for the tar shards at URL."""
    start = time.perf_counter()
    reach(args.url, storage_options(args.storage_option))
    m = index_shards(args.url, pattern=args.pattern, storage_options=storage_options(args.storage_option),
                     progress=not args.no_progress)
    print(f"indexed {len(m.shards):,} shards, {m.num_sequences:,} sequences ({m.num_steps:,} steps, {layout(m)}), "
          f"{mb(sum(s.bytes for s in m.shards))}, in {time.perf_counter() - start:.1f} s; "
          f"wrote {args.url.rstrip('/')}/index.json")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Check every shard at URL against index.json."""
    return _verify(args.url, args)


def _verify(url: str, args: argparse.Namespace) -> int:
    reach(url, storage_options(args.storage_option))
    try:
        r = verify(url, storage_options=storage_options(args.storage_option), progress=not args.no_progress)
    except ShardError as e:
        failures = getattr(e, "failures", [e])
        print(f"streamwin verify: FAILED: {len(failures)} shard(s) disagree with the manifest", file=sys.stderr)
        for f in failures:
            print(f"  {f}", file=sys.stderr)
        return 2
    print(f"verified {r['shards']:,} shards, {r['sequences']:,} sequences, {r['steps']:,} steps, {mb(r['bytes'])}: "
          f"sizes, checksums, members and headers match the manifest ({r['mb_per_s']:,.1f} MB/s)")
    return 0


def add_pack_commands(sub: Any) -> None:
    """The subcommands pack, merge, index and verify, with their options."""
    _add_pack(sub)
    p = add_command(sub, "merge", cmd_merge, "write index.json from the part indexes of `pack --part i/n`")
    p.add_argument("dest")
    add_storage(p)

    p = add_command(sub, "compact", cmd_compact, "merge the continuation members of extended sequences (pack --extend) "
                    "into one member each, atomically")
    p.add_argument("url")
    p.add_argument("--no-progress", action="store_true")
    add_storage(p)

    p = add_command(sub, "index", cmd_index, "write index.json for existing tar shards with .npy members (e.g. from webdataset)")
    p.add_argument("url")
    p.add_argument("--pattern", default="*.tar", help="shard file glob under URL (default *.tar)")
    p.add_argument("--no-progress", action="store_true")
    add_storage(p)

    p = add_command(sub, "verify", cmd_verify, "re-read every shard and check sizes, checksums, members and headers against index.json")
    p.add_argument("url")
    p.add_argument("--no-progress", action="store_true")
    add_storage(p)


def _add_pack(sub: Any) -> None:
    """The pack subcommand and its options."""
    p = add_command(sub, "pack", cmd_pack, "pack an input (directory, file or URL) into tar shards and index.json")
    p.add_argument("src", help="directory, file, URL or glob of .npy/.npz/parquet/arrow/csv/jsonl/text files")
    p.add_argument("dest", help="dataset root: local path or fsspec URL (s3://, gs://, memory://, ...)")
    p.add_argument("--shard-size", type=parse_size, default=256 << 20, metavar="SIZE",
                   help="close a shard once it holds this many bytes (default 256MiB)")
    p.add_argument("--workers", type=int_at_least(1), default=1,
                   help="processes packing units of the input on this machine (default 1)")
    p.add_argument("--engine", choices=["ray", "dask"],
                   help="run the units as tasks on a Ray or Dask cluster (--address, else a local one); same bytes")
    p.add_argument("--address", metavar="ADDR", help="the cluster for --engine: ray://host:10001, tcp://scheduler:8786")
    p.add_argument("--format", choices=[f for f in FORMATS if f not in ("iterable", "table")], help="input format (default: detected)")
    p.add_argument("--compression", choices=["none", "zstd"], default="none", help="per-member compression")
    p.add_argument("--cast", type=dtype_arg, metavar="DTYPE", help="convert every array to DTYPE (e.g. float32) instead of refusing a mismatch")
    p.add_argument("--empty", choices=["skip", "error"], default="skip",
                   help="zero-length sequences: skip and count them (default) or fail")
    p.add_argument("--nan", choices=["count", "raise"], default="count",
                   help="NaN and inf values: count them in index.json (default) or fail, naming the first")
    p.add_argument("--part", type=part_arg, metavar="I/N", help="pack part I of N of the input files (then: streamwin merge DEST)")
    p.add_argument("--option", action="append", type=key_value, metavar="KEY=VALUE",
                   help="input option, e.g. id_column=series or value_columns='[\"a\",\"b\"]' (repeatable)")
    p.add_argument("--verify", action="store_true", help="re-read the shards afterwards and check them against index.json")
    grow = p.add_mutually_exclusive_group()
    grow.add_argument("--append", dest="mode", action="store_const", const="append",
                      help="add the input's sequences to the dataset at DEST (new keys only), writing only their "
                      "shards")
    grow.add_argument("--extend", dest="mode", action="store_const", const="extend",
                      help="as --append, and a key DEST holds gets the input's steps as a continuation of its sequence")
    p.add_argument("--gaps", choices=["error", "allow"], default="error",
                   help="--extend: refuse steps whose start/freq do not continue their sequence (error), or allow them")
    p.add_argument("--overwrite", action="store_true",
                   help="replace files at DEST that are not this dataset's, and discard parts not merged "
                        "(refused otherwise, naming them)")
    p.add_argument("--create-bucket", action="store_true", help="create DEST's object-store bucket if it does not exist")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_storage(p)
