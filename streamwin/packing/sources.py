"""What pack reads, cut into numbered units, and where it writes: the source and the destination.

`source_of` turns pack's input into a `Source`: the engine its units must run on and the
units themselves, in order, each a tuple of input files (``inputs``) plus the in-memory data
its task gets, if any:

- paths and URLs (any fsspec protocol: ``s3://``, ``hf://``, ``memory://``; globs too): one
  unit per file, small one-sequence files (.npy, text) TASK_FILES to a unit;
- a Python iterable: one unit, read once, in this process (not a dict: its items, ``d.items()``);
- a pyarrow Table or pandas DataFrame: one unit; a ``datasets.Dataset``: ranges of about
  ``ROWS_BYTES`` of rows; a ``datasets.IterableDataset``: batches of ``ITERABLE_ROWS`` rows;
- a ``ray.data.Dataset`` (its blocks) or a ``dask.dataframe.DataFrame`` (its partitions):
  listed by the engine modules, and packed by that engine, so the data never comes here.

A ``part`` i/n keeps the units of part i (their numbers unchanged). `open_dest` opens the
destination and checks at once, within seconds, that it can be reached.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from streamwin.errors import PackError
from streamwin.packing.inputs import InputUnit, list_units
from streamwin.packing.inputs.frames import TableSlice
from streamwin.packing.inputs.units import check_table_options
from streamwin.packing.parts import part_range
from streamwin.packing.tasks import tasks_of
from streamwin.storage.retry import permanent
from streamwin.storage.urls import url_to_fs

ENGINES = ("ray", "dask")
BUCKETED = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")  # object stores whose root is a bucket
ROWS_BYTES = 64 << 20  # a datasets.Dataset unit: about this many bytes of rows
ITERABLE_ROWS = 10_000  # a datasets.IterableDataset unit: this many rows
Unit = tuple[int, tuple[InputUnit, ...], Any]  # (number, input files, in-memory data)


@dataclass
class Source:
    """The units of an input (`units` lists them, numbered in order) and the engine they need."""

    engine: str | None
    units: Callable[[], Iterator[Unit]]


def source_of(inputs: Any, format: str | None, options: dict, engine: str | None,
              part: tuple[int, int] | None, shard_bytes: int = 256 << 20) -> Source:
    """The `Source` of pack's input (see the module docstring)."""
    if engine not in (None, *ENGINES):
        raise PackError(f"engine must be None, 'ray' or 'dask', got {engine!r}")
    if isinstance(inputs, Mapping):  # iterating it would give its keys alone; it may be a table's columns
        raise PackError(f"pack takes (key, array) pairs, not a {type(inputs).__name__}: for key -> array, pass "
                        "its items, pack(d.items(), ...); for a table's columns (an id, a time, values), pass "
                        "pandas.DataFrame(d) or pyarrow.table(d) with id_column=")
    kind = _object_kind(inputs)
    if kind in ENGINES:
        if engine not in (None, kind):
            raise PackError(f"a {type(inputs).__name__} is packed by its own engine, {kind!r}; not engine={engine!r}")
        opts = check_table_options(options)
        return Source(kind, lambda: _select(_engine_units(kind, inputs, opts), part))
    if kind is not None:
        opts = check_table_options(options)
        return Source(engine, lambda: _select(_object_units(kind, inputs, opts), part))
    units = list_units(inputs, format=format, **options)
    if units[0].format == "iterable":
        if engine is not None:
            raise PackError(f"engine={engine!r} runs units of files or of a dataset object as tasks; an in-memory "
                            "iterable is read once, in this process: pass engine=None, or write it to files first")
        if part is not None:
            u = units[0]
            units = [InputUnit(u.format, u.path, u.name, u.options, data=_every_nth(u.data, *part))]
        number = 0 if part is None else part[0]
        return Source(None, lambda: iter([(number, tuple(units), None)]))
    tasks = tasks_of(units, shard_bytes)
    return Source(engine, lambda: _select(((i, tuple(t), None) for i, t in enumerate(tasks)), part, len(tasks)))


