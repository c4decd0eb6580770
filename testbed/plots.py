"""The report's plots (matplotlib, written as PNG files into the report folder).

Each function draws from a table or from stored records and returns the file name it wrote, so the
page can refer to its images by relative path.
"""

from __future__ import annotations

import datetime as dt
import re
from itertools import groupby
from pathlib import Path

import pandas as pd

from testbed import history

DPI = 100


def _pyplot():
    """matplotlib, imported when the first plot is drawn (it is slow to import, and the CLI imports
    this module for every command), drawing to files only: a lab's cron host has no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=DPI)
    _pyplot().close(fig)
    return name


def tail_plot(out: Path, device: str, df: pd.DataFrame, breakeven: int | None,
              seed_df: pd.DataFrame | None, seed_breakeven: int | None) -> str:
    """Padded and scalar throughput against tail, the breakeven marked; the seed's dashed beside
    (unless these are the seed's own figures: seed_df None)."""
    fig, ax = _pyplot().subplots(figsize=(7, 4))
    df = df.sort_values("tail")
    ax.plot(df["tail"], df.padded_tps, "o-", label=f"{device} padded")
    ax.plot(df["tail"], df.scalar_tps, "s-", label=f"{device} scalar")
    if breakeven is not None:
        ax.axvline(breakeven, color="k", lw=1, label=f"breakeven {breakeven}")
    if seed_df is not None:
        ax.plot(seed_df["tail"], seed_df.padded_tps, "o--", alpha=0.5, label="seed padded")
        ax.plot(seed_df["tail"], seed_df.scalar_tps, "s--", alpha=0.5, label="seed scalar")
        if seed_breakeven is not None:
            ax.axvline(seed_breakeven, color="grey", ls=":", lw=1, label=f"seed breakeven {seed_breakeven}")
    ax.set_xlabel("tail (tokens after the last full chunk)")
    ax.set_ylabel("prefill tokens/s")
    ax.set_title(f"padded vs scalar tail: {device}", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, out, f"tail-{slug(device)}.png")


def chunk_plot(out: Path, device: str, calls: dict[int, float], decode_s: float | None) -> str:
    """One chunk call's time against C, and the time of C decode steps for comparison."""
    fig, ax = _pyplot().subplots(figsize=(7, 4))
    chunks = sorted(calls)
    ax.plot(chunks, [calls[c] for c in chunks], "o-", label="one chunk call")
    if decode_s:
        ax.plot(chunks, [c * decode_s for c in chunks], "s--", label=f"C decode steps ({decode_s:.3g} s each)")
    ax.set_xlabel("chunk size C (tokens)")
    ax.set_ylabel("seconds")
    ax.set_title(f"chunk call and decode time: {device}")
    ax.legend(fontsize=8)
    return _save(fig, out, f"chunk-{slug(device)}.png")


# At most this many lines per history plot: the series with the most nights.
MAX_LINES = 8
# What counts as throughput: tokens (gdn, tail) or rows of a graph call (chunk_prefill) per second.
THROUGHPUT_UNITS = ("tokens/s", "rows/s")


def history_plots(out: Path, records: list[dict], nights: int) -> list[dict]:
    """Per experiment and device: every throughput figure over its last `nights` runs."""
    points: dict[tuple, list[tuple[dt.datetime, float, str]]] = {}
    measures = sorted((r for r in records if r["kind"] == "measure"),
                      key=lambda r: (r["experiment"], r["device"], r["started"]))
    for r in measures:
        for name, fig in r["figures"].items():
            if fig["unit"] in THROUGHPUT_UNITS:
                key = (r["experiment"], r["device"], f"{r['case']} {name} [{history.config_key(r)[:6]}]")
                points.setdefault(key, []).append((dt.datetime.fromisoformat(r["started"]), fig["median"], fig["unit"]))
    images = []
    for (experiment, device), group in groupby(sorted(points), key=lambda k: k[:2]):
        series = sorted(group, key=lambda k: -len(points[k]))[:MAX_LINES]
        if max(len(points[k][-nights:]) for k in series) < 2:
            continue  # one night is not a trend
        fig, ax = _pyplot().subplots(figsize=(8, 4))
        for key in series:
            when, value, _ = zip(*points[key][-nights:])
            ax.plot(when, value, "o-", label=key[2])
        ax.set_ylabel(" or ".join(sorted({points[k][0][2] for k in series})) + " (median)")
        ax.set_title(f"{experiment} on {device}: last {nights} runs")
        ax.legend(fontsize=6)
        fig.autofmt_xdate()
        images.append({"file": _save(fig, out, f"history-{slug(experiment)}-{slug(device)}.png"),
                       "caption": f"{experiment} on {device}: throughput over recent runs"})
    return images
