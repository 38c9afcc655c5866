"""peers.py's table and plot: one row per system, its rates, data-wait, memory, disk and checks."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

FEED_WORKERS = 1
CHECK_NAMES = ("exact_resume", "elastic_resume", "equal_steps")


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
             "first batch s | exact resume | elastic 2→3 | equal steps |",
             "|---|" + "---:|" * len(workers) + "---:|---:|---:|---:|---|---|---|"]
    for row in rows:
        rates = " | ".join(_fmt(row[f"windows_per_s_w{w}"], ",.0f") for w in workers)
        mem = " / ".join(_fmt(row[f"peak_pss_mb_w{w}"], ",.0f") for w in (workers[0], workers[-1]))
        wait = _fmt(None if row["data_wait"] is None else 100 * row["data_wait"], ".0f") + "%"
        lines.append(f"| {row['system']} | {rates} | {wait} | {mem} | {_fmt(row['disk_bytes'], '.2f', 1e9)} | "
                     f"{_fmt(row[f'first_batch_s_w{workers[0]}'], '.2f')} | "
                     + " | ".join(short(row[k]) for k in CHECK_NAMES) + " |")
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

    names = [r["system"] + "\n" + " ".join(f"{t}{'✓' if short(r[k]) == 'yes' else '✗'}"
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
