"""llama.cpp's llama-bench: its three documented output formats parsed into one kind of row.

  -o md     a markdown table: model | size | params | backend | [threads | ngl | ...] | test | t/s
            with t/s as "MEAN ± STDDEV" and test as "pp512", "tg128", "pp512 @ d512" (older
            versions: "pp 512")
  -o csv    one header row, one row per test: n_prompt, n_gen, n_depth, avg_ts, stddev_ts, ...
  -o json   an array of objects with the csv fields plus samples_ns and samples_ts per repetition
            (-o jsonl: one such object per line)

Each becomes a BenchRow: the test name (pp512, tg128, pp512@d512), tokens/s mean and stddev, and the
per-repetition samples when the format carries them (json), so a Figure has real min/max.
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass, field

from testbed.errors import DeviceError
from testbed.results import Figure


@dataclass
class BenchRow:
    test: str  # pp512, tg128, pp512@d512
    tokens_per_s: float
    stddev: float
    model: str = ""
    backend: str = ""
    threads: int | None = None
    samples_ts: list[float] = field(default_factory=list)

    def figure(self) -> Figure:
        """Median/min/max over the repetitions when known; else the mean with its +-1 stddev band."""
        if self.samples_ts:
            return Figure.of(self.samples_ts, "tokens/s")
        return Figure(self.tokens_per_s, self.tokens_per_s - self.stddev, self.tokens_per_s + self.stddev, 0,
                      "tokens/s")


def test_name(n_prompt: int, n_gen: int, n_depth: int = 0) -> str:
    name = f"pp{n_prompt}" if n_prompt and not n_gen else f"tg{n_gen}" if n_gen and not n_prompt \
        else f"pp{n_prompt}+tg{n_gen}"
    return f"{name}@d{n_depth}" if n_depth else name


def _normal_test(cell: str) -> str:
    """'pp 512' / 'pp512' / 'pp512 @ d512' -> 'pp512', 'pp512@d512'."""
    return re.sub(r"\s+", "", cell)


def parse_markdown(text: str) -> list[BenchRow]:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("|")]
    if len(lines) < 2:
        return []
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    rows = []
    for line in lines[2:]:
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
        m = re.match(r"([\d.]+)\s*±\s*([\d.]+)", cells.get("t/s", ""))
        if not m or "test" not in cells:
            continue
        threads = cells.get("threads")
        rows.append(BenchRow(_normal_test(cells["test"]), float(m.group(1)), float(m.group(2)),
                             cells.get("model", ""), cells.get("backend", ""),
                             int(threads) if threads and threads.isdigit() else None))
    return rows


def _from_fields(obj: dict) -> BenchRow:
    return BenchRow(test_name(int(obj["n_prompt"]), int(obj["n_gen"]), int(obj.get("n_depth") or 0)),
                    float(obj["avg_ts"]), float(obj["stddev_ts"]), str(obj.get("model_type", "")),
                    str(obj.get("backends", "")), int(obj["n_threads"]) if obj.get("n_threads") not in (None, "") else None,
                    [float(s) for s in obj.get("samples_ts", [])])


def parse_csv(text: str) -> list[BenchRow]:
    return [_from_fields(r) for r in csv.DictReader(io.StringIO(text.strip()))]


def parse_json(text: str) -> list[BenchRow]:
    text = text.strip()
    objs = json.loads(text) if text.startswith("[") else [json.loads(ln) for ln in text.splitlines() if ln.strip()]
    return [_from_fields(o) for o in objs]


def parse(text: str) -> list[BenchRow]:
    """Any of the formats, recognised by its first character; an output with no result row is an
    error (a crashed or cut-short run), never an empty success."""
    body = text.strip()
    try:
        if body.startswith(("[", "{")):
            rows = parse_json(body)
        elif body.startswith("|") or "\n|" in body:
            rows = parse_markdown(body)
        else:
            rows = parse_csv(body)
    except (ValueError, KeyError) as e:
        raise DeviceError(f"llama-bench output is not in a format testbed reads: {type(e).__name__}: {e}") from None
    if not rows:
        raise DeviceError(f"llama-bench printed no result rows (output began: {body[:120]!r})")
    return rows
