"""Benchmark (opt-in; records, not a timed test): what one `testbed ab` job on the host sees.

    python -m tests.bench_ab_power [--same 20] [--planted 3]      (from the checkout, TESTBED_RESULTS honoured)

Planted in B, each calibrated first on this machine:
  cycles  +10% CPU time of the chunkwise call, the cache-miss kind: reads scattered over a 32 MiB buffer
          (tests.native_support.cache_missing_chunkwise), about +0.3% instructions, under the 1% that
          counts as slower, so only the time can catch it. Calibrated by a fixed 24-pair job at 2000
          reads per chunk step and a 48-pair job at the reads that gives (the slowdown is about
          linear in the reads; what a miss costs moves with what else runs: each job's B/A is shown).
  instr.  +5% instructions of the chunkwise call (tests.native_support.slowed_chunkwise), calibrated by
          valgrind's exact counts: at 1000 turns, then once more at the turns that gives.
and the same tree against itself `--same` times (seeds 0..N-1). Every job is the default adaptive design
(no --reps) at a bench of 4 heads of 64, 128 tokens. Each job stores its run in the store as `testbed ab`
does; the summary (per job: what was planted, load before and after, verdicts, pairs, looks, CPU-s,
why it stopped) is printed and written to RESULTS/ab-power.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from testbed import config
from tests.native_support import cache_missing_chunkwise, slowed_chunkwise

SHAPE = ["backend=native", "device=host", "bench.tokens=[128]", "bench.heads=4", "bench.head_size=64"]
CHUNKWISE = "H=4,hs=64,T=128,kda=0/chunkwise"
PROBE_READS = 2000


def ab(b: str, *options: str, a: str = "HEAD") -> dict:
    """One `testbed ab` job: its rows by call, exit status, the load before and after, CPU-seconds."""
    load = os.getloadavg()[0]
    started = time.time()
    p = subprocess.run([sys.executable, "-m", "testbed", "ab", a, b, *SHAPE, *options, "--format", "json"],
                       capture_output=True, text=True)
    if p.returncode not in (0, 1):
        raise SystemExit(f"testbed ab {a} {b} failed (exit {p.returncode}): {p.stderr[-800:]}")
    rows = {r["call"]: r for r in json.loads(p.stdout)["rows"]}
    return {"rows": rows, "exit": p.returncode, "load_before": load, "load_after": os.getloadavg()[0],
            "wall_s": round(time.time() - started, 1)}


def calibrate() -> tuple[int, int, dict]:
    """Reads per chunk step for +10% CPU time, and loop turns for +5% instructions, on this machine."""
    print("calibrating the cycles-only plant (24 pairs at 2000 reads per chunk step, 48 at the estimate)", flush=True)
    reads, ratios = PROBE_READS, []
    for pairs in ("24", "48"):  # the slowdown is about linear in the reads: estimate, then correct once
        ratios.append(ab(str(cache_missing_chunkwise(reads)), "--reps", pairs)["rows"][CHUNKWISE]["cpu_B_per_A"])
        reads = max(1, round(reads * 0.10 / max(ratios[-1] - 1, 0.01)))
    print("calibrating the instruction plant (valgrind: the loop at 1000 turns, then at the estimate)", flush=True)
    turns, change = 1000, None
    for _ in range(2):  # the compiled loop's cost per turn moves a little with the turns: estimate, then correct
        counted = ab(str(slowed_chunkwise(turns)), "--reps", "1")["rows"][CHUNKWISE]
        change = counted["instructions_B"] / counted["instructions_A"] - 1
        turns = int(np.ceil(turns * 0.05 / change))
    return reads, turns, {"probe_reads": PROBE_READS, "probe_cpu_ratios": ratios, "reads_for_10pc": reads,
                          "instructions_head": counted["instructions_A"], "turns_for_5pc": turns,
                          "change_at_the_estimate": change}


def summary_row(what: str, job: dict) -> dict:
    c = job["rows"][CHUNKWISE]
    return {"planted": what, "exit": job["exit"], "load_before": round(job["load_before"], 1),
            "load_after": round(job["load_after"], 1), "wall_s": job["wall_s"], "verdict": c["verdict"],
            "cpu B/A": c["cpu_B_per_A"], "instr. change": c["instr_change"], "pairs": c["pairs"],
            "slower calls": sum(r["verdict"].startswith("slower") for r in job["rows"].values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--same", type=int, default=20, help="jobs of the same tree against itself (default 20)")
    parser.add_argument("--planted", type=int, default=3, help="jobs per planted change (default 3)")
    args = parser.parse_args()
    reads, turns, calibration = calibrate()
    print(f"calibrated: {reads} reads per chunk step (+10% CPU), {turns} turns (+5% instructions)", flush=True)
    plants = [("cycles +10%", str(cache_missing_chunkwise(reads))), ("instructions +5%", str(slowed_chunkwise(turns)))]
    out = []
    for what, tree in plants:
        for seed in range(args.planted):
            out.append(summary_row(what, ab(tree, "--seed", str(seed))))
            print(json.dumps(out[-1]), flush=True)
    for seed in range(args.same):
        out.append(summary_row("none (same tree)", ab("HEAD", "--seed", str(seed))))
        print(json.dumps(out[-1]), flush=True)
    caught = {what: sum(r["exit"] == 1 for r in out if r["planted"] == what) for what, _ in plants}
    false = sum(r["slower calls"] > 0 for r in out if r["planted"].startswith("none"))
    loads = [x for r in out for x in (r["load_before"], r["load_after"])]
    summary = {"calibration": calibration, "jobs": out, "caught": caught, "planted_jobs": args.planted,
               "same_tree_jobs": args.same, "same_tree_slower": false, "load": [min(loads), max(loads)]}
    path = config.project_path(os.environ.get("TESTBED_RESULTS") or "results") / "ab-power.json"
    path.write_text(json.dumps(summary, indent=1))
    print(f"caught: {caught} of {args.planted} jobs each; same tree: {false} of {args.same} jobs slower; "
          f"load {min(loads):.1f}-{max(loads):.1f}; written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