def _object_kind(inputs: Any) -> str | None:
    """"ray", "dask", "hf", "hf_iterable" or "table" for the dataset objects pack takes, else None
    (judged by the type's module: none of those libraries is imported here)."""
    for cls in type(inputs).__mro__:
        module, name = cls.__module__, cls.__name__
        if module.startswith("ray.data") and name == "Dataset":
            return "ray"
        if module.startswith(("dask.dataframe", "dask_expr")) and name in ("DataFrame", "FrameBase"):
            return "dask"
        if module.startswith("datasets") and name in ("Dataset", "IterableDataset"):
            return "hf" if name == "Dataset" else "hf_iterable"
        if (module.startswith("pyarrow") and name in ("Table", "RecordBatch")) or (
                module.startswith("pandas") and name == "DataFrame"):
            return "table"
    return None


def _engine_units(kind: str, data: Any, opts: tuple) -> Iterator[Unit]:
    if kind == "ray":
        from streamwin.packing.cluster_ray import ray_units
        return ray_units(data, opts)
    from streamwin.packing.cluster_dask import dask_units
    return dask_units(data, opts)


def _object_units(kind: str, data: Any, opts: tuple) -> Iterator[Unit]:
    """Units of an in-memory table or a Hugging Face dataset (rows in order, keys ``row_<n>`` without id_column)."""
    def unit(number: int, table: Any, first: int) -> Unit:
        return number, (InputUnit("table", f"{type(data).__name__} rows {first}..", "row", opts),), TableSlice(table, first)

    if kind == "table":
        yield unit(0, data, 0)
    elif kind == "hf":
        rows = len(data)
        per_row = max(1, data.data.nbytes // max(1, rows))
        step = max(1, ROWS_BYTES // per_row)
        arrow = data.with_format("arrow")
        for number, first in enumerate(range(0, rows, step)):
            yield unit(number, arrow[first : first + step], first)
    else:  # a stream: batches as Arrow tables (their types kept), read here once
        first = 0
        for number, batch in enumerate(data.with_format("arrow").iter(batch_size=ITERABLE_ROWS)):
            yield unit(number, batch, first)
            first += batch.num_rows


def _select(units: Iterator[Unit], part: tuple[int, int] | None, count: int | None = None) -> Iterator[Unit]:
    """The units of part i of n (all without a part): a contiguous run of units."""
    if part is None:
        yield from units
        return
    if count is None:
        units = list(units)
        count = len(units)
    mine = part_range(count, part)
    for u in units:
        if u[0] in mine:
            yield u


def _every_nth(items, i: int, n: int) -> Iterator:
    for j, item in enumerate(items):
        if j % n == i:
            yield item


def open_dest(dest: str, storage_options: dict | None, create_bucket: bool) -> tuple[Any, str]:
    """(filesystem, root) of ``dest``; on object storage, after checking within seconds that its bucket can be
    reached and exists (PackError naming the URL and the cause; a missing bucket is created only when asked)."""
    fs, root = url_to_fs(dest, storage_options)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol not in BUCKETED:
        return fs, root
    probe, proot = url_to_fs(dest, _fast(dest, storage_options), own_retries=True, fresh=True)
    bucket = proot.split("/", 1)[0]
    try:
        probe.info(bucket)
    except FileNotFoundError:
        if not create_bucket:
            raise PackError(f"cannot pack to {dest}: bucket {bucket!r} does not exist (create it, or pass "
                            "create_bucket=True, --create-bucket)") from None
        _create_bucket(fs, bucket)
    except PermissionError as e:
        raise PackError(f"cannot pack to {dest}: access denied: {e}") from e
    except Exception as e:
        why = permanent(e)
        raise PackError(f"cannot reach {dest}: {why + ': ' if why else ''}{type(e).__name__}: {e}") from e
    return fs, root


def _create_bucket(fs: Any, bucket: str) -> None:
    """Create ``bucket`` (asked for: create_bucket=True). On s3 the region's location constraint is given, but
    none for us-east-1, which refuses one (s3fs' mkdir would send it)."""
    if not hasattr(fs, "call_s3"):
        fs.mkdir(bucket)
        return
    region = (getattr(fs, "client_kwargs", None) or {}).get("region_name")
    params: dict = {"Bucket": bucket}
    if region and region != "us-east-1":
        params["CreateBucketConfiguration"] = {"LocationConstraint": region}
    fs.call_s3("create_bucket", **params)
    fs.invalidate_cache()


def _fast(dest: str, storage_options: dict | None) -> dict:
    """Storage options for a first contact that fails within seconds: short connect and read timeouts (s3)."""
    opts = dict(storage_options or {})
    if dest.startswith(("s3://", "s3a://")):
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("connect_timeout", 3)
        config.setdefault("read_timeout", 5)
        opts["config_kwargs"] = config
    return opts
