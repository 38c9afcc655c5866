"""The ``streamwin`` command: pack, merge, index, verify, inspect and bench a dataset.

    streamwin pack data/ecg/ s3://bucket/ecg/ --shard-size 256MB --workers 4
    streamwin inspect s3://bucket/ecg/ --window 512 --stride 256 --batch-size 64 --world-size 8
    streamwin inspect s3://bucket/ecg/ s3://bucket/eeg/ --weights 0.7,0.3 --window 512
    streamwin bench s3://bucket/ecg/ --window 512 --batches 200

Each subcommand is a thin layer over the library function of the same name; only ``bench``
imports torch (seconds), so the others start at once. Exit codes: 0 success, 2 usage errors
and errors about the data or the storage (the message says what and where, on stderr, in
this command line's option names), 130 interrupted, 141 output pipe closed (``| head``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import warnings
from typing import Any, Sequence

import numpy as np
from tqdm.auto import tqdm

from streamwin.errors import ManifestError, PackError, ShardError, StreamwinError
from streamwin.packing.scan import index_shards, verify
from streamwin.packing.pack import NonFiniteWarning, merge, pack
from streamwin.packing.parts import parse_part, part_indexes
from streamwin.plan.mix import plan_epoch
from streamwin.plan.epoch import PlanConfig, WindowIndex, WindowSpec, make_plan
from streamwin.packing.inputs import FORMATS, SOURCE_OPTIONS
from streamwin.storage.manifests import load_manifest

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """``"256MB"`` -> 256_000_000, ``"1GiB"`` -> 2**30, ``"64M"`` -> 64 * 2**20, ``"4096"`` -> 4096.

    KB/MB/GB/TB are decimal, KiB/MiB/GiB/TiB and the bare letters K/M/G/T binary (as in ``split -b``).
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and _UNITS.get(m.group(2).lower())
    if not unit:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 256MB, 1GiB, 64M, 1048576)")
    value = int(float(m.group(1)) * unit)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def _weights(text: str) -> list[float]:
    """An argparse type: comma-separated weights >= 0, not all 0 (e.g. 0.7,0.3)."""
    try:
        values = [float(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not all(np.isfinite(v) and v >= 0 for v in values) or not sum(values) > 0:
        raise argparse.ArgumentTypeError(f"expected numbers >= 0, not all 0, got {text!r}")
    return values


def _int_at_least(low: int):
    """An argparse type: a whole number >= ``low`` (argparse names the option in its error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value
    return parse


def _part(text: str) -> tuple[int, int]:
    """An argparse type: ``I/N`` with 0 <= I < N."""
    try:
        return parse_part(text)
    except PackError as e:
        raise argparse.ArgumentTypeError(f"{e} (--part I/N packs part I of N, counted from 0)") from None


def _dtype(text: str) -> str:
    """An argparse type: a numeric numpy dtype name such as float32."""
    try:
        dtype = np.dtype(text)
    except TypeError:
        raise argparse.ArgumentTypeError(f"not a numpy dtype: {text!r} (e.g. float32, int64)") from None
    if dtype.hasobject or dtype.kind not in "biufc":
        raise argparse.ArgumentTypeError(f"{text!r} is not numeric: only numeric dtypes can be packed")
    return text


# library keyword -> this command line's option, for messages that tell the user what to pass
_OPTION_OF = {"shard_bytes": "--shard-size", "format": "--format", "workers": "--workers",
              "compression": "--compression", "cast": "--cast", "empty": "--empty", "part": "--part", "nan": "--nan",
              "storage_options": "--storage-option"}
_KEYWORD = re.compile(r"(?<![\w-])(%s)=('[^']*'|\"[^\"]*\"|[^\s,;)]*)"
                      % "|".join(sorted({*_OPTION_OF, *SOURCE_OPTIONS}, key=len, reverse=True)))


def cli_words(message: str) -> str:
    """A library message in this command line's words: ``empty='skip'`` -> ``--empty skip``,
    ``cast=`` -> ``--cast``, a source option ``id_column=`` -> ``--option id_column=``."""
    def option(m: re.Match) -> str:
        name, value = m.group(1), m.group(2).strip("'\"")
        if name in _OPTION_OF:
            return f"{_OPTION_OF[name]} {value}".rstrip()
        return f"--option {name}={value}"
    return _KEYWORD.sub(option, message)


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    return key.strip(), value


def _source_value(value: str) -> Any:
    """A JSON list, object, true/false/null is parsed; anything else (numbers too) stays a string."""
    if value[:1] in "[{" or value in ("true", "false", "null"):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise StreamwinError(f"option value {value!r} is not valid JSON: {e}") from e
    return value


def _storage_options(pairs: list[tuple[str, str]] | None) -> dict | None:
    """``a.b=1`` pairs -> {"a": {"b": 1}}; values are JSON when they parse, else strings."""
    if not pairs:
        return None
    out: dict = {}
    for key, value in pairs:
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        *path, last = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = parsed
    return out


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.1f} MB"


# ---- subcommands -------------------------------------------------------------------------------

def cmd_pack(args: argparse.Namespace) -> int:
    part = args.part
    options = {k: _source_value(v) for k, v in args.option or []}
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteWarning)  # said below, in this command line's words
        m = pack(args.src, args.dest, shard_bytes=args.shard_size, format=args.format, workers=args.workers,
                 compression=None if args.compression == "none" else args.compression, cast=args.cast,
                 empty=args.empty, nan=args.nan, part=part, storage_options=_storage_options(args.storage_option),
                 progress=not args.no_progress, **options)
    seconds = time.perf_counter() - start
    nbytes = sum(s.bytes for s in m.shards)
    what = f"part {part[0]}/{part[1]}: " if part else ""
    print(f"{what}packed {m.num_sequences:,} sequences ({m.num_steps:,} steps, {_layout(m)}) into "
          f"{len(m.shards):,} shards, {_mb(nbytes)}, at {args.dest} in {seconds:.1f} s ({nbytes / 1e6 / max(seconds, 1e-9):,.1f} MB/s)")
    if m.dropped_empty:
        print(f"skipped {m.dropped_empty:,} empty (zero-length) sequences")
    if m.value_columns is not None:
        print(f"value columns: {_columns(m)}; to choose: --option value_columns=NAME or "
              """--option 'value_columns=["A","B"]'""")
    if m.nonfinite.nan or m.nonfinite.inf:
        print(f"NaN/inf: {m.nonfinite.nan:,} NaN and {m.nonfinite.inf:,} inf values, in {_nonfinite_shards(m)} "
              "(pass --nan raise to refuse them)")
    if part:
        print(f"when all {part[1]} parts are done: streamwin merge {args.dest}"
              + (f"; then streamwin verify {args.dest}" if args.verify else ""))
        return 0
    if args.verify:
        return _verify(args.dest, args)
    return 0


def _layout(m) -> str:
    shape = ", ".join(["T", *map(str, m.step_shape)])
    return f"{m.dtype.name} [{shape}]" + (", zstd" if m.compression else "")


def _name(column: str) -> str:
    """A column name as typed: quoted when it is empty or holds spaces or commas."""
    return column if column and column.isprintable() and not set(column) & set(" ,'\"") else repr(column)


def _columns(m) -> str:
    """``a, b  (left out: c (id column), ...)``: the value columns and the ones left out."""
    left_out = ", ".join(f"{_name(c)} ({why})" for c, why in (m.left_out_columns or {}).items())
    return ", ".join(map(_name, m.value_columns)) + (f"  (left out: {left_out})" if left_out else "")


def _nonfinite_shards(m) -> str:
    return f"{sum(1 for n in m.nonfinite.per_shard if n):,} of {len(m.shards):,} shards"


def cmd_merge(args: argparse.Namespace) -> int:
    m = merge(args.dest, storage_options=_storage_options(args.storage_option))
    print(f"merged {len(m.shards):,} shards, {m.num_sequences:,} sequences ({m.num_steps:,} steps, {_layout(m)}), "
          f"{_mb(sum(s.bytes for s in m.shards))}, into {args.dest.rstrip('/')}/index.json")
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    m = index_shards(args.url, pattern=args.pattern, storage_options=_storage_options(args.storage_option),
                     progress=not args.no_progress)
    print(f"indexed {len(m.shards):,} shards, {m.num_sequences:,} sequences ({m.num_steps:,} steps, {_layout(m)}), "
          f"{_mb(sum(s.bytes for s in m.shards))}, in {time.perf_counter() - start:.1f} s; "
          f"wrote {args.url.rstrip('/')}/index.json")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    return _verify(args.url, args)


def _verify(url: str, args: argparse.Namespace) -> int:
    try:
        r = verify(url, storage_options=_storage_options(args.storage_option), progress=not args.no_progress)
    except ShardError as e:
        failures = getattr(e, "failures", [e])
        print(f"streamwin verify: FAILED: {len(failures)} shard(s) disagree with the manifest", file=sys.stderr)
        for f in failures:
            print(f"  {f}", file=sys.stderr)
        return 2
    print(f"verified {r['shards']:,} shards, {r['sequences']:,} sequences, {r['steps']:,} steps, {_mb(r['bytes'])}: "
          f"sizes, checksums, members and headers match the manifest ({r['mb_per_s']:,.1f} MB/s)")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    if len(args.url) > 1 and args.png:
        raise StreamwinError("--png draws one dataset's histogram: inspect one URL at a time")
    if args.weights is not None and len(args.weights) != len(args.url):
        raise StreamwinError(f"--weights lists {len(args.weights)} numbers for {len(args.url)} URLs")
    manifests = []
    for i, url in enumerate(args.url):
        if i:
            print()
        manifests.append(_inspect_one(url, args))
    if len(args.url) > 1 and args.window is not None:
        _inspect_mix(args, manifests)
    return 0


def _spec_config(args: argparse.Namespace) -> PlanConfig:
    """The window spec and plan config the inspect options ask for."""
    spec = WindowSpec(args.window, args.stride or args.window, args.horizon, args.pad)
    return PlanConfig(spec=spec, batch_size=args.batch_size, world_size=args.world_size,
                      num_workers=args.num_workers, seed=args.seed, equalize=args.equalize)


def _inspect_mix(args: argparse.Namespace, manifests: list) -> None:
    """What mixing the datasets makes of an epoch: per source its windows, share and repeat factor."""
    cfg = _spec_config(args)
    indexes = [WindowIndex(m.length, cfg.spec) for m in manifests]
    try:
        plan = plan_epoch(cfg, 0, indexes, [m.shard_starts for m in manifests], args.weights, args.epoch_windows,
                          args.url)
    except ValueError as e:
        raise StreamwinError(str(e)) from None
    print()
    print("mixed        " + ("weights " + ", ".join(f"{w:g}" for w in plan.weights) if args.weights else
                             "no weights: every window of every source once"))
    width = max(len(u) for u in args.url)
    print(f"  {'source':<{width}}  {'windows':>12}  {'share':>12}  {'repeat':>8}")
    for url, p in zip(args.url, plan.plans):
        windows, share = p.index.total, p.total_windows
        repeat = f"{share / windows:.3f}" if windows else "-"
        print(f"  {url:<{width}}  {windows:>12,}  {share:>12,}  {repeat:>8}")
    print(f"  per epoch          {plan.total_windows:,}")
    print(f"  batches per rank   {plan.batches_per_rank:,} (batch size {args.batch_size})")
    print(f"  dropped windows    {plan.dropped_windows:,} ({100 * plan.dropped_windows / max(plan.total_windows, 1):.2f}%)")


def _inspect_one(url: str, args: argparse.Namespace):
    """One dataset's summary (and its plan for the window spec); returns its manifest."""
    m = load_manifest(url, _storage_options(args.storage_option))
    lengths = m.length
    print(f"dataset      {url}")
    print(f"shards       {len(m.shards):,}  ({_mb(sum(s.bytes for s in m.shards))})")
    print(f"sequences    {m.num_sequences:,}  (dropped empty at pack time: {m.dropped_empty:,})")
    print(f"steps        {m.num_steps:,}")
    print(f"dtype        {_layout(m)}  ({m.step_bytes} bytes per step)")
    if m.value_columns is not None:
        print(f"columns      {_columns(m)}")
    if m.nonfinite is None:
        print("NaN/inf      not counted (packed by an older streamwin)")
    elif m.nonfinite.nan or m.nonfinite.inf:
        print(f"NaN/inf      {m.nonfinite.nan:,} NaN, {m.nonfinite.inf:,} inf  (in {_nonfinite_shards(m)})")
    else:
        print("NaN/inf      none")
    if len(lengths):
        print(f"length       min {lengths.min():,}  median {int(np.median(lengths)):,}  mean {lengths.mean():,.1f}  "
              f"max {lengths.max():,}")
        print("length histogram (log-spaced bins):")
        for line in length_histogram(lengths):
            print("  " + line)
    if args.window is not None:
        cfg = _spec_config(args)
        spec = cfg.spec
        plan = make_plan(m.length, m.shard_starts, cfg, 0)
        short = int(((m.length < spec.span) & (m.length > 0)).sum())
        print(f"windows      window {spec.window}, stride {spec.stride}, horizon {spec.horizon}"
              + (", padded" if spec.pad else ""))
        print(f"  per epoch          {plan.total_windows:,}")
        print(f"  short sequences    {short:,} " + ("(one padded window each)" if spec.pad else
                                                     f"(shorter than {spec.span} steps: no window)"))
        print(f"  streams            {cfg.num_streams:,} ({args.world_size} rank(s) x {cfg.workers_per_rank} worker(s))")
        print(f"  batches per rank   {plan.batches_per_rank:,} (batch size {args.batch_size})")
        print(f"  dropped windows    {plan.dropped_windows:,} ({100 * plan.dropped_windows / max(plan.total_windows, 1):.2f}%)")
        if args.equalize == "pad":
            print(f"  repeated windows   {plan.repeated_windows:,}")
    if args.png:
        _histogram_png(lengths, args.png, url)
        print(f"wrote {args.png}")
    return m


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


def cmd_bench(args: argparse.Namespace) -> int:
    from streamwin.dataset import WindowDataset  # torch, seconds to import: only the verb that loads batches pays for it
    from streamwin.loader import WindowLoader

    start = time.perf_counter()
    ds = WindowDataset(args.url, window=args.window, stride=args.stride, horizon=args.horizon, pad=args.pad,
                       batch_size=args.batch_size, shuffle_buffer=args.shuffle_buffer, seed=args.seed,
                       rank=0, world_size=1, storage_options=_storage_options(args.storage_option))
    loader = WindowLoader(ds, num_workers=args.num_workers)
    total = min(len(loader), args.batches) if args.batches else len(loader)
    windows = nbytes = batches = 0
    first = None
    with tqdm(total=total, desc=f"bench {args.url}", unit="batch", disable=args.no_progress, file=sys.stderr,
              dynamic_ncols=True) as bar:
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


# ---- parser ------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamwin", description="Pack variable-length sequences into tar shards and stream sliding windows from them.",
        epilog="Sizes: 256MB (decimal), 1GiB or 64M (binary), or bytes. Exit codes: 0 ok, 2 error, 130 interrupted.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, func, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(func=func)
        return p

    def storage(p: argparse.ArgumentParser) -> None:
        p.add_argument("--storage-option", action="append", type=_key_value, metavar="KEY=VALUE",
                       help="fsspec option for the dataset URL (repeatable; a.b=v nests; JSON values parsed), "
                            "e.g. client_kwargs.endpoint_url=http://127.0.0.1:9000")

    def window(p: argparse.ArgumentParser, required: bool) -> None:
        g = p.add_argument_group("window spec")
        g.add_argument("--window", type=_int_at_least(1), required=required, help="steps per window")
        g.add_argument("--stride", type=_int_at_least(1), help="steps between window starts (default: --window)")
        g.add_argument("--horizon", type=_int_at_least(0), default=0, help="target steps after each window (default 0)")
        g.add_argument("--pad", action="store_true", help="one padded window for sequences shorter than window + horizon")
        g.add_argument("--batch-size", type=_int_at_least(1), default=64, help="windows per batch (default 64)")
        g.add_argument("--num-workers", type=_int_at_least(0), default=0, help="DataLoader workers per rank (default 0)")
        g.add_argument("--seed", type=_int_at_least(0), default=0)

    p = command("pack", cmd_pack, "pack a source (directory, file or URL) into tar shards and index.json")
    p.add_argument("src", help="directory or file of .npy/.npz/parquet/csv/jsonl/text, or a URL")
    p.add_argument("dest", help="dataset root: local path or fsspec URL (s3://, gs://, memory://, ...)")
    p.add_argument("--shard-size", type=parse_size, default=256 << 20, metavar="SIZE",
                   help="close a shard once it holds this many bytes (default 256MiB)")
    p.add_argument("--workers", type=_int_at_least(1), default=1, help="processes reading and encoding source files (default 1)")
    p.add_argument("--format", choices=[f for f in FORMATS if f != "iterable"], help="source format (default: detected)")
    p.add_argument("--compression", choices=["none", "zstd"], default="none", help="per-member compression")
    p.add_argument("--cast", type=_dtype, metavar="DTYPE", help="convert every array to DTYPE (e.g. float32) instead of refusing a mismatch")
    p.add_argument("--empty", choices=["skip", "error"], default="skip",
                   help="zero-length sequences: skip and count them (default) or fail")
    p.add_argument("--nan", choices=["count", "raise"], default="count",
                   help="NaN and inf values: count them in index.json (default) or fail, naming the first")
    p.add_argument("--part", type=_part, metavar="I/N", help="pack part I of N of the source files (then: streamwin merge DEST)")
    p.add_argument("--option", action="append", type=_key_value, metavar="KEY=VALUE",
                   help="source option, e.g. id_column=series or value_columns='[\"a\",\"b\"]' (repeatable)")
    p.add_argument("--verify", action="store_true", help="re-read the shards afterwards and check them against index.json")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    storage(p)

    p = command("merge", cmd_merge, "write index.json from the part indexes of `pack --part i/n`")
    p.add_argument("dest")
    storage(p)

    p = command("index", cmd_index, "write index.json for existing tar shards with .npy members (e.g. from webdataset)")
    p.add_argument("url")
    p.add_argument("--pattern", default="*.tar", help="shard file glob under URL (default *.tar)")
    p.add_argument("--no-progress", action="store_true")
    storage(p)

    p = command("verify", cmd_verify, "re-read every shard and check sizes, checksums, members and headers against index.json")
    p.add_argument("url")
    p.add_argument("--no-progress", action="store_true")
    storage(p)

    p = command("inspect", cmd_inspect, "summarize a dataset, and what a window spec makes of it")
    p.add_argument("url", nargs="+", help="one dataset, or several: then also what mixing them makes of an epoch")
    p.add_argument("--weights", type=_weights, help="mixing weights, one per URL (e.g. 0.7,0.3; default: none)")
    p.add_argument("--epoch-windows", type=_int_at_least(1), help="windows of a mixed epoch (default: all)")
    window(p, required=False)
    p.add_argument("--world-size", type=_int_at_least(1), default=1, help="ranks to plan for (default 1)")
    p.add_argument("--equalize", choices=["drop", "pad"], default="drop", help="how ranks get equal batch counts")
    p.add_argument("--png", metavar="FILE", help="also save the length histogram as a PNG (needs matplotlib)")
    storage(p)

    p = command("bench", cmd_bench, "measure this dataset's loading throughput for a window spec")
    p.add_argument("url")
    window(p, required=True)
    p.add_argument("--shuffle-buffer", type=_int_at_least(1), default=10_000, help="windows per shuffle block (default 10000)")
    p.add_argument("--batches", type=_int_at_least(0), default=200, help="stop after this many batches (0: a whole epoch; default 200)")
    p.add_argument("--no-progress", action="store_true")
    storage(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed by argparse
        return int(e.code or 0)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, so that a reader gone away (`| head`) is caught below
        return code
    except KeyboardInterrupt:
        print(f"streamwin {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout's reader has gone (`| head -1`): stop quietly, as Unix tools do
        _discard_stdout()
        return 141
    except (StreamwinError, OSError, ValueError, ImportError) as e:
        # data, storage and argument-value errors: one clear line, no traceback
        kind = "" if isinstance(e, StreamwinError) else f"{type(e).__name__}: "
        message = _unmerged_parts(args, e) or cli_words(str(e))
        print(f"streamwin {args.command}: error: {kind}{message}", file=sys.stderr)
        return 2


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush finds no broken pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no file descriptor (stdout replaced, as under pytest)
        pass


def _unmerged_parts(args: argparse.Namespace, error: Exception) -> str | None:
    """For a missing index.json where `pack --part` wrote part indexes: what is there and what to run."""
    url = getattr(args, "url", None)
    if isinstance(url, list):  # inspect of several datasets: the one the error is about
        url = next((u for u in url if u in str(error)), url[0])
    if url is None or not isinstance(error, ManifestError) or not isinstance(error.__cause__, FileNotFoundError):
        return None
    try:
        names = part_indexes(url, storage_options=_storage_options(args.storage_option))
    except Exception:  # the original error says more than a failure to list the directory would
        return None
    if not names:
        return None
    n = max(int(re.search(r"-of-(\d+)", name).group(1)) for name in names)
    todo = (f"run `streamwin merge {url}` to write it" if len(names) == n else
            f"when the other parts are packed, run `streamwin merge {url}`")
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return (f"{url} has no index.json but holds the output of `streamwin pack --part I/N`: {len(names)} of {n} "
            f"parts are done ({shown}); a dataset is complete only once merged: {todo}")


if __name__ == "__main__":
    sys.exit(main())
