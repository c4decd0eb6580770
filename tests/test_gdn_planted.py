"""Every GDN oracle must be able to fail: each test plants a realistic bug and sees it caught."""

import json

import numpy as np
import pytest

from refimpl import gdn as ref
from refimpl.naive_gdn import naive_gdn
from testbed.backends.refimpl.gdn import serial_in_chunks
from testbed.cli import main
from testbed.experiments.gdn import NAIVE_FORM
from testbed.oracles.numerical import check_bitexact, check_nmse
from testbed.results import ResultsStore

# Gates that keep the state alive, a length that crosses chunk boundaries, grouped heads.
CASE = dict(n_seqs=2, tokens=80, h_k=2, d=16, v_repeat=2, gate="mild", seed=5)


def serial_reference(x):
    x64 = ref.GDNInputs(*(a.astype(np.float64) for a in x.arrays()))
    out, state = ref.gdn_serial(*x64.arrays())
    return {"out": out, "state": state}


@pytest.mark.quick
@pytest.mark.parametrize("bug", ["gate_wrong_axis", "decay_after_update", "output_before_update", "dropped_beta"])
def test_nmse_oracle_catches_recurrence_bugs(bug):
    x = ref.draw_inputs(**CASE, kda=True)
    sane = dict(zip(("out", "state"), naive_gdn(*x.arrays())))
    buggy = dict(zip(("out", "state"), naive_gdn(*x.arrays(), bug=bug)))
    assert check_nmse(serial_reference(x), sane).passed  # the harness itself is right
    verdict = check_nmse(serial_reference(x), buggy)
    assert not verdict.passed and verdict.margin < 0, bug


def chunkwise_with_boundary_bug(x, chunk, bug):
    """The chunk loop of refimpl.gdn.gdn_chunkwise, with a planted boundary mistake."""
    d = x.q.shape[-1]
    scale = np.float32(1 / np.sqrt(d))
    heads_first = lambda a: np.moveaxis(a, 1, 2)  # noqa: E731
    h_v = x.v.shape[2]
    keys = (ref._gather_key_heads(a, h_v, "tiled") for a in (x.q, x.k))
    q, k, v, g, b = map(heads_first, (*keys, x.v, x.g, x.beta))
    s = np.swapaxes(x.state, -1, -2).copy()
    out = np.zeros_like(v)
    t_len = q.shape[2]
    starts = range(0, t_len - t_len % chunk if bug == "tail_dropped" else t_len, chunk)
    for c0 in starts:
        c1 = min(c0 + chunk + (1 if bug == "boundary_overlap" else 0), t_len)
        out[:, :, c0:c1], s = ref._chunk_step(s, q[:, :, c0:c1], k[:, :, c0:c1], v[:, :, c0:c1],
                                              g[:, :, c0:c1], b[:, :, c0:c1], scale)
    return {"out": np.moveaxis(out, 2, 1), "state": np.swapaxes(s, -1, -2)}


@pytest.mark.parametrize("bug", ["boundary_overlap", "tail_dropped"])
def test_nmse_oracle_catches_chunk_boundary_off_by_one(bug):
    x = ref.draw_inputs(**CASE)
    assert check_nmse(serial_reference(x), chunkwise_with_boundary_bug(x, 32, None)).passed
    assert not check_nmse(serial_reference(x), chunkwise_with_boundary_bug(x, 32, bug)).passed


@pytest.mark.quick
def test_bitexact_oracle_accepts_a_pure_restructuring_and_catches_an_off_by_one():
    x = ref.draw_inputs(**CASE)
    whole = dict(zip(("out", "state"), ref.gdn_serial(*x.arrays())))
    assert check_bitexact(whole, dict(zip(("out", "state"), serial_in_chunks(lambda y: ref.gdn_serial(*y.arrays()), x, 32)))).passed

    # Off by one: each chunk after the first restarts one token late, from the state one token early.
    t = x.q.shape[1]
    outs, state = [], x.state
    for c0 in range(0, t, 32):
        sl = slice(c0 + (1 if c0 else 0), c0 + 32)
        o, state = ref.gdn_serial(x.q[:, sl], x.k[:, sl], x.v[:, sl], x.g[:, sl], x.beta[:, sl], state)
        outs.append(o if not c0 else np.concatenate([outs[-1][:, -1:], o], axis=1))
    buggy = {"out": np.concatenate(outs, axis=1), "state": state}
    v = check_bitexact(whole, buggy)
    assert not v.passed and v.metrics["differing_out"] > 0


