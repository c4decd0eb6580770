"""Figures from emulated devices are real for correctness and never for speed.

A profile with capability `emulated` (qemu-user, the loopback adbd with qemu behind it, lavapipe's
software Vulkan) stores its records with `emulated: true`. Their verdicts count like any device's;
their figures are left out of every table, breakeven choice, regression check and plot that speaks
of speed, and are listed apart with this reason, never mixed with real devices' figures.
"""

from __future__ import annotations

import pandas as pd

REASON = ("computed under emulation (qemu-user, the loopback adbd, lavapipe): real for correctness, "
          "never for speed")


def is_emulated_figure(record: dict) -> bool:
    return record.get("kind") == "measure" and bool(record.get("emulated"))


def split(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """(records a speed table may use, emulated figures to list apart)."""
    kept, apart = [], []
    for r in records:
        (apart if is_emulated_figure(r) else kept).append(r)
    return kept, apart


def split_frame(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    if df.empty or "emulated" not in df:
        return df, df.iloc[:0]
    apart = (df["kind"] == "measure") & df["emulated"].fillna(False).astype(bool)
    return df[~apart], df[apart]


def listing(records: list[dict]) -> pd.DataFrame:
    """One row per device and experiment: how many figures were left out."""
    if not records:
        return pd.DataFrame(columns=["device", "experiment", "figures left out"])
    df = pd.DataFrame([{"device": r["device"], "experiment": r["experiment"]} for r in records])
    return df.groupby(["device", "experiment"]).size().rename("figures left out").reset_index()
