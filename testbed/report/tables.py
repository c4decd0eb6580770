"""Render DataFrames for people (Markdown) and programs (CSV, JSON, JSON lines).

For programs a table is data: numbers stay numbers (never "1.2 ms"), a figure's raw repetitions ride
along in a `samples` column (JSON and JSON lines only: a list does not fit a CSV cell, and a page of
repetitions helps no reader of Markdown), and a conclusion drawn over the rows, such as a sweep's
breakeven, is its own object beside them, never a row whose N reads "breakeven".
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd

FORMATS = ("md", "csv", "json", "jsonl")
# Columns only programs get: the per-repetition values of a row's figures, {figure: [values]}.
DATA_ONLY = ("samples",)
SAMPLES_SUFFIX = ".samples"


def _cell(v) -> str:
    if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        # a count or an id a missing value made float (chunk 64, token 468, 37412345 instructions): whole,
        # to the last digit, however large (in 3 digits a 1% change of a count would not show)
        if v.is_integer() and abs(v) < 2**53:
            return str(int(v))
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
            return f"{v:.3g}"
        return f"{v:.4g}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def whole_numbers(df: pd.DataFrame) -> pd.DataFrame:
    """Float columns whose every value is a whole number (integers pandas made float because a row
    lacks them: chunk, token, calls) as integers again, missing values kept missing."""
    out = df.copy()
    for column in df.columns:
        values = df[column]
        if values.dtype.kind != "f":
            continue
        present = values.dropna().to_numpy()
        if present.size and np.all(np.isfinite(present)) and np.all(present == np.round(present)) \
                and np.all(np.abs(present) < 2**53):
            out[column] = values.astype("Int64")
    return out


def _json_value(v):
    if isinstance(v, np.generic):
        v = v.item()
    if v is None or v is pd.NA or v is pd.NaT or (isinstance(v, float) and math.isnan(v)):
        return None
    return v


def samples(row: pd.Series) -> dict[str, list[float]]:
    """The raw repetitions of every figure of one flattened record (store.frame's row), by figure."""
    return {column[len("figures."):-len(SAMPLES_SUFFIX)]: list(value) for column, value in row.items()
            if column.startswith("figures.") and column.endswith(SAMPLES_SUFFIX) and isinstance(value, list)}


def for_people(df: pd.DataFrame) -> pd.DataFrame:
    return df.drop(columns=[c for c in DATA_ONLY if c in df.columns])


def markdown(df: pd.DataFrame) -> str:
    df = for_people(df)
    if df.empty:
        return "(no rows)"
    cols = [str(c) for c in df.columns]
    body = [[_cell(v) for v in row] for row in df.itertuples(index=False)]
    widths = [max(len(c), *(len(r[i]) for r in body)) for i, c in enumerate(cols)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(cols), "| " + " | ".join("-" * w for w in widths) + " |", *map(line, body)])


def breakeven_line(breakeven: dict) -> str:
    return f"breakeven ({breakeven['source']}): {breakeven['says']}"


def render(df: pd.DataFrame, fmt: str, breakevens: list[dict] = ()) -> str:
    """The table in `fmt`; `breakevens` (dicts with at least `source` and `says`) after it: lines under
    the Markdown table, `#` comment lines after the CSV (pandas' read_csv(comment="#") skips them, as
    the seeds' fixtures do), a `breakevens` list beside `rows` in JSON, `{"breakeven": ...}` lines
    after the rows in JSON lines."""
    df = whole_numbers(df)
    if fmt == "md":
        return "\n".join([markdown(df), *("\n" + breakeven_line(b) for b in breakevens)])
    if fmt == "csv":
        return for_people(df).to_csv(index=False) + "".join(f"# {breakeven_line(b)}\n" for b in breakevens)
    if fmt in ("json", "jsonl"):  # numbers stay numbers, to the last bit; missing values are null
        rows = [{str(k): _json_value(v) for k, v in row.items()} for row in df.to_dict(orient="records")]
        if fmt == "json":
            return json.dumps({"rows": rows, "breakevens": list(breakevens)}, indent=1, default=str)
        return "\n".join([*(json.dumps(r, default=str) for r in rows), *(json.dumps({"breakeven": b}) for b in breakevens)])
    raise ValueError(f"format {fmt!r} is not one of {FORMATS}")
