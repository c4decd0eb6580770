"""History over stored records: which runs are comparable, which is the latest, what regressed.

Two runs are comparable when they ran the same experiment on the same device with the same
configuration (every config value except where results and fixtures live). A figure regresses when
the latest run is outside the run-to-run spread seen before: every repetition of the latest run is
worse than every repetition of every earlier comparable run (at least `min_history` of them: one
earlier run shows the spread of its repetitions, but not how much a whole night moves against the
next, say when the machine is busier). The spread is thus measured, from the repetitions' min/max
over the history, never a fixed percentage; a machine that is noisier widens its own envelope. An oracle regresses when it passed before and does not pass now.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from itertools import groupby

# Where records and fixtures are kept says nothing about what was measured.
NOT_PART_OF_CONFIG = ("results_dir", "fixtures_dir")


def config_key(record: dict) -> str:
    """A short digest of the record's configuration: equal digests mean comparable runs."""
    config = {k: v for k, v in record.get("config", {}).items() if k not in NOT_PART_OF_CONFIG}
    return hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()[:10]


def series_key(record: dict) -> tuple:
    return (record["experiment"], record["device"], config_key(record), record["case"], record.get("oracle"))


def by_run_time(records: list[dict]) -> list[dict]:
    return sorted(records, key=lambda r: (r["started"], r["run_id"]))


def latest_runs(records: list[dict]) -> set[str]:
    """The run ids that are the newest of their (experiment, device, config)."""
    newest: dict[tuple, dict] = {}
    for r in records:
        key = (r["experiment"], r["device"], config_key(r))
        if key not in newest or (r["started"], r["run_id"]) > (newest[key]["started"], newest[key]["run_id"]):
            newest[key] = r
    return {r["run_id"] for r in newest.values()}


def lower_is_better(unit: str) -> bool:
    """Times are better low, rates (anything per second) high; a fraction or count is not judged."""
    return unit in ("s", "ms", "us", "ns")


def higher_is_better(unit: str) -> bool:
    return unit.endswith("/s")


@dataclass
class Flag:
    """One regression: what, on which device and config, by how much, since when."""

    kind: str  # "figure" or "oracle"
    experiment: str
    device: str
    config_key: str
    case: str
    what: str  # the figure's name, or the oracle's
    now: str
    before: str
    spread: str  # what the earlier runs spanned (every repetition), or the earlier verdict
    change: str
    since: str  # the start time of the first run of the streak that is still failing
    since_commit: str
    record_id: str
    run_id: str

    def line(self) -> str:
        return (f"{self.experiment} on {self.device} {self.case} {self.what} {self.change}: {self.now} vs "
                f"{self.before}, since {self.since[:16]} ({self.since_commit[:8]})")


def _worse(fig: dict, envelope: tuple[float, float], unit: str) -> bool:
    """Every repetition of `fig` is worse than every repetition inside the envelope."""
    lo, hi = envelope
    if lower_is_better(unit):
        return fig["min"] > hi
    if higher_is_better(unit):
        return fig["max"] < lo
    return False


def _envelope(figs: list[dict]) -> tuple[float, float]:
    return min(f["min"] for f in figs), max(f["max"] for f in figs)


def _streak_start(points: list[tuple[dict, dict]], unit: str, min_history: int) -> int | None:
    """The earliest index s >= min_history such that every run from s to the last lies outside the envelope of
    the runs before s (so a slowdown that persists over several nights is dated to its first night);
    None when no such s exists: the latest run is within the spread of its history."""
    for s in range(max(1, min_history), len(points)):
        envelope = _envelope([fig for _, fig in points[:s]])
        if all(_worse(fig, envelope, unit) for _, fig in points[s:]):
            return s
    return None


def _median(values: list[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def figure_regressions(records: list[dict], history: int, min_history: int) -> list[Flag]:
    """Figures of each series' latest run that are worse than all of the (at least `min_history`,
    at most `history`) runs before."""
    flags = []
    # emulated figures are not a device's speed (testbed.emulation): no regression is judged on them
    measures = by_run_time([r for r in records if r["kind"] == "measure" and not r.get("emulated")])
    measures.sort(key=series_key)  # stable: each series stays in run-time order
    for key, group in groupby(measures, key=series_key):
        rows = list(group)[-(history + 1):]
        if len(rows) < 2:
            continue
        for name, fig in rows[-1].get("figures", {}).items():
            points = [(r, r["figures"][name]) for r in rows if name in r.get("figures", {})]
            if len(points) < 2 or points[-1][0] is not rows[-1]:
                continue
            s = _streak_start(points, fig["unit"], min_history)
            if s is None:
                continue
            baseline = _median([f["median"] for _, f in points[:s]])
            change = (fig["median"] - baseline) / baseline if baseline else float("inf")
            first = points[s][0]
            lo, hi = _envelope([f for _, f in points[:s]])
            flags.append(Flag(
                "figure", key[0], key[1], key[2], key[3], name,
                now=f"{fig['median']:.4g} {fig['unit']} [{fig['min']:.4g}, {fig['max']:.4g}]",
                before=f"{baseline:.4g} {fig['unit']}",
                spread=f"{lo:.4g} to {hi:.4g} over {s} runs",
                change=f"{change:+.1%}", since=first["started"], since_commit=first["git_commit"],
                record_id=rows[-1]["record_id"], run_id=rows[-1]["run_id"],
            ))
    return flags


def oracle_flips(records: list[dict]) -> list[Flag]:
    """Oracles whose latest verdict is not a pass although an earlier comparable run passed."""
    flags = []
    oracles = by_run_time([r for r in records if r["kind"] == "oracle"])
    oracles.sort(key=series_key)
    for key, group in groupby(oracles, key=series_key):
        rows = list(group)
        last_pass = max((i for i, r in enumerate(rows) if r["verdict"] == "pass"), default=None)
        if rows[-1]["verdict"] == "pass" or last_pass is None:
            continue
        first_fail, passed = rows[last_pass + 1], rows[last_pass]
        flags.append(Flag(
            "oracle", key[0], key[1], key[2], key[3], key[4] or "",
            now=f"{rows[-1]['verdict']} (margin {rows[-1].get('margin')})",
            before=f"pass (margin {passed.get('margin')})", spread=f"last passed {passed['started']}",
            change="pass -> " + rows[-1]["verdict"], since=first_fail["started"],
            since_commit=first_fail["git_commit"], record_id=rows[-1]["record_id"], run_id=rows[-1]["run_id"],
        ))
    return flags
