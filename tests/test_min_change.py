"""`testbed ab --min-change`: a change of time is called only beyond the floor the user gives, on both sides.

The judge (testbed.measure.sequential.judge) calls B "slower" when the pairs' median ratio and its whole
interval lie above 1 + min_change, "faster" when below 1 / (1 + min_change); a change inside the floor is
"below floor" however certain it is. Shown on pairs whose ratio is known exactly (every pair 3% apart, so the
signed-rank test is sure of it), through the judge and through the user's command: two engines under test
whose only difference is what their own clock reports for the timed call (a lab's engines: testbed-c
computing for real, its timings.json then giving the chunk call a fixed time, so every pair's ratio is the
same; a real machine's noise could not pin a ratio inside the floor run after run). Planted (issue 44): the
floor ignored on the slower side, and on the faster side; each turns a 3% change under a 5% floor into a
verdict.
"""

from __future__ import annotations

import json

import pytest

from testbed import cli
from testbed.measure import sequential
from tests.mutants import mutant

PAIRS = 6  # the fewest whose signed-rank test reaches p < 0.05; one call, so Holm changes nothing

IGNORED = {"on the slower side": ("if significant and low > 1 + min_change:", "if significant and low > 1:"),
           "on the faster side": ("elif significant and high < 1 / (1 + min_change):",
                                  "elif significant and high < 1:")}


def verdict(judge, ratio: float, min_change: float) -> str:
    [j] = judge(sequential.fixed(PAIRS), [[ratio] * PAIRS], min_change)
    return j.verdict


def floor_problems(judge) -> list[str]:
    """What is wrong with `judge`'s floor: a 3% change called under a 5% floor, or not called under a 2% one."""
    problems = []
    for ratio, beyond in ((1.03, "slower"), (1 / 1.03, "faster")):
        if (got := verdict(judge, ratio, 0.05)) != sequential.BELOW_FLOOR:
            problems.append(f"B/A {ratio:.4f} under --min-change 0.05 is {got!r}, not {sequential.BELOW_FLOOR!r}")
        if (got := verdict(judge, ratio, 0.02)) != beyond:
            problems.append(f"B/A {ratio:.4f} under --min-change 0.02 is {got!r}, not {beyond!r}")
    return problems


@pytest.mark.quick
def test_the_floor_holds_on_both_sides():
    assert floor_problems(sequential.judge) == []


@pytest.mark.quick
@pytest.mark.parametrize("planted", list(IGNORED))
def test_a_floor_ignored_on_one_side_is_caught(planted):
    assert floor_problems(mutant(sequential, "judge", *IGNORED[planted])) != []


# --- through the command ---------------------------------------------------------------------------------

PACE = """\
t = json.loads((out / 'timings.json').read_text())
for c in t['calls']:
    if c['name'] == 'chunk':
        c['wall_s'] = c['cpu_s'] = {seconds}
(out / 'timings.json').write_text(json.dumps(t))
"""


@pytest.fixture
def paced(tmp_path, monkeypatch):
    """Three lab engines: testbed-c whose chunk call reports 10 ms, 10.3 ms and 10 / 1.03 ms."""
    from tests.test_engine_contract import wrapper_engine

    lab = tmp_path / "lab"
    lab.mkdir()
    for name, seconds in (("base", 0.010), ("slower", 0.0103), ("faster", 0.010 / 1.03)):
        wrapper_engine(lab, f"paced-{name}", PACE.format(seconds=seconds))
    monkeypatch.setenv("TESTBED_LAB", str(lab))
    return lab


def ab_verdict(b: str, min_change: float, results_dir, capsys) -> tuple[int, str]:
    """`testbed ab engine:paced-base engine:paced-B --reps 6 --min-change X` (in this process, so a planted judge
    is the one it runs): its exit status and the CPU-time verdict its record keeps."""
    status = cli.main(["ab", "engine:paced-base", f"engine:paced-{b}", "experiment=chunk_prefill", "bench.past=8",
                       "chunk=8", "--reps", str(PAIRS), "--min-change", str(min_change)])
    capsys.readouterr()
    records = [json.loads(line) for line in (results_dir / "records.jsonl").read_text().splitlines()]
    (results_dir / "records.jsonl").unlink()
    [ab] = [r["metrics"]["ab"] for r in records if r.get("kind") == "measure"]
    assert ab["pairs"] == PAIRS and ab["min_change"] == min_change
    return status, ab["verdicts"]["cpu"]


# (B, floor): what `testbed ab` must say of B 3% slower or faster: its exit status and CPU-time verdict
COMMAND = {("slower", 0.05): (0, sequential.BELOW_FLOOR), ("slower", 0.02): (1, "slower"),
           ("faster", 0.05): (0, sequential.BELOW_FLOOR), ("faster", 0.02): (0, "faster")}


def command_problems(results_dir, capsys, cases=tuple(COMMAND)) -> list[str]:
    """What `testbed ab` says wrongly of a 3% change under floors of 5% and 2%."""
    return [f"B {b} by 3% under --min-change {floor}: exit {got[0]}, {got[1]!r}; want {COMMAND[b, floor]}"
            for b, floor in cases if (got := ab_verdict(b, floor, results_dir, capsys)) != COMMAND[b, floor]]


@pytest.mark.quick
def test_the_command_honours_the_floor_on_both_sides(paced, results_dir, capsys):
    assert command_problems(results_dir, capsys) == []


def test_the_command_with_the_floor_ignored_on_the_slower_side_is_caught(paced, results_dir, capsys, monkeypatch):
    monkeypatch.setattr(sequential, "judge", mutant(sequential, "judge", *IGNORED["on the slower side"]))
    assert command_problems(results_dir, capsys, [("slower", 0.05)]) != []
