"""The ``streamwin`` command: pack, merge, index, verify, inspect and bench a dataset.

    streamwin pack data/ecg/ s3://bucket/ecg/ --shard-size 256MB --workers 4
    streamwin inspect s3://bucket/ecg/ --window 512 --stride 256 --batch-size 64 --world-size 8
    streamwin inspect s3://bucket/ecg/ s3://bucket/eeg/ --weights 0.7,0.3 --window 512
    streamwin bench s3://bucket/ecg/ --window 512 --batches 200

Each subcommand is a thin layer over the library function of the same name, defined with its
options in one module (``pack``: pack, merge, index, verify; ``inspect``; ``bench``); ``args``
holds the argparse types and shared options, ``report`` how a dataset is described. Only
``bench`` imports torch (seconds), so the others start at once. Exit codes: 0 success, 2 usage
errors and errors about the data or the storage (the message says what and where, on stderr,
in this command line's option names), 130 interrupted, 141 output pipe closed (``| head``).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Sequence

from streamwin.arguments import did_you_mean
from streamwin.cli.args import cli_words, parse_size, storage_options
from streamwin.cli.bench import add_bench_command
from streamwin.cli.inspect import add_inspect_command
from streamwin.cli.pack import add_pack_commands
from streamwin.errors import ManifestError, StreamwinError
from streamwin.packing.parts import part_indexes

__all__ = ["build_parser", "main", "parse_size"]


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="streamwin", description="Pack variable-length sequences into tar shards and stream sliding windows from them.",
        epilog="Sizes: 256MB (decimal), 1GiB or 64M (binary), or bytes. Exit codes: 0 ok, 2 error, 130 interrupted.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_pack_commands(sub)
    add_inspect_command(sub)
    add_bench_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # said by the subcommand, with its usage and the option probably meant
            args.command_parser.error(unrecognized(args.command_parser, unknown))
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
    except Exception as e:
        if not isinstance(e, (StreamwinError, OSError, ValueError, ImportError)) and not _storage_error(e):
            raise
        # data, storage and argument-value errors: one clear line, no traceback
        kind = "" if isinstance(e, StreamwinError) else f"{type(e).__name__}: "
        message = _unmerged_parts(args, e) or cli_words(str(e))
        print(f"streamwin {args.command}: error: {kind}{message}", file=sys.stderr)
        return 2


def unrecognized(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """The usage error for arguments a subcommand does not take, with the close option for each typo."""
    options = set(re.findall(r"--[\w-]+", parser.format_usage()))
    hints = "".join(did_you_mean(arg.split("=", 1)[0], options) for arg in unknown if arg.startswith("--"))
    return f"unrecognized arguments: {' '.join(unknown)}{hints}"


def _storage_error(e: Exception) -> bool:
    """An error of a storage client library (botocore, aiohttp, s3fs, gcsfs...): the storage's problem, said in
    one line like ours."""
    return type(e).__module__.split(".")[0] in {"botocore", "aiobotocore", "aiohttp", "s3fs", "fsspec", "urllib3",
                                                "gcsfs", "adlfs", "google", "azure", "requests"}


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
        names = part_indexes(url, storage_options=storage_options(args.storage_option))
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
