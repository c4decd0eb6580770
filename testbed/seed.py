"""The seeds' measured figures (fixtures/*.csv), as tables to set beside our own and as records.

The fixtures folder is the config key `fixtures_dir`, relative to the project root. A helper
worktree sits one level deeper than the checkout the key was written for, so the shared folder is
also looked for where every checkout on this machine finds it.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from testbed.config import project_path
from testbed.results import Figure, Record, RunInfo

TAIL_SWEEP = "tail_sweep_m4pro_gemma4_e2b.csv"
CHUNK_PREFILL = "chunk_prefill_functiongemma.csv"
SHARED_FIXTURES = Path("/work/shared/fixtures")


def fixtures_dir(configured: str) -> Path:
    for candidate in (project_path(configured), SHARED_FIXTURES):
        if candidate.is_dir():
            return candidate
    return project_path(configured)


def source_line(path: Path) -> str:
    """The `#` line each fixture starts with: where its numbers come from."""
    first = path.read_text(encoding="utf-8").splitlines()[0]
    return first.lstrip("#").strip()


def read(path: Path) -> pd.DataFrame:
    return pd.read_csv(path, comment="#")


def tail_sweep_records(path: Path) -> tuple[RunInfo, list[Record]]:
    """The seed's tail sweep as records of experiment `tail`: one measure record per tail, the
    columns padded_tps, scalar_tps, padded_ttft_ms, scalar_ttft_ms as figures. The seed reports
    medians of 8 alternating reps without their spread, so min = max = median."""
    df = read(path)
    info = RunInfo("tail", "seed-m4pro", "seed", {"source": source_line(path), "window": 512, "chunk": 128},
                   {"model": "Apple M4 Pro", "source": path.name})
    units = {"padded_tps": "tokens/s", "scalar_tps": "tokens/s", "padded_ttft_ms": "ms", "scalar_ttft_ms": "ms"}
    records = [
        Record("tail", f"prompt={int(r.prompt_tokens)},tail={int(r.tail)}", "measure",
               figures={k: Figure(float(getattr(r, k)), float(getattr(r, k)), float(getattr(r, k)), 8, u)
                        for k, u in units.items()},
               params={"prompt_tokens": int(r.prompt_tokens), "tail": int(r.tail), "window": 512, "chunk": 128})
        for r in df.itertuples(index=False)
    ]
    return info, records


def chunk_prefill_records(path: Path) -> list[tuple[RunInfo, list[Record]]]:
    """The seed's chunk calls as records of experiment `chunk_prefill`, one run per target: the
    token-at-position oracle (the chunk call's token equals the redecode token, 48) and, where the
    seed timed it, the chunk call as a figure in seconds (one measurement: reps = 1)."""
    df = read(path)
    runs = []
    for target, rows in df.groupby("target", sort=False):
        info = RunInfo("chunk_prefill", target, "seed", {"source": source_line(path)},
                       {"target": target, "source": path.name})
        records = []
        for r in rows.itertuples(index=False):
            params = {"chunk": int(r.chunk), "cached_positions": int(r.cached_positions),
                      "chunk_tokens": int(r.chunk_tokens), "select_row": int(r.select_row)}
            case = f"C={r.chunk},P={r.cached_positions},n={r.chunk_tokens}"
            verdict = "pass" if int(r.token) == 48 else "fail"
            records.append(Record("chunk_prefill", case, "oracle", "token_at_position", verdict, None,
                                  {"token": int(r.token), "expected": 48}, params=params))
            if pd.notna(r.chunk_call_s):
                s = float(r.chunk_call_s)
                records.append(Record("chunk_prefill", case, "measure",
                                      figures={"chunk_call": Figure(s, s, s, 1, "s")}, params=params))
        runs.append((info, records))
    return runs


def store_records(store, fixtures: Path) -> int:
    """Append every fixture as records to `store` (for reports that set the seeds beside our runs)."""
    runs = [tail_sweep_records(fixtures / TAIL_SWEEP), *chunk_prefill_records(fixtures / CHUNK_PREFILL)]
    rows = [info.stamp(rec) for info, records in runs for rec in records]
    store.append(rows)
    return len(rows)
