"""Windows/s of streamwin next to the pipelines users write today, on the same shards, in one run.

Systems (``--systems``): ``streamwin`` (WindowDataset + WindowLoader, every byte read verified against
the manifest's chunk checksums), ``streamwin-unverified`` (the same with ``Read(verify_checksums=False)``:
side by side, the two rows give what verification costs), ``streamwin-canonical`` (the same with
``Order(canonical=(8, 1))``: one order of global batches for every world, what "auto", the default, gives here),
``streamwin-streams`` (``Order(canonical=None)``: one stream per rank and worker, the order before "auto"; beside it
the canonical row gives what one order costs), ``webdataset`` (decode ->
window generator -> shuffle -> batched), ``tutorial`` (everything in memory, a list of
windows, DataLoader(shuffle)), and two ceilings: ``read`` (reading the shard bytes) and
``copy`` (one memcpy per batch into a reused array). Pipelines run at every ``--workers``
count; the ceilings once.

Each measurement is a fresh child process (``--case NAME``) so that its peak memory is its
own; the child prints one JSON line. Repeats are interleaved across systems, so drift on
this shared machine hits every system alike, and the median is reported.

Timing, per child:
  setup_s         constructing the dataset/loader (the tutorial loads all data here)
  first_batch_s   from the start of construction to the first batch in hand
  windows_per_s   windows / (end - start of iteration): the epoch rate, setup excluded
  peak_rss_mb     the main process's RSS high-water mark (getrusage), exact
  peak_pss_mb     PSS summed over the process and its DataLoader workers, sampled every
                  0.1 s by the parent (PSS splits pages that forked workers share)

Usage:
  python benchmarks/throughput.py --quick            # ~1 minute smoke run, 1/20 of the data
  python benchmarks/throughput.py                    # full perf-notes setup, 3 repeats
  python benchmarks/throughput.py --systems streamwin webdataset --workers 0 --repeats 5
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

try:  # imported as benchmarks.throughput
    from . import data
    from .children import run_child
except ImportError:  # run as a script: benchmarks/ is on sys.path
    import data
    from children import run_child



def baselines_module():
    """The baselines module, imported lazily (it imports torch; the parent stays light)."""
    try:
        from . import baselines  # noqa: PLC0415
    except ImportError:
        import baselines  # noqa: PLC0415
    return baselines


REPO = Path(__file__).resolve().parent.parent
PIPELINES = ("streamwin", "streamwin-unverified", "streamwin-canonical", "streamwin-streams", "webdataset", "tutorial")
OURS = ("streamwin", "streamwin-unverified", "streamwin-canonical", "streamwin-streams")
LIMITS = ("read", "copy")
SYSTEMS = PIPELINES + LIMITS
#: The copy ceiling runs at least this many windows so that its timing is not noise.
MIN_COPY_WINDOWS = 1_000_000
#: Targets the project sets (docs/performance.md): streamwin vs the webdataset pipeline and vs the copy ceiling.
TARGET_VS_WEBDATASET = 3.0
TARGET_VS_COPY = 0.5
#: Verification (chunk checksums) may cost at most this share of streamwin's throughput (issue 20).
TARGET_CHECKSUM_COST = 0.05
#: Canonical streams (one order for every world) may cost at most this share of streamwin's throughput (issue 30).
TARGET_CANONICAL_COST = 0.05
CANONICAL = (8, 1)  # streamwin-canonical's canonical=(rank slots, step phases): one phase, blocks aligned to the step


@dataclass(frozen=True)
class Params(data.WindowSetup):
    """The window setup every system is run with, and where a run stops."""

    max_windows: int = 0  # 0: one full epoch
    torch_threads: int = 0  # 0: torch's default; else torch.set_num_threads in each case's process

    def cli(self) -> list[str]:
        """These parameters as command-line flags for a child process."""
        return ["--window", str(self.window), "--stride", str(self.stride),
                "--batch-size", str(self.batch_size), "--shuffle-buffer", str(self.shuffle_buffer),
                "--seed", str(self.seed), "--max-windows", str(self.max_windows),
                "--torch-threads", str(self.torch_threads)]


# =========================================================================== child side


def preload(case: str) -> None:
    """Import what a case needs before its clock starts, so import time is not set-up time."""
    import torch  # noqa: F401, PLC0415

    baselines_module()
    if case in ("webdataset", "baseline"):
        import webdataset  # noqa: F401, PLC0415
    if case in (*OURS, "baseline") and data.streamwin_api() is not None:
        import streamwin  # noqa: F401, PLC0415
        import torchdata.stateful_dataloader  # noqa: F401, PLC0415


def build_pipeline(case: str, data_dir: Path, params: Params, workers: int) -> Iterable[Any]:
    """Construct the loader of one system; everything it does up front is its set-up cost."""
    if case in OURS:
        import streamwin as sw  # noqa: PLC0415 - the library may not exist yet

        read = sw.Read(verify_checksums=case != "streamwin-unverified")
        order = sw.Order(shuffle=True)
        if case == "streamwin-canonical":
            order = sw.Order(shuffle=True, canonical=CANONICAL)
        if case == "streamwin-streams":  # one stream per rank and worker: the order of every job before "auto"
            order = sw.Order(shuffle=True, canonical=None)
        dataset = sw.WindowDataset(str(data_dir), window=params.window, stride=params.stride,
                                   horizon=0, shuffle_buffer=params.shuffle_buffer,
                                   seed=params.seed, batch_size=params.batch_size,
                                   rank=0, world_size=1, order=order, read=read)
        if case != "streamwin-unverified" and dataset.manifest.checks is None:
            raise SystemExit(f"{data_dir} was packed without chunk checksums: delete it (it is written anew) "
                             "to measure what verifying them costs")
        return sw.WindowLoader(dataset, num_workers=workers)
    baselines = baselines_module()

    paths = data.shard_paths(data_dir)
    if case == "webdataset":
        return baselines.webdataset_pipeline(paths, params.window, params.stride, params.batch_size,
                                             params.shuffle_buffer, params.seed, workers)
    if case == "tutorial":
        return baselines.tutorial_inmemory(paths, params.window, params.stride, params.batch_size,
                                           params.seed, workers)
    if case == "copy":
        spec = _corpus_spec(data_dir)
        lengths = data.sequence_lengths(spec.n_seqs, spec.min_len, spec.max_len, spec.seed)
        n_windows = params.max_windows or max(
            data.count_windows(lengths, params.window, params.stride), MIN_COPY_WINDOWS)
        return baselines.copy_batches(n_windows, params.window, spec.features, params.batch_size,
                                      spec.dtype)
    raise ValueError(f"unknown case {case!r}; choose from {SYSTEMS}")


def consume(batches: Iterable[Any], max_windows: int) -> dict[str, float]:
    """Iterate batches, touching each minimally (shape, one element) and counting windows.

    Returns counts and the times of iteration start, first batch and end (perf_counter).
    """
    baselines = baselines_module()

    windows = batches_seen = nbytes = 0
    checksum = 0.0
    first_at = 0.0
    started = time.perf_counter()
    iterator = iter(batches)
    for batch in iterator:
        x = baselines.batch_tensor(batch)
        if not batches_seen:
            first_at = time.perf_counter()
        batches_seen += 1
        windows += int(x.shape[0])
        nbytes += x.numel() * x.element_size()
        checksum += float(x[0, 0, 0])
        if max_windows and windows >= max_windows:
            break
    ended = time.perf_counter()
    del iterator  # joins DataLoader workers, so RUSAGE_CHILDREN covers them
    return {"windows": windows, "batches": batches_seen, "bytes": nbytes, "checksum": checksum,
            "iter_started": started, "first_at": first_at or ended, "ended": ended}


def _corpus_spec(data_dir: Path) -> data.CorpusSpec:
    """The spec recorded in a corpus directory's marker file."""
    marker = json.loads((data_dir / data.MARKER).read_text())
    return data.CorpusSpec(**marker["spec"])


