"""Render DataFrames for people (Markdown) and programs (CSV, JSON)."""

from __future__ import annotations

import json
import math

import pandas as pd

FORMATS = ("md", "csv", "json", "jsonl")


def _cell(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
            return f"{v:.3g}"
        return f"{v:.4g}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def markdown(df: pd.DataFrame) -> str:
    if df.empty:
        return "(no rows)"
    cols = [str(c) for c in df.columns]
    body = [[_cell(v) for v in row] for row in df.itertuples(index=False)]
    widths = [max(len(c), *(len(r[i]) for r in body)) for i, c in enumerate(cols)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(cols), "| " + " | ".join("-" * w for w in widths) + " |", *map(line, body)])


def render(df: pd.DataFrame, fmt: str) -> str:
    if fmt == "md":
        return markdown(df)
    if fmt == "csv":
        return df.to_csv(index=False)
    if fmt in ("json", "jsonl"):  # numbers stay numbers; missing values are null
        rows = json.loads(df.to_json(orient="records", double_precision=15))
        return json.dumps(rows, indent=1) if fmt == "json" else "\n".join(json.dumps(r) for r in rows)
    raise ValueError(f"format {fmt!r} is not one of {FORMATS}")
