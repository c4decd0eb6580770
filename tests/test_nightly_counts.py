"""The default suite counts the kernels beyond GDN: a planted rise of about 5% in the sliding cache's
rollback (not GDN) is flagged by the night's history, on the night it appears.

Two real nights (testbed.lab.nightly.run_night) of the default suite's native_counts run on
qemu-aarch64 (the counting plugin): the first builds the project's kernels, the second a copy with a
wasted loop in tb_cache_rollback (more instructions, the same bytes), sized from the first night's
count. Only where the programs come from is redirected; the build, the emulator and the counter are
real."""

import functools

from omegaconf import OmegaConf

from testbed import config
from testbed.backends.native import build as kernel_build
from testbed.experiments import native_bench
from testbed.lab import nightly
from testbed.lab.nightly import Log
from testbed.results import ResultsStore
from tests.native_support import mutant_kernels

ROLLBACK_AT = "int tb_cache_rollback(tb_sliding_cache *c, int n_pad, const uint8_t *saved, int n_saved) {\n"
# About this many instructions per turn of the wasted loop on aarch64 at -O2 (load, add, store, the
# counter's add, compare and branch): the planted rise lands near 5%, checked below as between the 1%
# that counts and 10%.
INSTRUCTIONS_PER_TURN = 5
SUITE = """
devices: [qemu-aarch64]
runs:
  native_counts:
    experiment: native_bench
    overrides: {overrides}
lock_dir: {locks}
lock_wait_s: 60
report_out: {report}
"""


def night(tmp_path, store):
    default = OmegaConf.load(config.group_file("suite", "default"))
    overrides = OmegaConf.to_container(default.runs.native_counts.overrides)
    suite_dir = tmp_path / "suite"
    suite_dir.mkdir(exist_ok=True)
    (suite_dir / "counts.yaml").write_text(SUITE.format(overrides=[str(o) for o in overrides],
                                                        locks=tmp_path / "locks", report=tmp_path / "report"))
    suite = nightly.load_suite(["suite=counts"], suite_dir=suite_dir)
    status, text = nightly.run_night(suite, store, log=Log(open(tmp_path / "night.log", "a")))
    return status, text, nightly.report.night_log(store.root)[-1]


def rollback_count(store) -> int:
    (count,) = [r["figures"]["instructions"]["median"] for r in store.records()
                if r["kind"] == "measure" and r["case"].endswith("/rollback")]
    return int(count)


def test_a_planted_rise_in_the_sliding_cache_is_flagged(tmp_path, results_dir, monkeypatch):
    store = ResultsStore(results_dir)
    status, text, _ = night(tmp_path, store)
    assert status == 0, text

    turns = max(1, round(0.05 * rollback_count(store) / INSTRUCTIONS_PER_TURN))
    waste = (f"    {{ volatile unsigned planted_waste = 0; for (int i = 0; i < {turns}; i++) "
             "planted_waste = planted_waste + (unsigned)i; }\n")
    planted = mutant_kernels("sliding_cache.c", ROLLBACK_AT, ROLLBACK_AT + waste)
    monkeypatch.setattr(native_bench, "build_programs",
                        functools.partial(kernel_build.build_programs, kernels_dir=planted))
    status, text, slow = night(tmp_path, store)
    assert status == 1 and "REGRESSION" in text, text
    (flag,) = [f for f in slow["flags"] if f["kind"] == "instructions"]
    assert flag["experiment"] == "native_bench" and flag["case"].endswith("/rollback"), slow["flags"]
    assert 0.01 < flag["after_level"] / flag["before_level"] - 1 < 0.10, flag
    assert flag["commit_range"] == f"{flag['last_clean_commit'][:8]}..{flag['since_commit'][:8]}"


def test_the_tail_engines_prefill_is_counted(tmp_path, results_dir):
    """The default suite's tail_counts run on qemu-aarch64: every bench record holds the prefill's exact
    instructions; with no tail, padded and scalar run the same instructions, with a tail of 8 they
    differ (the padded chunk call against 8 scalar steps). The report shows the counts (the tail's
    times, emulated, apart)."""
    from testbed import runner

    default = OmegaConf.load(config.group_file("suite", "default"))
    overrides = [str(o) for o in default.runs.tail_counts.overrides]
    rc = config.load(["device=qemu-aarch64", *overrides], experiment="tail")
    rows = [r for r in runner.execute(rc).rows if r["kind"] == "measure"]
    counts = {(r["params"]["tail"], r["params"]["mode"]): r["figures"]["instructions"]["median"] for r in rows}
    assert sorted(counts) == [(0, "padded"), (0, "scalar"), (8, "padded"), (8, "scalar")], counts
    assert counts[0, "padded"] == counts[0, "scalar"] > 0
    assert counts[8, "padded"] != counts[8, "scalar"]
    _, content = nightly.report.write(ResultsStore(results_dir), tmp_path / "report")
    (section,) = [s for s in content["sections"] if s["id"] == "instructions"]
    shown = {row["instructions"] for table in section["tables"] for row in table["rows"]
             if row["experiment"] == "tail"}
    assert shown == set(counts.values()), section
