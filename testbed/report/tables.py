"""Render DataFrames for people (Markdown) and programs (CSV, JSON, JSON lines).

For programs a table is data: numbers stay numbers (never "1.2 ms"), columns have machine names (the
label a person reads, "padded TTFT (ms)", as padded_TTFT_ms: `column_name`), a figure's raw
repetitions ride along in a `samples` column (JSON and JSON lines only: a list does not fit a CSV cell,
and a page of repetitions helps no reader of Markdown), or, for a table whose rows are drawn from
several records (a sweep's row per N), as the records' own samples beside the rows. A conclusion drawn
over the rows, such as a sweep's breakeven, is its own object beside them in JSON, never a row whose N
reads "breakeven"; a CSV holds the rows alone (the caller says the rest on stderr), so any CSV reader
reads it.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata

import numpy as np
import pandas as pd

FORMATS = ("md", "csv", "json", "jsonl")
# Columns only programs get: the per-repetition values of a row's figures, {figure: [values]}.
DATA_ONLY = ("samples",)
SAMPLES_SUFFIX = ".samples"


# How a label's units read in a column name: "tokens/s" -> tokens_per_s, "change %" -> change_pct
NAME_WORDS = (("/", " per "), ("%", " pct "), ("#", " number "))


def column_name(label) -> str:
    """A person's column label as a name programs can use: letters, digits, underscores and the dots of
    a flattened record's keys (metrics.token), its case kept (N stays N), units spelled out ("GFLOP/s" ->
    GFLOP_per_s, "padded TTFT (ms)" -> padded_TTFT_ms)."""
    text = str(label)
    for sign, words in NAME_WORDS:
        text = text.replace(sign, words)
    # a dot joins two keys (metrics.token); one that ends a word ("instr. change") is punctuation
    text = re.sub(r"\.(?![0-9A-Za-z])", " ", text)
    return re.sub(r"[^0-9A-Za-z.]+", "_", text).strip("_") or "column"


def for_programs(df: pd.DataFrame) -> pd.DataFrame:
    """The table with machine column names; two labels that would name one column keep apart (_2)."""
    names: list[str] = []
    for label in df.columns:
        name = column_name(label)
        names.append(name if name not in names else f"{name}_{names.count(name) + 1}")
    return df.set_axis(names, axis=1)


def record_samples(frame: pd.DataFrame) -> list[dict]:
    """The raw repetitions of each record of a flattened frame (store.frame) that has any: its id, case
    and samples by figure; for a table whose rows each draw on several records."""
    out = []
    for _, row in frame.iterrows():
        by_figure = samples(row)
        if by_figure:
            out.append({"record_id": row["record_id"], "run_id": row["run_id"], "case": row["case"],
                        "samples": by_figure})
    return out


# Unicode's categories of what is not text to show but acts on the display: controls (Cc: ESC begins
# an ANSI sequence, CR and BS rewrite a line, C1's 0x9b is ESC [ to many terminals), format characters
# (Cf: a right-to-left override reorders what follows, zero-width ones hide), surrogates (Cs: bytes
# that were not UTF-8) and the line and paragraph separators (Zl, Zp).
NOT_SHOWN = ("Cc", "Cf", "Cs", "Zl", "Zp")


def printable(text) -> str:
    """`text` with every character that acts on a display shown as its escape (ESC as \\x1b, a newline
    as \\n, U+202E as \\u202e): what an engine, a device or a file says (a refusal's reason, a
    program's output, a name) put on one terminal line or into one Markdown cell, where it can neither
    move the cursor, recolour, hide text nor break the line. The one escape every such output uses (the
    Markdown tables here, the report's Markdown, testbed's terminal lines); HTML is the report
    templates' to escape."""
    text = str(text)
    if text.isprintable():  # the usual case, checked in C
        return text
    return "".join(c if unicodedata.category(c) not in NOT_SHOWN else
                   c.encode("unicode_escape", "backslashreplace").decode("ascii") for c in text)


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
    return printable(v)


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
    cols = [printable(c) for c in df.columns]
    body = [[_cell(v) for v in row] for row in df.itertuples(index=False)]
    widths = [max(len(c), *(len(r[i]) for r in body)) for i, c in enumerate(cols)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(cols), "| " + " | ".join("-" * w for w in widths) + " |", *map(line, body)])


def breakeven_line(breakeven: dict) -> str:
    return printable(f"breakeven ({breakeven['source']}): {breakeven['says']}")


def render(df: pd.DataFrame, fmt: str, breakevens: list[dict] = (), behind: list[dict] = ()) -> str:
    """The table in `fmt`; `breakevens` (dicts with at least `source` and `says`): lines under the
    Markdown table, a `breakevens` list beside `rows` in JSON, `{"breakeven": ...}` lines after the rows
    in JSON lines, and never in the CSV (rows alone: the caller says them on stderr). `behind`: the
    samples of the records the rows draw on (record_samples), for a table without a `samples` column:
    a `samples` list beside `rows` in JSON, `{"samples": ...}` lines in JSON lines."""
    df = whole_numbers(df)
    if fmt == "md":
        return "\n".join([markdown(df), *("\n" + breakeven_line(b) for b in breakevens)])
    if fmt == "csv":
        return for_programs(for_people(df)).to_csv(index=False)
    if fmt in ("json", "jsonl"):  # numbers stay numbers, to the last bit; missing values are null
        rows = [{k: _json_value(v) for k, v in row.items()} for row in for_programs(df).to_dict(orient="records")]
        if fmt == "json":
            data = {"rows": rows, "breakevens": list(breakevens)}
            if behind:
                data["samples"] = list(behind)
            return json.dumps(data, indent=1, default=str)
        return "\n".join([*(json.dumps(r, default=str) for r in rows),
                          *(json.dumps({"breakeven": b}) for b in breakevens),
                          *(json.dumps({"samples": s}) for s in behind)])
    raise ValueError(f"format {fmt!r} is not one of {FORMATS}")