def _maxrss_mb(who: int) -> float:
    """ru_maxrss (KiB on Linux) in MB."""
    return resource.getrusage(who).ru_maxrss * 1024 / 1e6


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and of its children that ended."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_case(case: str, data_dir: Path, params: Params, workers: int) -> dict[str, Any]:
    """Measure one system once in this process and return the result record."""
    record: dict[str, Any] = {"case": case, "workers": workers}
    constructed = time.perf_counter()
    if case == "baseline":  # the interpreter with every module imported and no data: memory's zero
        record.update(windows_per_s=None, mb_per_s=None, first_batch_s=None, setup_s=0.0, workers=None)
    elif case == "read":
        result = baselines_module().read_limit(data.shard_paths(data_dir))
        record.update(bytes=result["bytes"], seconds=result["seconds"],
                      mb_per_s=result["bytes_per_s"] / 1e6, windows_per_s=None,
                      first_batch_s=None, setup_s=0.0, workers=None)
    else:
        cpu0 = _cpu_s()
        pipeline = build_pipeline(case, data_dir, params, workers)
        setup_s = time.perf_counter() - constructed
        try:
            record["len_loader"] = len(pipeline)  # type: ignore[arg-type]
        except TypeError:
            record["len_loader"] = None
        counts = consume(pipeline, params.max_windows)
        seconds = counts["ended"] - counts["iter_started"]
        record.update(windows=counts["windows"], batches=counts["batches"], bytes=counts["bytes"],
                      seconds=seconds, setup_s=setup_s,
                      first_batch_s=counts["first_at"] - constructed,
                      windows_per_s=counts["windows"] / max(seconds, 1e-9),
                      mb_per_s=counts["bytes"] / max(seconds, 1e-9) / 1e6,
                      checksum=counts["checksum"])
        if hasattr(pipeline, "close"):  # workers end and are waited for: their CPU time is counted
            pipeline.close()
        record["cpu_us_per_window"] = (_cpu_s() - cpu0) / max(counts["windows"], 1) * 1e6
        if case == "copy":
            record["workers"] = None
    record["loadavg_1min_end"] = os.getloadavg()[0]
    record["peak_rss_mb"] = _maxrss_mb(resource.RUSAGE_SELF)
    record["peak_rss_worker_mb"] = _maxrss_mb(resource.RUSAGE_CHILDREN)
    return record


