"""Figures from emulated devices are real for correctness and never for speed.

A profile with capability `emulated` (qemu-user, the loopback adbd with qemu behind it, lavapipe's
software Vulkan) stores its records with `emulated: true`. Their verdicts count like any device's;
their figures are left out of every table, breakeven choice, regression check and plot that speaks
of speed, and are listed apart with this reason, never mixed with real devices' figures.

Instruction counts (unit "instructions", testbed.measure.history.INSTRUCTIONS) are the exception: an
emulator counts the instructions the program executes exactly, so an emulated record's counts are kept
(`split` keeps a copy of the record holding only its counts) for the count tables and the count judge,
while its times are listed apart as before.
"""

from __future__ import annotations

import pandas as pd

REASON = ("computed under emulation (qemu-user, the loopback adbd, lavapipe): real for correctness, "
          "never for speed")


COUNT_UNIT = "instructions"  # testbed.measure.history.INSTRUCTIONS (not imported: history imports this module's users)


def is_emulated_figure(record: dict) -> bool:
    return record.get("kind") == "measure" and bool(record.get("emulated"))


def is_count(fig) -> bool:
    return isinstance(fig, dict) and fig.get("unit") == COUNT_UNIT


def split(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """(records a table or judge may use, emulated figures to list apart). An emulated measure record
    with instruction counts is kept as a copy holding only those; its other figures are listed apart
    (a copy holding only them)."""
    kept, apart = [], []
    for r in records:
        if not is_emulated_figure(r):
            kept.append(r)
            continue
        figures = r.get("figures") or {}
        counts = {k: f for k, f in figures.items() if is_count(f)}
        if counts:
            kept.append({**r, "figures": counts})
        if len(counts) < len(figures) or not figures:
            apart.append({**r, "figures": {k: f for k, f in figures.items() if k not in counts}})
    return kept, apart


def split_frame(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The same for a flattened frame (one row per record): an emulated measure row is kept only for its
    counts (its other figures' columns emptied), and listed apart for its other figures."""
    if df.empty or "emulated" not in df:
        return df, df.iloc[:0]
    emulated = (df["kind"] == "measure") & df["emulated"].fillna(False).astype(bool)
    units = [c for c in df.columns if c.startswith("figures.") and c.endswith(".unit")]
    counted = [c[:-len(".unit")] for c in units if (df.loc[emulated, c] == COUNT_UNIT).any()]
    if not counted:
        return df[~emulated], df[emulated]
    has_count = emulated & pd.concat([df[f"{c}.unit"] == COUNT_UNIT for c in counted], axis=1).any(axis=1)
    kept = df[~emulated | has_count].copy()
    timed = [c for c in df.columns if c.startswith("figures.") and not any(c.startswith(k + ".") for k in counted)]
    kept.loc[emulated[kept.index], timed] = None  # an emulated row keeps its counts, never its times
    return kept, df[emulated]


def listing(records: list[dict]) -> pd.DataFrame:
    """One row per device and experiment: how many figures were left out."""
    if not records:
        return pd.DataFrame(columns=["device", "experiment", "figures left out"])
    df = pd.DataFrame([{"device": r["device"], "experiment": r["experiment"]} for r in records])
    return df.groupby(["device", "experiment"]).size().rename("figures left out").reset_index()
