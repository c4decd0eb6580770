"""The seeds' measured figures (fixtures/*.csv), as tables to set beside our own and as records.

The fixtures folder is the config key `fixtures_dir`, relative to the project root: the repository's
own fixtures/, so a clone anywhere has them. An installed wheel carries a copy in its package
(testbed/_shipped/fixtures), used where the configured folder does not exist.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from testbed.config import project_path
from testbed.results import Figure, Record, RunInfo

TAIL_SWEEP = "tail_sweep_m4pro_gemma4_e2b.csv"
CHUNK_PREFILL = "chunk_prefill_functiongemma.csv"
SEED_MODEL = "FunctionGemma (seed 000)"  # the model of the seed's chunk-call figures
EXPECTED_TOKEN = 48  # the all-positions redecode token at position 851 for the seed's model and prompt


def fixtures_dir(configured: str) -> Path:
    """The configured fixtures folder; for an installed wheel whose working folder has none, the copy
    it carries (a configured folder that exists always wins)."""
    from testbed import CONFIG_ROOT

    for candidate in (project_path(configured), CONFIG_ROOT / Path(configured).name):
        if candidate.is_dir():
            return candidate
    return project_path(configured)


def source_line(path: Path) -> str:
    """The `#` line each fixture starts with: where its numbers come from."""
    first = path.read_text(encoding="utf-8").splitlines()[0]
    return first.lstrip("#").strip()


def read(path: Path) -> pd.DataFrame:
    return pd.read_csv(path, comment="#")


def chunk_prefill_records(path: Path) -> list[tuple[RunInfo, list[Record]]]:
    """The seed's chunk calls as records of experiment `chunk_prefill` in that experiment's layout,
    one run per target: the token-at-position verdict (the chunk call's token equals the redecode
    token, 48) and, where the seed timed it, the chunk call (one measurement: min = max = median)."""
    df = read(path)
    runs = []
    for target, rows in df.groupby("target", sort=False):
        info = RunInfo("chunk_prefill", target, "seed", {"source": source_line(path), "model.name": SEED_MODEL},
                       {"target": target, "source": path.name})
        records = []
        for r in rows.itertuples(index=False):
            params = {"past": int(r.cached_positions), "tokens": int(r.chunk_tokens), "chunk": int(r.chunk),
                      "position": int(r.cached_positions) + int(r.select_row)}
            name = f"P={r.cached_positions},n={r.chunk_tokens},C={r.chunk}"
            verdict = "pass" if int(r.token) == EXPECTED_TOKEN else "fail"
            records.append(Record("chunk_prefill", f"{name}/token_at_position", "oracle", "token_at_position",
                                  verdict, None, {"token": int(r.token), "expected": EXPECTED_TOKEN}, params=params))
            if pd.notna(r.chunk_call_s):
                s = float(r.chunk_call_s)
                records.append(Record("chunk_prefill", f"P={r.cached_positions},C={r.chunk}/chunk_call", "measure",
                                      figures={"time": Figure(s, s, s, 1, "s")},
                                      params={"past": int(r.cached_positions), "chunk": int(r.chunk),
                                              "form": "chunk_call"}))
        runs.append((info, records))
    return runs


def store_records(store, fixtures: Path) -> int:
    """Append the seed's chunk-call figures as records to `store`, for reports that set the seed's
    targets beside our runs (the seed's tail sweep is the tail experiment's `mode=fixture`)."""
    stored = 0
    for info, records in chunk_prefill_records(fixtures / CHUNK_PREFILL):  # each a whole run, between its marks
        store.append([info.mark("started"), *(info.stamp(rec) for rec in records), info.mark("ended", "complete")])
        stored += len(records)
    return stored