# =========================================================================== parent side


def run_case_subprocess(case: str, workers: int, data_dir: Path, params: Params,
                        timeout: float = 900.0) -> dict[str, Any]:
    """Run ``--case`` in a fresh child process and return its record plus sampled memory.

    A child that fails or times out gives a record with an ``error`` and its stderr tail.
    """
    cmd = [sys.executable, str(Path(__file__).resolve()), "--case", case, "--workers", str(workers),
           "--data-dir", str(data_dir), *params.cli()]
    run = run_child(cmd, timeout, cwd=str(REPO), sample_memory=True)
    record = run.record or {"case": case, "workers": workers if case in PIPELINES else None, **run.failed()}
    record.update(other_cpu_cores=run.other_cpu_cores, peak_tree_rss_mb=run.peak_rss_mb, peak_pss_mb=run.peak_pss_mb)
    return record


def plan_runs(systems: Sequence[str], workers: Sequence[int], repeats: int) -> list[tuple[str, int]]:
    """(case, workers) in run order: repeats outermost, so repeats interleave across systems."""
    one_round = [(s, w) for s in systems for w in (workers if s in PIPELINES else [0])]
    return one_round * repeats


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median throughput and latency, max memory, per (case, workers); errors kept."""
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for rec in records:
        groups.setdefault((rec["case"], rec.get("workers")), []).append(rec)
    rows = []
    for (case, workers), recs in groups.items():
        ok = [r for r in recs if "error" not in r]
        row: dict[str, Any] = {"case": case, "workers": workers, "runs": len(recs), "ok": len(ok)}
        if not ok:
            row["error"] = recs[-1].get("error")
            row["stderr_tail"] = recs[-1].get("stderr_tail", "")
            rows.append(row)
            continue
        for key in ("windows_per_s", "mb_per_s", "first_batch_s", "setup_s", "seconds", "other_cpu_cores",
                    "cpu_us_per_window"):
            values = [r[key] for r in ok if r.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        for key in ("peak_rss_mb", "peak_rss_worker_mb", "peak_pss_mb", "peak_tree_rss_mb"):
            row[key] = max(r.get(key) or 0.0 for r in ok)
        row["windows"] = ok[-1].get("windows")
        row["len_loader"] = ok[-1].get("len_loader")
        row["batches"] = ok[-1].get("batches")
        rows.append(row)
    return rows


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The summary as a markdown table (one row per system and worker count)."""
    lines = ["| system | workers | windows/s | MB/s | first batch s | setup s | windows | "
             "peak RSS MB (main) | peak PSS MB (all procs) | others' CPU (cores) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        workers = "–" if row["workers"] is None else str(row["workers"])
        if "error" in row:
            lines.append(f"| {row['case']} | {workers} | error: {row['error']} | | | | | | | |")
            continue
        lines.append(
            f"| {row['case']} | {workers} | {_fmt(row['windows_per_s'], ',.0f')} | "
            f"{_fmt(row['mb_per_s'], ',.0f')} | {_fmt(row['first_batch_s'], '.2f')} | "
            f"{_fmt(row['setup_s'], '.2f')} | {_fmt(row.get('windows'), ',')} | "
            f"{_fmt(row['peak_rss_mb'], ',.0f')} | {_fmt(row['peak_pss_mb'], ',.0f')} | "
            f"{_fmt(row.get('other_cpu_cores'), '.2f')} |")
    return "\n".join(lines)


def _rate(rows: list[dict[str, Any]], case: str, workers: int | None) -> float | None:
    for row in rows:
        if row["case"] == case and row["workers"] == workers and "error" not in row:
            return row.get("windows_per_s")
    return None


def target_ratios(rows: list[dict[str, Any]], workers: Sequence[int]) -> list[dict[str, Any]]:
    """streamwin / webdataset (target >= 3) and streamwin / copy ceiling (target >= 0.5).

    Per worker count, and "best": each system at its own fastest worker count, which is how
    a user would run it.
    """
    copy = _rate(rows, "copy", None)
    ratios = []
    cases = [(w, {c: _rate(rows, c, w) for c in PIPELINES}) for w in workers]
    best = {c: max((r for _, rates in cases if (r := rates[c]) is not None), default=None)
            for c in PIPELINES}
    for label, rates in [*[(str(w), r) for w, r in cases], ("best", best)]:
        sw_rate, wds_rate = rates["streamwin"], rates["webdataset"]
        ratios.append({
            "workers": label,
            "streamwin_vs_webdataset": sw_rate / wds_rate if sw_rate and wds_rate else None,
            "streamwin_vs_copy": sw_rate / copy if sw_rate and copy else None,
            "streamwin_vs_tutorial": sw_rate / rates["tutorial"] if sw_rate and rates["tutorial"] else None,
        })
    return ratios


def ratio_lines(ratios: list[dict[str, Any]]) -> list[str]:
    """Human-readable ratio lines with the target verdicts."""
    lines = []
    for r in ratios:
        vs_wds, vs_copy, vs_tut = (r["streamwin_vs_webdataset"], r["streamwin_vs_copy"],
                                   r["streamwin_vs_tutorial"])
        verdict_wds = "" if vs_wds is None else (" MEETS" if vs_wds >= TARGET_VS_WEBDATASET else " BELOW")
        verdict_copy = "" if vs_copy is None else (" MEETS" if vs_copy >= TARGET_VS_COPY else " BELOW")
        lines.append(
            f"workers={r['workers']}: streamwin/webdataset = {_fmt(vs_wds, '.2f')}x "
            f"(target >= {TARGET_VS_WEBDATASET:g}){verdict_wds}; "
            f"streamwin/copy limit = {_fmt(vs_copy, '.2f')} (target >= {TARGET_VS_COPY:g}){verdict_copy}; "
            f"streamwin/tutorial = {_fmt(vs_tut, '.2f')}x")
    return lines


def _field(rows: list[dict[str, Any]], case: str, workers: int, key: str) -> Any:
    """``key`` of the summary row of ``case`` at ``workers`` (None if none or unset)."""
    return next((r.get(key) for r in rows if r["case"] == case and r["workers"] == workers), None)


def checksum_lines(rows: list[dict[str, Any]], workers: Sequence[int]) -> list[str]:
    """What verifying every byte read costs: streamwin beside streamwin-unverified, per worker count."""
    lines = []
    for w in workers:
        on, off = _rate(rows, "streamwin", w), _rate(rows, "streamwin-unverified", w)
        if on and off:
            cost = 1 - on / off
            verdict = " MEETS" if cost <= TARGET_CHECKSUM_COST else " ABOVE"
            cpu = [_field(rows, c, w, "cpu_us_per_window") for c in ("streamwin", "streamwin-unverified")]
            more = f"; CPU per window {cpu[0]:.2f} vs {cpu[1]:.2f} us (+{100 * (cpu[0] / cpu[1] - 1):.1f}%)" \
                if all(cpu) else ""
            lines.append(f"workers={w}: checksums cost {100 * cost:.1f}% of throughput ({on:,.0f} verified vs "
                         f"{off:,.0f} unverified windows/s; target <= {100 * TARGET_CHECKSUM_COST:g}%){verdict}{more}")
    return lines


def canonical_lines(rows: list[dict[str, Any]], workers: Sequence[int]) -> list[str]:
    """What one order for every world costs: streamwin-canonical beside streamwin-streams (one stream per rank and
    worker; without that row, beside streamwin, the default)."""
    lines = []
    base = "streamwin-streams" if any(r["case"] == "streamwin-streams" for r in rows) else "streamwin"
    for w in workers:
        one, canon = _rate(rows, base, w), _rate(rows, "streamwin-canonical", w)
        if one and canon:
            cost = 1 - canon / one
            verdict = " MEETS" if cost <= TARGET_CANONICAL_COST else " ABOVE"
            rss = [_field(rows, c, w, "peak_pss_mb") or _field(rows, c, w, "peak_rss_mb")
                   for c in (base, "streamwin-canonical")]
            more = f"; peak memory {rss[1]:,.0f} vs {rss[0]:,.0f} MB" if all(rss) else ""
            lines.append(f"workers={w}: canonical={CANONICAL} costs {100 * cost:.1f}% of throughput ({canon:,.0f} vs "
                         f"{one:,.0f} windows/s; target <= {100 * TARGET_CANONICAL_COST:g}%){verdict}{more}")
    return lines


def busy_warning(records: list[dict[str, Any]], threshold: float = 0.25) -> str | None:
    """A warning when other processes (or the hypervisor) took CPU during the runs, else None."""
    others = [r["other_cpu_cores"] for r in records if r.get("other_cpu_cores") is not None]
    if not others or statistics.median(others) < threshold:
        return None
    return (f"WARNING: other processes used {statistics.median(others):.2f} CPU cores on median "
            f"(max {max(others):.2f}) of this machine's {os.cpu_count()} during the runs: absolute "
            "numbers are low and noisy; compare systems by ratio, or rerun on an idle machine.")


def plot(rows: list[dict[str, Any]], workers: Sequence[int], path: Path, title: str) -> None:
    """Bar plot of windows/s per system (grouped by worker count), copy ceiling as a line."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(1, len(workers))
    for i, w in enumerate(workers):
        rates = [_rate(rows, c, w) or 0.0 for c in PIPELINES]
        xs = [j + (i - (len(workers) - 1) / 2) * width for j in range(len(PIPELINES))]
        bars = ax.bar(xs, rates, width, label=f"num_workers={w}")
        ax.bar_label(bars, labels=[f"{r / 1e3:,.0f}k" if r else "n/a" for r in rates], fontsize=8)
    copy = _rate(rows, "copy", None)
    if copy:
        ax.axhline(copy, color="k", linestyle="--", linewidth=1)
        ax.text(len(PIPELINES) - 0.5, copy, f"copy ceiling {copy / 1e6:.2f}M/s", ha="right",
                va="bottom", fontsize=8)
    ax.set_xticks(range(len(PIPELINES)), PIPELINES)
    ax.set_ylabel("windows / s")
    ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment() -> dict[str, Any]:
    """Versions and machine facts that explain the numbers."""
    from importlib import metadata  # noqa: PLC0415

    versions = {}
    for name in ("torch", "torchdata", "webdataset", "numpy", "streamwin"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"python": platform.python_version(), "cpus": os.cpu_count(),
            "loadavg_at_start": os.getloadavg(), "platform": platform.platform(), **versions}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--quick", action="store_true", help="1/20 of the data, 1 repeat (~1 minute)")
    parser.add_argument("--data-dir", type=Path, help="corpus directory (default bench_data/quick|full)")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--workers", nargs="+", type=int, default=[0, 2], help="num_workers values")
    parser.add_argument("--repeats", type=int, help="runs per system (default 1 quick, 3 full)")
    parser.add_argument("--max-windows", type=int, default=0, help="stop each run after this many windows")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch.set_num_threads in each case's process (0: torch's default); on busy cores "
                             "torch's intra-op threads spin in an in-process gather (docs/performance.md)")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--stride", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--shuffle-buffer", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per child run")
    parser.add_argument("--out", type=Path, help="JSON results (default bench_data/throughput[-quick].json)")
    parser.add_argument("--plot", type=Path, help="PNG plot (default: --out with .png)")
    parser.add_argument("--case", choices=(*SYSTEMS, "baseline"), help=argparse.SUPPRESS)  # child mode
    return parser.parse_args(argv)


def params_from(args: argparse.Namespace) -> Params:
    return Params(args.window, args.stride, args.batch_size, args.shuffle_buffer, args.seed,
                  args.max_windows, args.torch_threads)


def child_main(args: argparse.Namespace) -> int:
    """Child mode: measure one case, print its JSON record as the last stdout line, exit."""
    preload(args.case)
    if args.torch_threads:
        import torch  # noqa: PLC0415

        torch.set_num_threads(args.torch_threads)
    record = run_case(args.case, args.data_dir.resolve(), params_from(args), args.workers[0])
    print(json.dumps(record), flush=True)
    sys.stderr.flush()
    os._exit(0)  # skip tearing down large in-memory datasets; nothing is left to flush


def parent_main(args: argparse.Namespace) -> int:
    """Parent mode: ensure the corpus, run every case in children, report and save."""
    spec = data.CorpusSpec.quick() if args.quick else data.CorpusSpec()  # --seed is the shuffle's
    data_dir = (args.data_dir or data.default_dir(spec)).resolve()
    data.write_corpus(data_dir, spec)
    params = params_from(args)
    systems = list(args.systems)
    if "streamwin" in systems and data.streamwin_api() is None:
        print("NOTE: streamwin does not provide pack/WindowDataset/WindowLoader yet: "
              "its case is skipped", flush=True)
        systems.remove("streamwin")
    repeats = args.repeats or (1 if args.quick else 3)
    out = args.out or REPO / "bench_data" / ("throughput-quick.json" if args.quick else "throughput.json")
    plot_path = args.plot or out.with_suffix(".png")
    lengths = data.sequence_lengths(spec.n_seqs, spec.min_len, spec.max_len, spec.seed)
    expected = data.count_windows(lengths, params.window, params.stride)
    header = (f"{spec.n_seqs} sequences, {data.corpus_bytes(spec) / 1e9:.2f} GB, F={spec.features} "
              f"{spec.dtype}; W={params.window} stride={params.stride} batch={params.batch_size} "
              f"shuffle={params.shuffle_buffer}; {expected:,} windows/epoch; median of {repeats}")
    print(f"# throughput: {header}", flush=True)
    baselines_module().read_limit(data.shard_paths(data_dir))  # warm the page cache

    records = []
    for case, workers in plan_runs(systems, args.workers, repeats):
        rec = run_case_subprocess(case, workers, data_dir, params, args.timeout)
        records.append(rec)
        status = rec.get("error") or (f"{rec['windows_per_s']:,.0f} windows/s" if rec.get("windows_per_s")
                                      else f"{rec.get('mb_per_s', 0):,.0f} MB/s")
        print(f"  {case:<21} workers={workers if case in PIPELINES else '-'}: {status}",
              file=sys.stderr, flush=True)

    rows = summarize(records)
    ratios = target_ratios(rows, args.workers)
    print()
    print(markdown_table(rows))
    print()
    for line in ratio_lines(ratios) + checksum_lines(rows, args.workers) + canonical_lines(rows, args.workers):
        print(line)
    busy = busy_warning(records)
    if busy:
        print(busy)
    for row in rows:
        if "error" in row:
            print(f"\n{row['case']} workers={row['workers']} failed ({row['error']}):\n{row['stderr_tail']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"setup": {"corpus": asdict(spec), "params": asdict(params),
                                         "expected_windows": expected, "repeats": repeats,
                                         "data_dir": str(data_dir)},
                               "environment": environment(), "summary": rows, "ratios": ratios,
                               "runs": records}, indent=1))
    plot(rows, args.workers, plot_path, f"streamwin vs alternatives — {header}")
    print(f"\nwrote {out} and {plot_path}")
    return 1 if any("error" in row for row in rows) else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.case:
        if args.data_dir is None:
            raise SystemExit("--case needs --data-dir")
        return child_main(args)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
