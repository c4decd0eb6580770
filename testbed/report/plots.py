"""The report's plots (matplotlib, written as PNG files into the report folder).

Each function draws from a table or from stored records and returns the file name it wrote, so the
page can refer to its images by relative path.
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from testbed.measure import history
from testbed.report import implementations

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


def literal(text: str) -> str:
    """A name as matplotlib draws it, character for character: a `$` would start mathtext, and a
    device, backend or case named with `$\\frac{$` would stop the report from being drawn."""
    return str(text).replace("$", r"\$")


def legend_outside(ax) -> None:
    """The legend to the right of the plotted area, never over the data; `_save` widens the image to
    hold it."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, frameon=False)


def with_spread(ax, xs, medians, lows=None, highs=None, fmt="o-", **style) -> None:
    """Medians joined by a line, each with an error bar from its least to its greatest repetition
    (a figure without its spread is not shown as if it were exact); plain points where none is known."""
    if lows is None or highs is None:
        ax.plot(xs, medians, fmt, **style)
        return
    below = [max(m - lo, 0.0) for m, lo in zip(medians, lows)]
    above = [max(hi - m, 0.0) for m, hi in zip(medians, highs)]
    ax.errorbar(xs, medians, yerr=[below, above], fmt=fmt, capsize=3, elinewidth=0.8, **style)


def _columns(df: pd.DataFrame, *names: str):
    return [df[n].tolist() if n in df else None for n in names]


def _save(fig, out: Path, name: str) -> str:
    fig.savefig(out / name, dpi=DPI, bbox_inches="tight")  # the legend outside the axes is kept
    _pyplot().close(fig)
    return name


def tail_plot(out: Path, name: str, df: pd.DataFrame, breakeven: int | None,
              seed_df: pd.DataFrame | None, seed_breakeven: int | None) -> str:
    """Padded and scalar throughput against tail (median, bars from min to max where the records
    have them), the seed's dashed beside (unless these are the seed's own figures: seed_df None).

    The throughput axis is logarithmic: a host at 15-50 tok/s and the seed's M4 Pro at 140-440 differ
    tenfold, and on one linear axis the slower pair lies flat under the faster one, its crossing lost.
    On a log axis the gap between a pair's curves is their ratio, whatever their scale, so each pair's
    crossing reads alike; each breakeven is marked on its own pair, a line at its tail and a star where
    padding starts to win."""
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, ax = plt.subplots(figsize=(7, 4))
    df = df.sort_values("tail")
    colour = {"padded": "tab:blue", "scalar": "tab:orange"}
    for mode, fmt in (("padded", "o-"), ("scalar", "s-")):  # the title names the implementation
        with_spread(ax, df["tail"].tolist(), df[f"{mode}_tps"].tolist(),
                    *_columns(df, f"{mode}_tps_min", f"{mode}_tps_max"), fmt=fmt, label=mode, color=colour[mode])
    _mark_breakeven(ax, df, breakeven, "k", "-", "breakeven")
    if seed_df is not None:
        seed_df = seed_df.sort_values("tail")
        for mode, fmt in (("padded", "o--"), ("scalar", "s--")):
            ax.plot(seed_df["tail"], seed_df[f"{mode}_tps"], fmt, alpha=0.5, color=colour[mode], label=f"seed {mode}")
        _mark_breakeven(ax, seed_df, seed_breakeven, "grey", ":", "seed breakeven")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # 10, 20, 50, 100, ...: readable figures
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("tail (tokens after the last full chunk)")
    ax.set_ylabel("prefill tokens/s (log scale)")
    ax.set_title(literal(f"padded vs scalar tail: {name}"), fontsize=9)
    legend_outside(ax)
    return _save(fig, out, f"tail-{slug(name)}.png")


def _mark_breakeven(ax, df: pd.DataFrame, tail: int | None, colour: str, style: str, what: str) -> None:
    """The breakeven of one sweep: a line at its tail and a star on its padded curve there."""
    if tail is None:
        return
    ax.axvline(tail, color=colour, ls=style, lw=1, label=f"{what} {tail}")
    at = df.loc[df["tail"] == tail, "padded_tps"]
    if len(at):
        ax.plot([tail], [float(at.iloc[0])], "*", color=colour, markersize=12, zorder=5)


