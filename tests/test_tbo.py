"""The test-backend-ops parser against real output of llama.cpp (the shared fixtures)."""

import pytest

from testbed import tbo
from testbed.experiments.gdn import TBO_CASES


def test_console_test_mode_gives_36_verdicts_and_the_suite_line(seed_fixtures):
    text = (seed_fixtures / "test-backend-ops" / "test_mode_b_CPU.stdout").read_text()
    cases, summaries = tbo.parse_console(text)
    assert summaries == {"CPU": (36, 36)}
    assert len(cases) == 36 and all(c.status == "pass" for c in cases)
    records = tbo.to_records(text, "gdn")
    suite = [r for r in records if r.oracle == "test-backend-ops-suite"]
    assert len(suite) == 1 and suite[0].verdict == "pass" and suite[0].detail == "36/36 OK"


def test_our_shape_matrix_is_llama_cpps(seed_fixtures):
    """TBO_CASES must list exactly the cases the real harness ran, in its order."""
    cases, _ = tbo.parse_console((seed_fixtures / "test-backend-ops" / "test_mode_b_CPU.stdout").read_text())
    theirs = [
        tuple(int(c.params[k]) for k in ("head_count", "head_size", "n_seq_tokens", "n_seqs", "v_repeat",
                                          "permuted", "kda", "K"))
        for c in cases
    ]
    ours = [(c.head_count, c.head_size, c.n_seq_tokens, c.n_seqs, c.v_repeat, int(c.permuted), int(c.kda), c.K)
            for c in TBO_CASES]
    assert ours == theirs


def test_csv_matches_console(seed_fixtures):
    folder = seed_fixtures / "test-backend-ops"
    from_csv = tbo.parse_csv((folder / "test_mode_b_CPU.csv").read_text())
    from_console, _ = tbo.parse_console((folder / "test_mode_b_CPU.stdout").read_text())
    assert [c.name for c in from_csv] == [c.name for c in from_console]
    assert all(c.status == "pass" for c in from_csv)


def test_perf_mode_gives_measurements(seed_fixtures):
    text = (seed_fixtures / "test-backend-ops" / "perf_b_CPU.stdout").read_text()
    records = tbo.to_records(text, "gdn")
    assert len(records) == 12 and all(r.kind == "measure" for r in records)
    first = records[0]
    assert first.figures["time"].median == pytest.approx(165.48)
    assert first.figures["rate"].unit == "GB/s" and first.figures["time"].reps == 6051


def test_a_failing_case_fails_the_suite(seed_fixtures):
    """Plant one real-looking failure line: the case and the suite verdict must both fail, and the
    disagreement with the harness' own summary line is reported."""
    text = (seed_fixtures / "test-backend-ops" / "test_mode_b_CPU.stdout").read_text()
    lines = text.splitlines()
    i = next(n for n, line in enumerate(lines) if "n_seq_tokens=65" in line)
    head = lines[i].split("):")[0]
    lines[i] = head + "): [GATED_DELTA_NET] NMSE = 0.000123 > 0.000000100 \x1b[1;31mFAIL\x1b[0m"
    records = tbo.to_records("\n".join(lines), "gdn")
    failed = [r for r in records if r.verdict == "fail"]
    assert {r.oracle for r in failed} == {"test-backend-ops", "test-backend-ops-suite"}
    case = next(r for r in failed if r.oracle == "test-backend-ops")
    assert case.metrics["nmse"] == pytest.approx(1.23e-4)
    suite = next(r for r in failed if r.oracle == "test-backend-ops-suite")
    assert "35/36 OK" in suite.detail and "36/36" in suite.detail


def test_unsupported_cases_are_not_passes():
    text = ("Backend 1/1: HTP0\n"
            "  GATED_DELTA_NET(type=f32,head_count=4,K=2): not supported [HTP0]\n"
            "  GATED_DELTA_NET(type=f32,head_count=4,K=1): OK\n"
            "  1/1 tests passed\n")
    records = tbo.to_records(text, "gdn")
    suite = records[-1]
    assert suite.detail == "1/1 OK, 1 not supported"
    assert len([r for r in records if r.oracle == "test-backend-ops"]) == 1


def test_skipped_backend_is_an_error_not_a_pass(seed_fixtures):
    text = (seed_fixtures / "test-backend-ops" / "test_mode_default.stdout").read_text()
    with pytest.raises(ValueError, match="no test-backend-ops cases"):
        tbo.to_records(text, "gdn")
