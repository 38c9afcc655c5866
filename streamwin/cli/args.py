"""What the command line parses, and how it speaks: argparse types, shared options, messages.

Each argparse type raises ``ArgumentTypeError``, so argparse names the option in its usage
error (exit code 2). `cli_words` rewrites a library message in this command line's words:
``empty='skip'`` becomes ``--empty skip``, ``id_column=`` becomes ``--option id_column=``.
"""
from __future__ import annotations

import argparse
import json
import re
from typing import Any, Callable

import numpy as np

from streamwin.errors import PackError, StreamwinError
from streamwin.packing.inputs import INPUT_OPTIONS
from streamwin.packing.parts import parse_part

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


def weights_arg(text: str) -> list[float]:
    """An argparse type: comma-separated weights >= 0, not all 0 (e.g. 0.7,0.3)."""
    try:
        values = [float(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not all(np.isfinite(v) and v >= 0 for v in values) or not sum(values) > 0:
        raise argparse.ArgumentTypeError(f"expected numbers >= 0, not all 0, got {text!r}")
    return values


def int_at_least(low: int) -> Callable[[str], int]:
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


def part_arg(text: str) -> tuple[int, int]:
    """An argparse type: ``I/N`` with 0 <= I < N."""
    try:
        return parse_part(text)
    except PackError as e:
        raise argparse.ArgumentTypeError(f"{e} (--part I/N packs part I of N, counted from 0)") from None


def dtype_arg(text: str) -> str:
    """An argparse type: a numeric numpy dtype name such as float32."""
    try:
        dt = np.dtype(text)
    except TypeError:
        raise argparse.ArgumentTypeError(f"not a numpy dtype: {text!r} (e.g. float32, int64)") from None
    if dt.hasobject or dt.kind not in "biufc":
        raise argparse.ArgumentTypeError(f"{text!r} is not numeric: only numeric dtypes can be packed")
    return text


def key_value(text: str) -> tuple[str, str]:
    """An argparse type: ``KEY=VALUE`` -> (KEY, VALUE)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    return key.strip(), value


def option_value(value: str) -> Any:
    """A JSON list, object, true/false/null is parsed; anything else (numbers too) stays a string."""
    if value[:1] in "[{" or value in ("true", "false", "null"):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise StreamwinError(f"option value {value!r} is not valid JSON: {e}") from e
    return value


def storage_options(pairs: list[tuple[str, str]] | None) -> dict | None:
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
        for name in path:
            node = node.setdefault(name, {})
        node[last] = parsed
    return out


# library keyword -> this command line's option, for messages that tell the user what to pass
_OPTION_OF = {"shard_bytes": "--shard-size", "format": "--format", "workers": "--workers",
              "compression": "--compression", "cast": "--cast", "empty": "--empty", "part": "--part", "nan": "--nan",
              "storage_options": "--storage-option", "engine": "--engine", "address": "--address",
              "overwrite": "--overwrite", "create_bucket": "--create-bucket"}
_KEYWORD = re.compile(r"(?<![\w-])(%s)=('[^']*'|\"[^\"]*\"|[^\s,;)]*)"
                      % "|".join(sorted({*_OPTION_OF, *INPUT_OPTIONS}, key=len, reverse=True)))


def cli_words(message: str) -> str:
    """A library message in this command line's words: ``empty='skip'`` -> ``--empty skip``,
    ``cast=`` -> ``--cast``, an input option ``id_column=`` -> ``--option id_column=``."""
    def option(m: re.Match) -> str:
        name, value = m.group(1), m.group(2).strip("'\"")
        if name in _OPTION_OF:
            return _OPTION_OF[name] if value == "True" else f"{_OPTION_OF[name]} {value}".rstrip()  # a flag
        return f"--option {name}={value}"
    return _KEYWORD.sub(option, message)


# ---- parser pieces the subcommands share ------------------------------------------------------

def add_command(sub: Any, name: str, func: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
    """A subcommand ``name`` that runs ``func(args)``."""
    p = sub.add_parser(name, help=help, description=help)
    p.set_defaults(func=func, command_parser=p)  # its own usage errors name it (main.unrecognized)
    return p


def add_storage(p: argparse.ArgumentParser) -> None:
    """``--storage-option KEY=VALUE``: fsspec options for the dataset URL."""
    p.add_argument("--storage-option", action="append", type=key_value, metavar="KEY=VALUE",
                   help="fsspec option for the dataset URL (repeatable; a.b=v nests; JSON values parsed), "
                        "e.g. client_kwargs.endpoint_url=http://127.0.0.1:9000")


# one wording for what num_workers is, wherever it is said (inspect, bench, the examples' --workers)
WORKERS_HELP = ("streamwin worker processes per rank, as WindowLoader(num_workers=N), not DataLoader workers: each "
                "reads its own stream; 0 (the default here) reads one stream in the trainer's process")


def streams_per_rank(num_workers: int) -> str:
    """What a rank runs for ``num_workers``, in the words of WORKERS_HELP."""
    if num_workers == 0:
        return "1 stream in the trainer's process"
    return f"{num_workers} worker process{'es' if num_workers > 1 else ''}, a stream each"


def add_window(p: argparse.ArgumentParser, required: bool) -> None:
    """The window spec options of ``inspect`` and ``bench``."""
    g = p.add_argument_group("window spec")
    g.add_argument("--window", type=int_at_least(1), required=required, help="steps per window")
    g.add_argument("--stride", type=int_at_least(1), help="steps between window starts (default: --window)")
    g.add_argument("--horizon", type=int_at_least(0), default=0, help="target steps after each window (default 0)")
    g.add_argument("--pad", action="store_true", help="one padded window for sequences shorter than window + horizon")
    g.add_argument("--batch-size", type=int_at_least(1), default=64, help="windows per batch (default 64)")
    g.add_argument("--num-workers", type=int_at_least(0), default=0, help=WORKERS_HELP)
    g.add_argument("--seed", type=int_at_least(0), default=0)