def chunk_plot(out: Path, device: str, calls: dict[int, float], decode_s: float | None,
               spread: dict[int, tuple[float, float]] | None = None) -> str:
    """One chunk call's time against C (median, bars from min to max where `spread` has them), and
    the time of C decode steps for comparison."""
    fig, ax = _pyplot().subplots(figsize=(7, 4))
    chunks = sorted(calls)
    known = spread is not None and all(c in spread for c in chunks)
    with_spread(ax, chunks, [calls[c] for c in chunks], [spread[c][0] for c in chunks] if known else None,
                [spread[c][1] for c in chunks] if known else None, label="one chunk call")
    if decode_s:
        ax.plot(chunks, [c * decode_s for c in chunks], "s--", label=f"C decode steps ({decode_s:.3g} s each)")
    ax.set_xlabel("chunk size C (tokens)")
    ax.set_ylabel("seconds")
    ax.set_title(literal(f"chunk call and decode time: {device}"), fontsize=9)
    legend_outside(ax)
    return _save(fig, out, f"chunk-{slug(device)}.png")


# At most this many lines per history plot: the series with the most runs.
MAX_LINES = 8
# What counts as throughput: tokens (gdn, tail) or rows of a graph call (chunk_prefill) per second.
THROUGHPUT_UNITS = ("tokens/s", "rows/s")
# Where results and the machine's own description are kept says nothing about what a series measured.
NOT_A_SETTING = ("results_dir", "fixtures_dir", "device.")


def run_label(record: dict) -> str:
    """A run on the history axis: its short commit over its night (the date it started)."""
    commit = str(record["git_commit"])
    short = commit[:7] + ("+" if commit.endswith("-dirty") else "")  # + : built from uncommitted changes
    return f"{short}\n{record['started'][:10]}"


def setting_differences(records: list[dict]) -> dict[str, str]:
    """Per config key (history.config_key): the config values in which its runs differ from the other
    configs among `records`, as "chunk=16 threads=2"; "" when there is one config."""
    configs = {history.config_key(r): r["config"] for r in records}
    keys = sorted({k for c in configs.values() for k in c if not k.startswith(NOT_A_SETTING)})
    differ = [k for k in keys if len({repr(c.get(k)) for c in configs.values()}) > 1]
    return {key: " ".join(f"{k}={c.get(k)}" for k in differ) for key, c in configs.items()}


def history_plots(out: Path, records: list[dict], nights: int) -> list[dict]:
    """Per experiment, device, backend and model (never mixed): every throughput figure over its last
    `nights` runs, one point per run placed by commit and night, each series named by its case, figure
    and the settings that set it apart, never by a config hash."""
    measures = [r for r in records if r["kind"] == "measure"
                and any(f.get("unit") in THROUGHPUT_UNITS for f in r["figures"].values())]
    images = []
    groups = sorted({(r["experiment"], implementations.of(r)) for r in measures})
    for experiment, impl in groups:
        group = history.by_run_time([r for r in measures if (r["experiment"], implementations.of(r)) == (experiment, impl)])
        settings = setting_differences(group)
        runs = list(dict.fromkeys(r["run_id"] for r in group))[-nights:]
        if len(runs) < 2:
            continue  # one run is not a trend
        position = {run: i for i, run in enumerate(runs)}
        points: dict[str, dict[int, tuple[float, float, float]]] = {}  # median, min, max
        units = set()
        for r in group:
            if r["run_id"] not in position:
                continue
            for name, fig in r["figures"].items():
                if fig.get("unit") in THROUGHPUT_UNITS:
                    label = " ".join(filter(None, (r["case"], name, settings[history.config_key(r)])))
                    points.setdefault(label, {})[position[r["run_id"]]] = (fig["median"], fig.get("min", fig["median"]),
                                                                          fig.get("max", fig["median"]))
                    units.add(fig["unit"])
        series = sorted(points, key=lambda label: (-len(points[label]), label))[:MAX_LINES]
        if max(len(points[label]) for label in series) < 2:
            continue
        fig, ax = _pyplot().subplots(figsize=(8, 4))
        for label in series:
            xs = sorted(points[label])
            with_spread(ax, xs, *([points[label][x][i] for x in xs] for i in range(3)), label=literal(label))
        first_of_run = {r["run_id"]: r for r in reversed(group)}
        ax.set_xticks(range(len(runs)), [run_label(first_of_run[run]) for run in runs], fontsize=7)
        ax.set_xlabel("run (commit, night)")
        ax.set_ylabel(" or ".join(sorted(units)) + " (median, min-max)")
        ax.set_title(literal(f"{experiment} on {impl.label}: last {len(runs)} runs"), fontsize=9)
        legend_outside(ax)
        name = f"history-{slug(experiment)}-{slug(impl.label)}.png"
        images.append({"file": _save(fig, out, name),
                       "caption": f"{experiment} on {impl.label}: throughput over recent runs"})
    return images


