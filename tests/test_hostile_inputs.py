"""Hostile inputs end in testbed's own one-line error, in bounded memory and time, never a traceback (issue 44).

tests/hostile_inputs.py makes seeded mutants of five valid inputs (a GGUF of each family, a Hugging Face
folder of each, testbed-c's response replayed by a real engine program, engine yamls, a user's IREE folder)
and hands each to testbed's entry point in a child process: over a thousand cases, each ending accepted
(the mutation was harmless) or in UsageError (exit 2) or, for an engine's response, ContractError (exit 4),
with one line naming the file. The child's address space is bounded while each case runs (an allocation
past it is a MemoryError, which counts as a traceback), and its peak RSS and each case's CPU time are
asserted here.

The issue's own inputs are asserted by name beside the seeded ones (each must be in the run and refused):
a logits.npy header claiming (10^6, 10^6), timings.json marks=5, a 5000-digit number and 100000 brackets,
`{nosuch}` and a lone brace in invoke and build.command, a `;` in the program word, contract true and 1.0,
timeout_s .inf, a prebuilt file of random bytes, a source tree holding a link, a GGUF whose block_count is
10^9 and one whose per-layer array has 10^6 entries, a key given twice, `files` as a list or a string, a
module that is random, empty or an ELF.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SEED = 44
# What a case may take: its peak RSS (its own: the bases the child built before it not counted), the
# address space while a case runs, and CPU seconds per case (the slowest takes a few hundredths here).
PEAK_RSS_MB = 1024
LIMIT_AS_MB = 4096
CPU_PER_CASE_S = 10.0
# The fewest cases each surface must run (the seed makes a few more), and the exit status of its refusals.
SURFACES = {"gguf": (450, {2}), "hf": (350, {2}), "response": (150, {4}), "yaml": (180, {2}), "manifest": (75, {2})}
NAMED = {
    "gguf": ["gemma3: gemma3.block_count=10^9", "qwen35: qwen35.block_count=10^9",
             "gemma3: gemma3.attention.sliding_window_pattern: an array of 10^6 entries",
             "qwen35: qwen35.attention.recurrent_layers: an array of 10^6 entries", "given twice",
             "tensor count 4611686018427387904", "truncated to 0 bytes"],
    "hf": ["gemma3: config.json an array", "qwen35: config.json nested 100000 deep", "config.json of 32 MB",
           "safetensors header length 2^62", "safetensors header nested 100000 deep", "safetensors truncated"],
    "response": ["logits.npy shape (10^6, 10^6)", "timings.json marks=5", "timings.json a 5000-digit number",
                 "timings.json nested 100000 deep", "timings.json of 2^40 bytes (sparse)",
                 "cache/k_0.npy with 10^9 rows", "status.json contract true", "status.json contract 1.0"],
    "yaml": ["prebuilt.host is random", "prebuilt.host is empty", "source holds a link out of it",
             "nested 100000 deep", "an alias of an alias, nine deep", "prebuilt.host with a NUL",
             "source of 5000 characters"],
    "manifest": ["files=['module.vmfb']", "files=module.vmfb", "module random bytes", "module empty", "module an ELF",
                 "contract version true", "manifest nested 100000 deep"],
}


def surfaces() -> list[str]:
    return [s for s in SURFACES if s != "manifest" or shutil.which("iree-compile") is not None]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """The child's lines by surface, and its last line (peak RSS)."""
    work = tmp_path_factory.mktemp("hostile")
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OPENBLAS_NUM_THREADS": "1",  # a small address space
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, "-m", "tests.hostile_inputs", str(work), "--seed", str(SEED),
                        "--surfaces", ",".join(surfaces()), "--limit-as", str(LIMIT_AS_MB)],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    lines = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert p.returncode == 0 and lines and "peak_rss_mb" in lines[-1], \
        f"the child died (after {lines[-1]['case'] if lines else 'no case'!r}): {p.stderr[-3000:]}"
    by = {s: [r for r in lines[:-1] if r["surface"] == s] for s in surfaces()}
    return {"cases": by, "end": lines[-1]}


@pytest.mark.parametrize("surface", surfaces())
def test_every_mutant_is_accepted_or_one_line_naming_the_input(report, surface):
    cases = report["cases"][surface]
    at_least, statuses = SURFACES[surface]
    assert len(cases) >= at_least, f"{len(cases)} {surface} cases ran; the seed makes at least {at_least}"
    tracebacks = [f"{r['case']}: {r['message'][:300]}\n{r.get('traceback', '')}" for r in cases
                  if r["outcome"] == "traceback"]
    assert not tracebacks, f"{len(tracebacks)} of {len(cases)} ended in a traceback; the first:\n{tracebacks[0]}"
    refused = [r for r in cases if r["outcome"] == "refused"]
    wrong_status = [(r["case"], r["exit"], r["message"][:200]) for r in refused if r["exit"] not in statuses]
    assert not wrong_status, f"refused with another exit status than {statuses}: {wrong_status[:3]}"
    unnamed = [(r["case"], r["message"][:300]) for r in refused
               if "\n" in r["message"] or not any(name in r["message"] for name in r["names"])]
    assert not unnamed, f"{len(unnamed)} refusals are not one line naming the input: {unnamed[:3]}"
    # most mutants break the input; the few that pass (a bit flipped in a weight, an inert key changed) are the
    # seed's, and a test that accepted everything would say nothing
    assert len(refused) >= 0.75 * len(cases), f"only {len(refused)} of {len(cases)} {surface} mutants were refused"


@pytest.mark.parametrize("surface", surfaces())
def test_the_issues_own_inputs_are_among_the_cases_and_refused(report, surface):
    cases = report["cases"][surface]
    for wanted in NAMED[surface]:
        matching = [r for r in cases if wanted in r["case"]]
        assert matching, f"no {surface} case named {wanted!r}"
        assert all(r["outcome"] == "refused" for r in matching), [(r["case"], r["outcome"]) for r in matching]


def test_memory_and_time_are_bounded(report):
    """No case's peak resident set passes PEAK_RSS_MB (each case's own: VmHWM started again before it, so the
    bases the child built first, jax among them, are not counted against the cases), nor its CPU time
    CPU_PER_CASE_S."""
    cases = [r for cases in report["cases"].values() for r in cases]
    measured = [r for r in cases if r.get("peak_rss_mb") is not None]
    largest = max(measured, key=lambda r: r["peak_rss_mb"]) if measured else None
    if largest is None:  # a kernel without clear_refs: the child's whole peak, bases included
        largest = {"case": "the whole child", "peak_rss_mb": report["end"]["peak_rss_mb"]}
    assert largest["peak_rss_mb"] <= PEAK_RSS_MB, \
        f"{largest['case']}: peak RSS {largest['peak_rss_mb']:.0f} MB; bound {PEAK_RSS_MB} MB"
    slowest = max(cases, key=lambda r: r["cpu_s"])
    assert slowest["cpu_s"] <= CPU_PER_CASE_S, f"{slowest['case']} took {slowest['cpu_s']:.1f} CPU-s"
