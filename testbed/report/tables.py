"""Render DataFrames for people (Markdown, and the terminal) and programs (CSV, JSON, JSON lines).

One rule for every number a person reads (`number`: whole numbers whole, others to 4 significant
digits, very small or large ones in 3 with an exponent), used by the tables, the terminal's sentences
and the report alike. On the terminal a line fits WIDTH columns (`for_terminal`): a table wider than
that shows its first columns, long text cut short, and names the ones left out (`testbed table
EXPERIMENT --format md|csv|json` has them all); a sentence wraps (`wrap`).

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
import textwrap
import unicodedata

import numpy as np
import pandas as pd

FORMATS = ("md", "csv", "json", "jsonl")
# Columns only programs get: the per-repetition values of a row's figures, {figure: [values]}; a row's
# decisions in full (sentences a footer prints under the table, never cut short in a cell).
DATA_ONLY = ("samples", "decisions")
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


def number(v: float) -> str:
    """A number as people read it, everywhere testbed prints one: a count or an id a missing value made
    float (chunk 64, token 468, 37412345 instructions) whole, to the last digit however large (in 3
    digits a 1% change of a count would not show); otherwise 4 significant digits (one decimal from
    100 up), and 3 with an exponent below 1e-3 or from 1e6 (a margin of 0.8660254037844386 reads 0.866)."""
    v = float(v)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v.is_integer() and abs(v) < 2**53:
        return str(int(v))
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
        return f"{v:.3g}"
    return f"{v:.4g}" if abs(v) < 100 else f"{v:.1f}"
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
    if isinstance(v, (float, np.floating)):
        return number(v)
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


def choice_line(choice: dict) -> str:
    """A choice over the rows (a best chunk size, chunked against token by token) as one sentence."""
    return f"{choice['decision']} by {choice['by']} ({choice['source']}): {choice['says']}"


def render(df: pd.DataFrame, fmt: str, breakevens: list[dict] = (), behind: list[dict] = (),
           choices: list[dict] = (), more: dict[str, pd.DataFrame] | None = None) -> str:
    """The table in `fmt`; `breakevens` (dicts with at least `source` and `says`) and `choices` (a best
    chunk size and the like, testbed.measure.decisions: with `decision`, `by`, `source`, `says`, and
    `label`, the choice in a table cell's words): lines under the Markdown table, `breakevens` and
    `choices` lists beside `rows` in JSON, `{"breakeven": ...}` and `{"choice": ...}` lines after the
    rows in JSON lines, and never in the CSV (rows alone: the caller says them on stderr). `behind`:
    the samples of the records the rows draw on (record_samples), for a table without a `samples`
    column: a `samples` list beside `rows` in JSON, `{"samples": ...}` lines in JSON lines. `more`: tables
    drawn over the same records ({name: table}): each under its name after the Markdown table, a list of
    rows under its name in JSON, `{name: row}` lines in JSON lines; the CSV holds the main rows alone."""
    df, more = whole_numbers(df), {name: whole_numbers(t) for name, t in (more or {}).items()}

    def data_rows(table):
        return [{k: _json_value(v) for k, v in row.items()} for row in for_programs(table).to_dict(orient="records")]

    if fmt == "md":
        return "\n".join([markdown(df), *("\n" + breakeven_line(b) for b in breakevens),
                          *("\n" + choice_line(c) for c in choices),
                          *(f"\n{name}:\n{markdown(t)}" for name, t in more.items())])
    if fmt == "csv":
        return for_programs(for_people(df)).to_csv(index=False)
    if fmt in ("json", "jsonl"):  # numbers stay numbers, to the last bit; missing values are null
        rows = data_rows(df)
        if fmt == "json":
            data = {"rows": rows, "breakevens": list(breakevens), "choices": list(choices)}
            if behind:
                data["samples"] = list(behind)
            data |= {name: data_rows(t) for name, t in more.items() if name not in data}
            return json.dumps(data, indent=1, default=str)
        return "\n".join([*(json.dumps(r, default=str) for r in rows),
                          *(json.dumps({"breakeven": b}, default=str) for b in breakevens),
                          *(json.dumps({"choice": c}, default=str) for c in choices),
                          *(json.dumps({"samples": s}) for s in behind),
                          *(json.dumps({name: r}, default=str) for name, t in more.items() for r in data_rows(t))])
    raise ValueError(f"format {fmt!r} is not one of {FORMATS}")


# --- the terminal -----------------------------------------------------------------------------------

WIDTH = 120      # the columns a terminal line may take
TEXT_CELL = 40   # the terminal cuts a text cell no shorter than this (the formats keep it whole)


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _width(df: pd.DataFrame) -> int:
    """The columns the table's Markdown takes."""
    return 1 + sum(max(len(str(c)), *(len(_cell(v)) for v in df[c])) + 3 for c in df.columns) if len(df) else 0


def fit(df: pd.DataFrame, width: int = WIDTH, settings=None) -> tuple[pd.DataFrame, dict[str, str], list[str]]:
    """The table as the terminal shows it within `width` columns. Where it is wider: the columns holding
    one value in every row, from the first, are said once above the table instead, as many as it takes
    (of `settings` only, where given: a sweep's configuration, never its results); then the longest text
    cells are cut short, each column no more than it must and none below TEXT_CELL characters; then as
    many columns, from the first, as fit are kept. Returns (that table, the columns said once {name:
    value}, the columns left out)."""
    shown = for_people(whole_numbers(df))
    if shown.empty or _width(shown) <= width:
        return shown, {}, []
    once = {}  # one value in every row, from the first such column, as many as it takes to fit
    for c in list(shown.columns):
        if _width(shown) <= width:
            break
        if settings is not None and c not in settings:
            continue
        if len(shown) > 1 and shown[c].map(_cell).nunique() == 1 and _cell(shown[c].iloc[0]):
            once[str(c)] = _cell(shown[c].iloc[0])
            shown = shown.drop(columns=[c])
    # cut long text only where that makes the table fit: a cut that still leaves columns out loses the
    # text and keeps nothing more
    texts = [c for c in shown.columns if pd.api.types.is_string_dtype(shown[c]) or shown[c].dtype == object]
    widest = {c: max(len(str(c)), *(len(_cell(v)) for v in shown[c])) for c in texts}
    if sum(max(w - max(TEXT_CELL, len(str(c))), 0) for c, w in widest.items()) >= _width(shown) - width:
        shown = shown.copy()
        for c in texts:  # cut what the terminal shows (an escape is several characters), never the raw text
            shown[c] = [_cell(v) if isinstance(v, str) else v for v in shown[c]]
        while _width(shown) > width:
            longest = max(texts, key=lambda c: max(len(_cell(v)) for v in shown[c]))
            longest_width = max(len(_cell(v)) for v in shown[longest])
            cut = max(TEXT_CELL, longest_width - (_width(shown) - width), len(str(longest)))
            if cut >= longest_width:
                break  # nothing left to cut: the columns left out below make it fit
            shown[longest] = [_shorten(v, cut) if isinstance(v, str) else v for v in shown[longest]]
    kept: list = []
    for column in shown.columns:
        if kept and _width(shown[[*kept, column]]) > width:
            break
        kept.append(column)
    return shown[kept], once, [str(c) for c in shown.columns if c not in kept]


def for_terminal(df: pd.DataFrame, full: str = "", width: int = WIDTH, settings=None) -> str:
    """A table as Markdown that fits the terminal (`fit`): the columns of one value said above it, and,
    where columns were left out, a line naming them and `full`, the command that prints them all."""
    shown, once, left_out = fit(df, width, settings)
    text = markdown(shown)
    if once:
        text = _pack([f"{name}: {value}" for name, value in once.items()], "; ", width) + "\n" + text
    if left_out:
        names = [f"({len(left_out)} more column(s): {left_out[0]}", *left_out[1:]]
        names[-1] += (f"; all of them: {full})" if full else ")")
        text += "\n" + _pack(names, ", ", width)
    return text


def _pack(parts: list[str], joint: str, width: int) -> str:
    """Parts joined by `joint` in lines of at most `width` columns, never breaking inside a part (a column's
    name, "device: host"), a continued line indented."""
    lines = [""]
    for part in parts:
        piece = (joint if lines[-1].strip() else "") + part
        if lines[-1].strip() and len(lines[-1]) + len(piece) > width:
            lines[-1] += joint.rstrip()
            lines.append("  " + part)
        else:
            lines[-1] += piece
    return "\n".join(lines)


def wrap(text: str, width: int = WIDTH) -> str:
    """Sentences (lines not of a Markdown table) wrapped to `width` columns, a continued line indented;
    a word longer than that (a path) is kept whole. Table lines are left as they are (`fit` them)."""
    out = []
    for line in text.split("\n"):
        if len(line) <= width or line.startswith("|"):
            out.append(line)
        else:
            out.append(textwrap.fill(line, width, subsequent_indent="  ", break_long_words=False,
                                     break_on_hyphens=False))
    return "\n".join(out)