# At most this many plots of judged quantities: flagged ones first, then those the machine explained,
# then the rest by the length of their history (a page of hundreds of plots is read by no one; report.json
# and `testbed compare` have every figure).
MAX_JUDGED_PLOTS = 24
BAND = 2.0  # the baseline band: the level before, times exp(+-BAND run-to-run noise)


def judged_plot(out: Path, judgement: "history.Judgement", flagged: bool) -> str:
    """One judged quantity over the runs it was judged on: each run's median with its min-max bar, the
    level before the latest step as a band (+-BAND x its run-to-run noise), the new level as a dashed
    line, the flagged runs marked, each run labelled by its commit and night."""
    import math

    rows, v, name = judgement.rows, judgement.verdict, judgement.what
    figs = [r["figures"][name] for r in rows]
    xs = list(range(len(rows)))
    fig, ax = _pyplot().subplots(figsize=(8, 4))
    with_spread(ax, xs, [float(f["median"]) for f in figs], [float(f.get("min", f["median"])) for f in figs],
                [float(f.get("max", f["median"])) for f in figs], label=literal(f"{name} (median, min-max)"))
    if v.before is not None and v.previous is not None:
        noise = math.log1p(v.noise or 0.0)
        ax.fill_between([v.previous - 0.4, len(rows) - 0.6], v.before * math.exp(-BAND * noise),
                        v.before * math.exp(BAND * noise), alpha=0.2, color="tab:green",
                        label=f"baseline: level before +-{BAND:g} x noise ({v.noise or 0:.1%})")
        if v.start is not None and v.after is not None:
            ax.hlines(v.after, v.start - 0.4, len(rows) - 0.6, colors="tab:red", linestyles="dashed",
                      label=f"new level ({v.change:+.1%})")
            marked = xs[v.start:]
            ax.plot(marked, [float(figs[i]["median"]) for i in marked], "v", color="tab:red", markersize=9,
                    label="flagged" if flagged else literal(f"not flagged: {v.reason}"[:60]))
    step = max(1, len(rows) // 12)
    ax.set_xticks(xs[::step], [run_label(r) for r in rows[::step]], fontsize=7)
    ax.set_xlabel("run (commit, night)")
    ax.set_ylabel(literal(figs[-1].get("unit", "")))
    experiment, device, config, case = judgement.series[:4]
    ax.set_title(literal(f"{experiment} on {device}: {case} {name}"), fontsize=9)
    legend_outside(ax)
    return _save(fig, out, f"judged-{slug(experiment)}-{slug(device)}-{config}-{slug(case)}-{slug(name)}.png")


def judged_plots(out: Path, judgements: list["history.Judgement"], flags: list["history.Flag"]) -> tuple[list[dict], int]:
    """A plot per judged quantity with at least two runs, as asv draws one per benchmark, whether flagged
    or not (a flag is best read against the history that had none): flagged ones first, then each step
    the machine or a revert explained, then the others, the longest histories first. Returns the images
    and how many quantities were left unplotted over MAX_JUDGED_PLOTS."""
    flagged = {(f.experiment, f.device, f.config_key, f.case, f.what) for f in flags if f.kind == "figure"}

    def order(j: "history.Judgement") -> tuple:
        explained = j.verdict.reason.startswith(("the machine's", "back:"))
        return ((*j.series[:4], j.what) not in flagged, not explained, -len(j.rows))

    chosen = sorted((j for j in judgements if len(j.rows) >= 2), key=order)
    images = []
    for j in chosen[:MAX_JUDGED_PLOTS]:
        experiment, device, _, case = j.series[:4]
        images.append({"file": judged_plot(out, j, (*j.series[:4], j.what) in flagged),
                       "caption": f"{experiment} on {device}, {case} {j.what}: {j.verdict.reason}"})
    return images, max(0, len(chosen) - MAX_JUDGED_PLOTS)
