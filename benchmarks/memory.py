"""Peak memory of streamwin and of the in-memory tutorial at 1x and 4x a data size.

The claim under test (design.md, invariant 5): streamwin's peak memory is bounded by its
buffers and read-ahead, independent of dataset size, while the tutorial recipe (load all,
list all windows) grows with the data. Each (system, size) runs one epoch in a fresh child
process (``throughput.py --case``), so every peak is that run's own.

Sizes: full: 2,740 sequences (~0.38 GB) and 10,963 (~1.5 GB, the perf-notes corpus);
``--quick``: 548 (~72 MB) and 2,192 (~0.29 GB).

Targets, printed as PASS/FAIL lines (the exit code is 0 either way; 1 only if a run crashed):
  - streamwin's peak at 4x is within 10% of its peak at 1x;
  - the tutorial's peak grows with the data (by at least half the added bytes).

The peak is the main process's RSS high-water mark (getrusage) at ``--workers 0`` and the
sampled PSS summed over the process and its workers otherwise.

Usage:
  python benchmarks/memory.py --quick
  python benchmarks/memory.py                      # ~0.38 GB vs ~1.5 GB
  python benchmarks/memory.py --workers 0 2 --factor 4 --base-seqs 1000
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Sequence

try:  # imported as benchmarks.memory
    from . import data, throughput
except ImportError:  # run as a script
    import data
    import throughput

SYSTEMS = ("streamwin", "tutorial")
#: streamwin's peak at 4x may exceed its peak at 1x by at most this fraction.
FLAT_TOLERANCE = 0.10
#: The tutorial "grows" when its peak rises by at least this fraction of the added data bytes.
GROWTH_FRACTION = 0.5


def size_specs(quick: bool, base_seqs: int | None, factor: float) -> list[data.CorpusSpec]:
    """The 1x and the ``factor``-x corpora.

    By default the full-size big corpus is the perf-notes corpus itself (reusing
    ``bench_data/full``) and the 1x one a ``factor``-th of it; with --quick the 1x corpus is
    the quick one (``bench_data/quick``).
    """
    template = data.CorpusSpec.quick() if quick else data.CorpusSpec()
    if base_seqs is None and not quick:
        return [replace(template, n_seqs=round(template.n_seqs / factor)), template]
    base = replace(template, n_seqs=base_seqs or template.n_seqs)
    return [base, base.scaled(factor)]


def peak_mb(record: dict[str, Any], workers: int) -> float | None:
    """The peak that a run is judged by: exact main RSS without workers, PSS sum with them."""
    if "error" in record:
        return None
    return record["peak_rss_mb"] if workers == 0 else record["peak_pss_mb"]


def measure(systems: Sequence[str], specs: Sequence[data.CorpusSpec], workers: Sequence[int],
            params: "throughput.Params", timeout: float) -> list[dict[str, Any]]:
    """Run every (system, workers, size) once in a fresh child and collect the records."""
    results = []
    zero = throughput.run_case_subprocess("baseline", 0, data.default_dir(specs[0]), params, timeout)
    zero.update(n_seqs=0, data_bytes=0, peak_mb=peak_mb(zero, 0))
    results.append(zero)
    for spec in specs:
        directory = data.write_corpus(data.default_dir(spec), spec)
        for system in systems:
            for w in workers:
                rec = throughput.run_case_subprocess(system, w, directory, params, timeout)
                rec.update(n_seqs=spec.n_seqs, data_bytes=data.corpus_bytes(spec), peak_mb=peak_mb(rec, w))
                results.append(rec)
                shown = rec.get("error") or f"{rec['peak_mb']:,.0f} MB peak"
                print(f"  {system:<10} workers={w} {spec.n_seqs:>6} seqs: {shown}", file=sys.stderr,
                      flush=True)
    return results


def table(results: list[dict[str, Any]]) -> str:
    """Markdown table: one row per run; "net" is the judged peak less the imports-only baseline."""
    zero = _baseline_mb(results)
    lines = ["| system | workers | sequences | data MB | windows | windows/s | peak RSS MB (main) | "
             "peak PSS MB (all procs) | judged peak MB | net of imports MB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['workers']} | {r['n_seqs']:,} | {r['data_bytes'] / 1e6:,.0f} | "
                         f"error: {r['error']} | | | | | |")
        elif r["case"] == "baseline":
            lines.append(f"| imports only | – | – | – | – | – | {r['peak_rss_mb']:,.0f} | "
                         f"{r['peak_pss_mb']:,.0f} | {r['peak_mb']:,.0f} | 0 |")
        else:
            net = "–" if zero is None else f"{r['peak_mb'] - zero:,.0f}"
            lines.append(f"| {r['case']} | {r['workers']} | {r['n_seqs']:,} | {r['data_bytes'] / 1e6:,.0f} | "
                         f"{r['windows']:,} | {r['windows_per_s']:,.0f} | {r['peak_rss_mb']:,.0f} | "
                         f"{r['peak_pss_mb']:,.0f} | {r['peak_mb']:,.0f} | {net} |")
    return "\n".join(lines)


def _baseline_mb(results: list[dict[str, Any]]) -> float | None:
    """Peak RSS of a child that only imports torch, webdataset and streamwin (no data)."""
    return next((r.get("peak_mb") for r in results if r["case"] == "baseline"), None)


def verdicts(results: list[dict[str, Any]], workers: Sequence[int]) -> list[str]:
    """PASS/FAIL lines for the two targets, per worker count."""
    lines = []
    runs = [r for r in results if r["case"] != "baseline"]
    sizes = sorted({r["n_seqs"] for r in runs})
    small, big = sizes[0], sizes[-1]
    zero = _baseline_mb(results)

    def find(case: str, w: int, n: int) -> dict[str, Any] | None:
        return next((r for r in runs if r["case"] == case and r["workers"] == w and r["n_seqs"] == n), None)

    def net(a: dict[str, Any], b: dict[str, Any]) -> str:
        if zero is None:
            return ""
        return f"; net of the {zero:,.0f} MB imports-only baseline: {a['peak_mb'] - zero:,.0f} -> {b['peak_mb'] - zero:,.0f} MB"

    for w in workers:
        sw_small, sw_big = find("streamwin", w, small), find("streamwin", w, big)
        if sw_small and sw_big and sw_small.get("peak_mb") and sw_big.get("peak_mb"):
            growth = sw_big["peak_mb"] / sw_small["peak_mb"] - 1
            ok = growth <= FLAT_TOLERANCE
            lines.append(f"{'PASS' if ok else 'FAIL'}: streamwin workers={w}: peak {sw_small['peak_mb']:,.0f} MB "
                         f"-> {sw_big['peak_mb']:,.0f} MB ({growth:+.1%}; target within "
                         f"{FLAT_TOLERANCE:.0%}){net(sw_small, sw_big)}")
        else:
            lines.append(f"SKIP: streamwin workers={w}: no result (not available yet, or it failed)")
        tut_small, tut_big = find("tutorial", w, small), find("tutorial", w, big)
        if tut_small and tut_big and tut_small.get("peak_mb") and tut_big.get("peak_mb"):
            added = (tut_big["data_bytes"] - tut_small["data_bytes"]) / 1e6
            rise = tut_big["peak_mb"] - tut_small["peak_mb"]
            ok = rise >= GROWTH_FRACTION * added
            lines.append(f"{'PASS' if ok else 'FAIL'}: tutorial workers={w} grows: peak {tut_small['peak_mb']:,.0f} MB "
                         f"-> {tut_big['peak_mb']:,.0f} MB (+{rise:,.0f} MB for +{added:,.0f} MB of data)")
        else:
            lines.append(f"SKIP: tutorial workers={w}: no result")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--quick", action="store_true", help="small sizes (~1 minute)")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--workers", nargs="+", type=int, default=[0])
    parser.add_argument("--base-seqs", type=int, help="sequences in the 1x corpus")
    parser.add_argument("--factor", type=float, default=4.0, help="size of the big corpus vs the 1x one")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--stride", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--shuffle-buffer", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, help="JSON results (default bench_data/memory[-quick].json)")
    args = parser.parse_args(argv)

    systems = list(args.systems)
    if "streamwin" in systems and data.streamwin_api() is None:
        print("NOTE: streamwin does not provide pack/WindowDataset/WindowLoader yet: its case is skipped")
        systems.remove("streamwin")
    specs = size_specs(args.quick, args.base_seqs, args.factor)
    params = throughput.Params(args.window, args.stride, args.batch_size, args.shuffle_buffer, args.seed)
    print(f"# memory: {specs[0].n_seqs:,} vs {specs[1].n_seqs:,} sequences "
          f"({data.corpus_bytes(specs[0]) / 1e6:,.0f} MB vs {data.corpus_bytes(specs[1]) / 1e6:,.0f} MB), "
          f"W={params.window} stride={params.stride} batch={params.batch_size} shuffle={params.shuffle_buffer}",
          flush=True)
    results = measure(systems, specs, args.workers, params, args.timeout)
    print()
    print(table(results))
    print()
    lines = verdicts(results, args.workers)
    for line in lines:
        print(line)
    for r in results:
        if "error" in r:
            print(f"\n{r['case']} workers={r['workers']} n_seqs={r['n_seqs']} failed:\n{r.get('stderr_tail', '')}")
    out = args.out or data.default_dir(specs[0]).parent / ("memory-quick.json" if args.quick else "memory.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"specs": [asdict(s) for s in specs], "params": asdict(params),
                               "environment": throughput.environment(), "results": results,
                               "verdicts": lines}, indent=1))
    print(f"\nwrote {out}")
    return 1 if any("error" in r for r in results) else 0  # a crashed run, not a missed target


if __name__ == "__main__":
    sys.exit(main())
