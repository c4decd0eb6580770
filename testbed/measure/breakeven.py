"""Breakeven tables for the padded prefill tail (seed 003, the review sweep).

Input: one row per prompt length with the columns
    prompt_tokens, tail, padded_tps, scalar_tps, padded_ttft_ms, scalar_ttft_ms
(the fixture fixtures/tail_sweep_m4pro_gemma4_e2b.csv has exactly these; the `tail`
experiment's records are reshaped into them), and where the records hold each repetition,
padded_tps_samples and scalar_tps_samples (lists, in repetition order: the sweep is interleaved, so
the i-th of every list ran in one repetition). Output: the reviewer's table, and the breakeven tail
the padding policy can use, with its interval (testbed.measure.decisions).
"""

from __future__ import annotations

import pandas as pd

from testbed.measure import decisions

COLUMNS = ("prompt_tokens", "tail", "padded_tps", "scalar_tps", "padded_ttft_ms", "scalar_ttft_ms")
TIE_PERCENT = 1.0  # throughputs closer than this are a tie: run-to-run noise, not a winner


def _require(df: pd.DataFrame) -> None:
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"tail sweep table lacks columns {missing}; needs {', '.join(COLUMNS)}")


def advantage_percent(padded_tps: float, scalar_tps: float) -> float:
    """How much faster the faster mode is, in percent of the slower one's throughput."""
    return (max(padded_tps, scalar_tps) / min(padded_tps, scalar_tps) - 1.0) * 100.0


def winner(padded_tps: float, scalar_tps: float, tie_percent: float = TIE_PERCENT) -> str:
    """'tie', or the faster mode with its advantage as the reviewer wrote it: 'scalar +2.5%',
    'padded +22%' (one decimal below 10 %, whole percents above)."""
    pct = advantage_percent(padded_tps, scalar_tps)
    if pct < tie_percent:
        return "tie"
    mode = "padded" if padded_tps > scalar_tps else "scalar"
    return f"{mode} +{pct:.1f}%" if pct < 10 else f"{mode} +{pct:.0f}%"


def padded_wins(df: pd.DataFrame, tie_percent: float = TIE_PERCENT) -> pd.Series:
    """Per row: padding is faster by more than a tie."""
    pct = (df["padded_tps"] / df["scalar_tps"] - 1.0) * 100.0
    return pct >= tie_percent


def tail_table(df: pd.DataFrame, tie_percent: float = TIE_PERCENT) -> pd.DataFrame:
    """The reviewer's table, one row per prompt length in increasing order: N, tail, padded tok/s,
    scalar tok/s, winner with percentage, padded TTFT (ms), scalar TTFT (ms), and each throughput's
    spread over its repetitions where the sweep has it."""
    _require(df)
    rows = df.sort_values(["prompt_tokens"]).reset_index(drop=True)
    return pd.DataFrame({
        "N": rows["prompt_tokens"].astype(int),
        "tail": rows["tail"].astype(int),
        "padded tok/s": rows["padded_tps"].astype(float).round(1),
        "scalar tok/s": rows["scalar_tps"].astype(float).round(1),
        # tail 0: both modes run the same full chunks, so any difference is noise
        "winner": ["tie" if t == 0 else winner(p, s, tie_percent)
                   for t, p, s in zip(rows["tail"], rows["padded_tps"], rows["scalar_tps"])],
        "padded TTFT (ms)": rows["padded_ttft_ms"].astype(float).round(0).astype(int),
        "scalar TTFT (ms)": rows["scalar_ttft_ms"].astype(float).round(0).astype(int),
        # the repetitions' spread, (max - min) / median, where the records have it (the seed's CSV has not)
        **{f"{mode} spread %": ((rows[f"{mode}_tps_max"] - rows[f"{mode}_tps_min"]) / rows[f"{mode}_tps"] * 100).round(1)
           for mode in ("padded", "scalar") if f"{mode}_tps_min" in rows},
    })


def instruction_table(df: pd.DataFrame, tie_percent: float = TIE_PERCENT) -> pd.DataFrame:
    """The table of a sweep by exact instructions (a device that counts), one row per prompt length: N,
    tail, each mode's instructions per prefill and the mode that executes fewer, by how much (a tie
    under tie_percent). df: breakeven's columns with the throughputs as tokens per instruction (any
    scale) and the TTFT columns holding the instructions."""
    _require(df)
    rows = df.sort_values("prompt_tokens")
    return pd.DataFrame({
        "N": rows["prompt_tokens"].astype(int).to_numpy(),
        "tail": rows["tail"].astype(int).to_numpy(),
        "padded instructions": rows["padded_ttft_ms"].astype("int64").to_numpy(),
        "scalar instructions": rows["scalar_ttft_ms"].astype("int64").to_numpy(),
        # tail 0: both modes run the same full chunks
        "fewer instructions": ["tie" if t == 0 else winner(p, s, tie_percent)
                               for t, p, s in zip(rows["tail"], rows["padded_tps"], rows["scalar_tps"])]})


def breakeven_tail(df: pd.DataFrame, tie_percent: float = TIE_PERCENT) -> int | None:
    """The smallest tail from which padding wins for good: padded beats scalar (by more than a tie)
    at that tail and at every larger tail measured. None if padding does not win at the largest.
    Tail 0 has nothing to pad and is left out."""
    _require(df)
    tails = df[df["tail"] > 0]
    wins = tails.assign(win=padded_wins(tails, tie_percent)).groupby("tail")["win"].all().sort_index()
    breakeven = None
    for tail, win in reversed(list(wins.items())):
        if not win:
            break
        breakeven = int(tail)
    return breakeven


def breakeven_interval(df: pd.DataFrame, tie_percent: float = TIE_PERCENT, by: str = "time") -> dict:
    """breakeven_tail with its confidence: decisions.crossing over the tails (tail 0 left out), from
    each repetition where the rows have them, else from the medians alone (the grid's resolution)."""
    _require(df)
    rows = df[df["tail"] > 0].sort_values("tail")
    if rows["tail"].duplicated().any():
        raise ValueError("breakeven_interval needs one row per tail (one source's sweep)")

    def repetitions(mode: str) -> list:
        column = f"{mode}_tps_samples"
        if column in rows and rows[column].map(lambda v: isinstance(v, list) and len(v) > 0).all():
            return list(rows[column])
        return [[v] for v in rows[f"{mode}_tps"]]

    return decisions.crossing(rows["tail"], repetitions("padded"), repetitions("scalar"), tie_percent / 100, by=by)


def threshold_from_breakeven(breakeven: int | None) -> int | None:
    """The padding policy's threshold (pad only tails > threshold) for a measured breakeven."""
    return None if breakeven is None else breakeven - 1


def read_sweep_csv(path) -> pd.DataFrame:
    """A tail sweep CSV such as the fixture (`#` lines are comments: where it was measured)."""
    df = pd.read_csv(path, comment="#")
    _require(df)
    return df
