"""peers.py's summary, table and plot: one row per set-up, its rates, data-wait, memory, disk and checks.

Where a peer has two set-ups (``peer`` of the rows), the table and the plot show the faster one,
named, and :func:`markdown_table` of the others goes under it: faster is the higher geometric mean
of windows/s over the worker counts measured (the rate a user sees, whichever count they pick)."""
from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Sequence

FEED_WORKERS = 1
CHECK_NAMES = ("exact_resume", "elastic_resume", "equal_steps")


def _median(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None and "error" not in r]
    return statistics.median(values) if values else None


def after_first(record: dict[str, Any]) -> dict[str, Any]:
    """{"rate": windows/s after the first batch} of a rate record: the rate once the pool is full."""
    if "error" in record or not record.get("batches", 0) > 1:
        return {"rate": None}
    seconds = record["seconds"] - (record["first_batch_s"] - record["setup_s"])
    per_batch = record["windows"] / record["batches"]
    return {"rate": (record["windows"] - per_batch) / seconds if seconds > 0 else None}


def feed_summary(feeds: list[dict[str, Any]], floors: list[dict[str, Any]]) -> dict[str, Any]:
    """Median step, median floor, and the median over repeats of 1 - floor / step, each step paired
    with the floor measured just before it (the machine's load drifts between repeats)."""
    floor_of = {r["repeat"]: r["step_ms"] for r in floors if "error" not in r}
    waits = [{"w": 1 - floor_of[r["repeat"]] / r["step_ms"]} for r in feeds
             if "error" not in r and r["repeat"] in floor_of]
    return {"step_ms": _median(feeds, "step_ms"), "floor_ms": _median(floors, "step_ms"),
            "data_wait": _median(waits, "w")}