def test_bitexact_is_stricter_than_nmse():
    """A change of arithmetic order (the chunkwise form) passes NMSE but is not bit-exact."""
    x = ref.draw_inputs(**CASE)
    whole = dict(zip(("out", "state"), ref.gdn_serial(*x.arrays())))
    chunked = dict(zip(("out", "state"), ref.gdn_chunkwise(*x.arrays(), chunk=32)))
    assert check_nmse(whole, chunked).passed
    assert not check_bitexact(whole, chunked).passed


def test_nan_fails_even_when_the_rest_matches():
    x = ref.draw_inputs(**CASE)
    good = serial_reference(x)
    bad = {k: v.astype(np.float32).copy() for k, v in good.items()}
    bad["out"][0, 3, 1, 2] = np.nan
    v = check_nmse(good, bad)
    assert not v.passed and "NaN" in v.detail


# --- `testbed run gdn` with refimpl.gdn itself wrong: the reference shares the bug, the naive loops do not


def test_cli_run_fails_when_refimpl_swaps_the_head_maps(results_dir, monkeypatch, capsys):
    """refimpl.gdn.key_heads giving the interleaved map for `tiled` (and the reverse): the backend's
    serial and chunkwise forms and the float64 reference all read the same wrong key heads, so only the
    naive recurrence, with its own head map, can see it."""
    run = ["run", "gdn", "mode=oracle", "matrix=awkward"]  # grouped value heads (v_repeat 2) in every case
    assert main(run) == 0
    right = ref.key_heads
    other = {"tiled": "interleaved", "interleaved": "tiled"}
    monkeypatch.setattr(ref, "key_heads", lambda h_k, h_v, head_map="tiled": right(h_k, h_v, other[head_map]))
    assert main(run) == 1
    out = capsys.readouterr().out
    records = ResultsStore(results_dir).records("gdn")
    swapped = [r for r in records if r["run_id"] == records[-1]["run_id"]]
    failed = [r for r in swapped if r["verdict"] != "pass"]
    assert failed and {r["params"]["form"] for r in failed} == {NAIVE_FORM}
    assert len(failed) == sum(r["params"]["form"] == NAIVE_FORM for r in swapped)  # every case
    assert "against the naive float64 recurrence" in failed[0]["detail"] and f"FAIL {failed[0]['case']}" in out


def test_cli_run_with_nan_outputs_fails_and_stores_numbers_or_null(results_dir, tmp_path, monkeypatch, capsys):
    """A missing exp (the log-gate used as the decay factor) makes the serial state overflow to inf and
    NaN at llama.cpp's gates: the run must end in failed verdicts, JSON-valid records whose margins and
    NMSEs are numbers or null (never strings), a summary that says the worst NMSE is inf, and the
    table and the report must still read the store."""
    monkeypatch.setattr(ref, "_decay_factor",
                        lambda g_t: g_t[:, :, None, None] if g_t.ndim == 2 else g_t[:, :, None, :])
    assert main(["run", "gdn", "mode=oracle", "matrix=tbo"]) == 1
    out = capsys.readouterr().out
    serial_row = next(line for line in out.splitlines() if line.startswith("| nmse serial "))
    assert serial_row.split("|")[4].strip() == "inf", serial_row

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    lines = (results_dir / "records.jsonl").read_text().splitlines()
    assert all(json.loads(line, parse_constant=refuse) for line in lines)
    records = ResultsStore(results_dir).records("gdn")
    assert all(r["margin"] is None or isinstance(r["margin"], (int, float)) for r in records)
    non_finite = [r for r in records if "NaN/inf values" in r["detail"]]
    assert non_finite and all(r["verdict"] == "fail" and r["margin"] is None and r["metrics"]["nmse"] is None
                              for r in non_finite)
    assert main(["table", "gdn"]) == 0
    assert main(["report", "--out", str(tmp_path / "report")]) == 1  # written; 1: oracles failed
    assert "NaN/inf values" in (tmp_path / "report" / "report.html").read_text()
    assert "report.html" in capsys.readouterr().out