def summarize(records: list[dict[str, Any]], systems: Sequence[Any], workers: Sequence[int],
              stores: dict[str, dict[str, Any]], checks: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per set-up (``systems``: System objects): median rates, data-wait vs the median floor,
    peak PSS, disk, first batch, checks, the others' CPU; ``shown`` marks each peer's faster set-up."""
    def pick(kind: str, system: str, w: int | None = None) -> list[dict[str, Any]]:
        return [r for r in records if r["kind"] == kind and r["system"] == system and (w is None or r["workers"] == w)]

    rows = []
    for system in systems:
        s = system.name
        row: dict[str, Any] = {"system": s, "peer": system.peer or s, "setup": system.setup,
                               "disk_bytes": stores.get(s, {}).get("disk_bytes"),
                               "prepare_s": stores.get(s, {}).get("prepare_s")}
        for w in workers:
            rate = pick("rate", s, w)
            row[f"windows_per_s_w{w}"] = _median(rate, "windows_per_s")
            row[f"peak_pss_mb_w{w}"] = max((r["peak_pss_mb"] for r in rate if "error" not in r), default=None)
            row[f"first_batch_s_w{w}"] = _median(rate, "first_batch_s")
            row[f"windows_per_s_after_first_w{w}"] = _median([after_first(r) for r in rate], "rate")
        row.update(feed_summary(pick("feed", s), [r for r in pick("feed", "floor") if r.get("pair") == s]))
        row["errors"] = [r["error"] for r in records if r["system"] == s and "error" in r]
        row["other_cpu_cores"] = _median([r for r in records if r["system"] == s or r.get("pair") == s],
                                         "other_cpu_cores")
        row.update({k: checks.get(s, {}).get(k, "n/a: not run") for k in CHECK_NAMES})
        rows.append(row)
    for row in rows:
        rivals = [r for r in rows if r["peer"] == row["peer"]]
        row["shown"] = max(rivals, key=lambda r: speed(r, workers)) is row
    return rows


def speed(row: dict[str, Any], workers: Sequence[int]) -> float:
    """The geometric mean of a row's windows/s over the worker counts (0 where one is missing)."""
    rates = [row.get(f"windows_per_s_w{w}") or 0.0 for w in workers]
    return math.exp(statistics.fmean(math.log(r) for r in rates)) if all(rates) else 0.0


def shown(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows the table and plot show: each peer's faster set-up (all rows of a run saved before set-ups)."""
    return [r for r in rows if r.get("shown", True)]


def others(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The slower set-up of each peer that has two (the notes' table)."""
    return [r for r in rows if not r.get("shown", True)]


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    return "–" if value is None else format(value / scale, spec)


def short(verdict: str) -> str:
    """The table's cell for a check: yes / no / n/a (details follow the table)."""
    return verdict.split(":")[0].split(" (")[0]


def markdown_table(rows: list[dict[str, Any]], workers: Sequence[int]) -> str:
    """The summary as a markdown table."""
    rate_cols = " | ".join(f"windows/s w={w}" for w in workers)
    pss = " / ".join(f"w={w}" for w in (workers[0], workers[-1]))
    lines = [f"| system | {rate_cols} | data-wait w={FEED_WORKERS} | peak PSS MB {pss} | on disk GB | "
             "first batch s | exact resume | elastic 2→3 | equal steps | others' CPU |",
             "|---|" + "---:|" * len(workers) + "---:|---:|---:|---:|---|---|---|---:|"]
    for row in rows:
        rates = " | ".join(_fmt(row[f"windows_per_s_w{w}"], ",.0f") for w in workers)
        mem = " / ".join(_fmt(row[f"peak_pss_mb_w{w}"], ",.0f") for w in (workers[0], workers[-1]))
        wait = _fmt(None if row["data_wait"] is None else 100 * row["data_wait"], ".0f") + "%"
        lines.append(f"| {row['system']} | {rates} | {wait} | {mem} | {_fmt(row['disk_bytes'], '.2f', 1e9)} | "
                     f"{_fmt(row[f'first_batch_s_w{workers[0]}'], '.2f')} | "
                     + " | ".join(short(row[k]) for k in CHECK_NAMES) + f" | {_fmt(row.get('other_cpu_cores'), '.2f')} |")
    return "\n".join(lines)


def _short_rate(value: float | None) -> str:
    """A bar's label: 752k, 3.8k, 203."""
    if not value:
        return "–"
    return f"{value / 1e3:,.0f}k" if value >= 1e4 else f"{value / 1e3:.1f}k" if value >= 1e3 else f"{value:.0f}"


def plot(rows: list[dict[str, Any]], workers: Sequence[int], path: Path, title: str) -> None:
    """windows/s per system and worker count, data-wait with 1 worker, the checks under each name."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    marks = {"yes": "✓", "n/a": "–"}  # a check not run is no failure
    names = [r["system"] + "\n" + " ".join(f"{t}{marks.get(short(r[k]), '✗')}"
                                         for t, k in zip(("R", "E", "S"), CHECK_NAMES)) for r in rows]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 1.4]})
    width = 0.8 / len(workers)
    for i, w in enumerate(workers):
        rates = [r[f"windows_per_s_w{w}"] or 0.0 for r in rows]
        xs = [j + (i - (len(workers) - 1) / 2) * width for j in range(len(rows))]
        bars = ax.bar(xs, rates, width, label=f"num_workers={w}")
        ax.bar_label(bars, labels=[_short_rate(v) for v in rates], fontsize=6, rotation=90, padding=2)
    ax.set_yscale("log")
    top = max((r[f"windows_per_s_w{w}"] or 0.0 for r in rows for w in workers), default=0.0)
    if top:
        ax.set_ylim(top=top * 4)  # room for the labels
    ax.set_xticks(range(len(rows)), names, fontsize=7)
    ax.set_ylabel("windows / s (log; one epoch or --seconds)")
    ax.legend(fontsize=7)
    ax.set_title("loader alone; R exact resume, E elastic 2→3, S equal steps (checks run)", fontsize=8)
    waits = [100 * (r["data_wait"] or 0.0) for r in rows]
    bx.barh(range(len(rows)), waits, color="tab:red")
    bx.set_yticks(range(len(rows)), [r["system"] for r in rows], fontsize=7)
    bx.invert_yaxis()
    bx.set_xlabel(f"data-wait of a simulated 5 ms step, {FEED_WORKERS} worker (%)")
    for j, v in enumerate(waits):
        bx.text(v, j, f" {v:.0f}%", va="center", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
