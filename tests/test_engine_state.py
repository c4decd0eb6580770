"""An engine's state under `testbed run tail backend=engine` (testbed.oracles.engine): no engine passes by
agreeing with itself. Its padded state equal to its unpadded one counts only beside an oracle on what the
state holds: restored in a fresh engine process and continued against the reference (an engine whose yaml
says supports.state_in), or the properties a state of the prompt's caches has (one that cannot restore).

The planted engines are testbed-c behind a script that damages its state.bin (tests/test_engine_contract.py
wrapper_engine): empty, the same 64 bytes for every prompt, the state from before the prompt's last call.
Each FAILs, restoring or not. The wrong-sequence adapter of llama.cpp is in tests/test_llamacpp_engine.py.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from tests.cli_support import said
from tests.test_engine_contract import TAIL_SMALL, cli, lab, run, wrapper_engine  # noqa: F401 (lab: a fixture)
from testbed.backends.engine import spec as engine_spec
from testbed.backends.engine.state import StateFile, compare
from testbed.errors import UsageError

RESTORES = "{techniques: [tail], state_in: true}"
CANNOT_RESTORE = "{techniques: [tail]}"
CONTENT = {RESTORES: "state_continuation", CANNOT_RESTORE: "state_properties"}

# what each planted engine does to the state.bin testbed-c wrote (a continuation request asks for none)
STATE_FAULTS = {
    "empty": "(out / 'state.bin').write_bytes(b'') if (out / 'state.bin').exists() else None",
    "constant": "(out / 'state.bin').write_bytes(b'\\x42' * 64) if (out / 'state.bin').exists() else None",
    # the prompt's state from before its last call: what the prompt without its last token leaves
    "before_last_call": """\
        if (out / 'state.bin').exists():
            import shutil, tempfile
            with tempfile.TemporaryDirectory() as tmp:
                again, answer = Path(tmp) / 'request', Path(tmp) / 'response'
                shutil.copytree(request, again)
                answer.mkdir()
                tokens = np.load(request / 'tokens.npy')[:-1]
                np.save(again / 'tokens.npy', tokens)
                kept = [a for a in (again / 'request.args').read_text().splitlines()
                        if not a.startswith(('n_tokens=', 'logits_at='))]
                (again / 'request.args').write_text('\\n'.join(kept + [f'n_tokens={tokens.size}',
                                                                       f'logits_at={tokens.size - 1}']) + '\\n')
                subprocess.run([real, str(again), str(answer)], check=True)
                shutil.copy(answer / 'state.bin', out / 'state.bin')
        """,
}


def tail_frame(engine: str):
    # the state grid of TAIL_SMALL (5 prompts of one window) and one first-token prompt
    outcome = run(["backend=engine", f"engine={engine}", *TAIL_SMALL, "oracle.around_chunk=[[1,2]]"], experiment="tail")
    return outcome, outcome.frame()


@pytest.mark.parametrize("supports", [RESTORES, CANNOT_RESTORE], ids=["restores", "cannot-restore"])
@pytest.mark.parametrize("fault", list(STATE_FAULTS))
def test_a_state_that_does_not_hold_the_prompt_fails_tail(lab, results_dir, fault, supports):
    wrapper_engine(lab, f"state-{fault}", STATE_FAULTS[fault], supports=supports)
    outcome, df = tail_frame(f"state-{fault}")
    content = df[df["oracle"] == CONTENT[supports]]
    assert len(content) == 5 and (content["verdict"] == "fail").all(), content[["case", "verdict", "detail"]].to_string()
    state_bytes = df[df["oracle"] == "state_bytes"]
    assert len(state_bytes) == 5 and "pass" not in set(state_bytes["verdict"]), state_bytes[["verdict", "detail"]]
    assert outcome.tally.exit_status() == 1


def test_the_failures_say_what_is_wrong_with_the_state(lab, results_dir):
    wrapper_engine(lab, "stale", STATE_FAULTS["before_last_call"], supports=CANNOT_RESTORE)
    _, df = tail_frame("stale")
    details = df.loc[df["oracle"] == "state_properties", "detail"]
    assert details.str.contains(r"\(a\) state.bin is the same for two prompts that differ in their last token").all()
    wrapper_engine(lab, "stale-restoring", STATE_FAULTS["before_last_call"], supports=RESTORES)
    _, df = tail_frame("stale-restoring")
    details = df.loc[df["oracle"] == "state_continuation", "detail"]
    assert details.str.contains("continuing from its own state.bin").all(), details.iloc[0]
    assert details.str.contains("the request says the state holds positions").all(), details.iloc[0]


def test_a_state_corrupted_where_the_engine_cannot_tell_fails_the_continuation_by_its_logits(lab, results_dir):
    """Every byte of the first layer's K rows off by one: testbed-c restores it without complaint (its positions
    are right), so only the tokens decoded after it can tell."""
    wrapper_engine(lab, "k-corrupt", """\
        if (out / 'state.bin').exists():
            raw = bytearray((out / 'state.bin').read_bytes())
            raw[:16 * 32 * 4] = bytes((b + 1) % 256 for b in raw[:16 * 32 * 4])  # window 16 x head_dim 32 float32
            (out / 'state.bin').write_bytes(bytes(raw))
        """, supports=RESTORES)
    _, df = tail_frame("k-corrupt")
    content = df[df["oracle"] == "state_continuation"]
    assert (content["verdict"] == "fail").all(), content[["verdict", "detail"]].to_string()
    assert content["detail"].str.contains("logits differ from the reference's by|the engine gives token").all()


def test_honest_testbed_c_passes_the_continuation_and_its_agreement_counts(results_dir):
    _, df = tail_frame("testbed-c")
    state = df[df["oracle"].isin(["state_continuation", "state_bytes"])]
    assert len(state) == 10 and (state["verdict"] == "pass").all(), state[["case", "verdict", "detail"]].to_string()
    continued = df[df["oracle"] == "state_continuation"].iloc[0]
    assert continued["metrics.max_abs_diff"] < 1e-4 and len(continued["metrics.fed"]) == 4
    assert continued["metrics.atol_from"] == "oracle.naive_atol.float32"


def test_an_engine_that_cannot_restore_gets_the_property_checks(lab, results_dir):
    wrapper_engine(lab, "plain", "pass", supports=CANNOT_RESTORE)
    outcome, df = tail_frame("plain")
    props = df[df["oracle"] == "state_properties"]
    assert len(props) == 5 and (props["verdict"] == "pass").all(), props[["verdict", "detail"]].to_string()
    for key in ("distinct", "last_call", "size"):
        assert (props[f"metrics.property.{key}"] == "pass").all(), key
    assert (df.loc[df["oracle"] == "state_bytes", "verdict"] == "pass").all()
    assert outcome.tally.exit_status() == 0


def test_an_engine_whose_state_properties_cannot_be_checked_reads_not_judged(lab, results_dir):
    """An engine with a fixed chunk graph cannot append a partial chunk unpadded (it refuses tail.mode none), so
    nothing shows its state.bin is a function of the prompt: (a) and (b) are not read, and a size alone proves
    nothing. The state oracles are "not judged" / "not supported", never a pass; the first token still judges."""
    wrapper_engine(lab, "fixed-graph", """\
        if 'tail.mode=none' in (request / 'request.args').read_text().splitlines():
            for f in out.iterdir():
                f.unlink()
            (out / 'status.json').write_text(json.dumps({'contract': 1, 'status': 'refused',
                                                         'reason': 'a fixed chunk graph: no partial chunk unpadded'}))
        """, supports=CANNOT_RESTORE)
    outcome, df = tail_frame("fixed-graph")
    verdicts = df.groupby("oracle")["verdict"].agg(set).to_dict()
    assert verdicts["state_properties"] == {"not judged"} and verdicts["state_bytes"] == {"not supported"}, verdicts
    assert verdicts["first_token"] == {"pass"}
    detail = df.loc[df["oracle"] == "state_properties", "detail"].iloc[0]
    assert "refused the unpadded tail" in detail and "a size alone" in detail
    assert outcome.tally.exit_status() == 0


# state.bin as float32 values: each byte of testbed-c's state one value (the same information in a float
# layout); the unpadded tail's values moved by 1e-6 relative, as kernels that round by row count move them
FLOAT_STATE = """\
    for name in ('state.bin', 'state_before_last.bin'):
        if (out / name).exists():
            values = np.frombuffer((out / name).read_bytes(), np.uint8).astype('<f4')
            if 'tail.mode=none' in (request / 'request.args').read_text().splitlines():
                values = values * np.float32(1 + 1e-6)
            (out / name).write_bytes(values.tobytes())
    """


@pytest.mark.parametrize("declared, verdict", [("state: {layout: float32, tolerance: 1.0e-3}\n", "pass"), ("", "fail")],
                         ids=["declared", "bytes"])
def test_an_engine_that_rounds_by_row_count_declares_a_state_tolerance(lab, results_dir, declared, verdict):
    wrapper_engine(lab, "rounding", FLOAT_STATE, supports=CANNOT_RESTORE, more=declared)
    _, df = tail_frame("rounding")
    agreement = df[df["oracle"] == "state_bytes"]
    assert (agreement["verdict"] == verdict).all(), agreement[["verdict", "detail"]].to_string()
    if verdict == "pass":
        assert (agreement["metrics.max_abs_diff"] > 0).all()  # the states differ, within the tolerance
        assert (df.loc[df["oracle"] == "state_properties", "verdict"] == "pass").all()
    else:
        assert agreement["detail"].str.contains("differ in").all()


def test_a_state_larger_than_the_caches_can_hold_is_refused_before_it_is_pulled(lab, results_dir):
    wrapper_engine(lab, "huge-state", """\
        if (out / 'state.bin').exists():
            with open(out / 'state.bin', 'r+b') as f:
                f.truncate(64 << 20)  # sparse: 64 MiB the model's caches cannot hold
        """, supports=CANNOT_RESTORE)
    p = cli("run", "tail", "backend=engine", "engine=huge-state", *TAIL_SMALL,
            env={"TESTBED_LAB": str(lab), "TESTBED_RESULTS": str(results_dir)})
    lines = said(p.stderr)
    assert p.returncode == 4, p.stderr
    assert any("response/state.bin holds 67108864 bytes, more than this model's caches can hold" in line
               for line in lines), lines
    assert not any("Traceback" in line for line in lines)
    records = [json.loads(line) for line in (results_dir / "records.jsonl").read_text().splitlines()]
    assert "pass" not in [r.get("verdict") for r in records if r.get("kind") == "oracle"]


def state_file(tmp_path: Path, name: str, data: bytes | None = None, size: int | None = None) -> StateFile:
    path = tmp_path / name
    if data is not None:
        path.write_bytes(data)
    else:
        with open(path, "wb") as f:
            f.truncate(size)
    return StateFile(path)


def test_states_are_compared_in_bounded_memory(tmp_path):
    """Two 64 MiB states differing in two bytes near the end: found at their offset, with far less memory
    than one of them (a Python byte loop over a 1 GB state took minutes and twice its size)."""
    size = 64 << 20
    a = state_file(tmp_path, "a.bin", size=size)
    b_path = tmp_path / "b.bin"
    with open(b_path, "wb") as f:
        f.truncate(size)
        f.seek(size - 1000)
        f.write(b"\x01\x02")
    b = StateFile(b_path)
    tracemalloc.start()
    diff = compare(a, b)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert not diff.same and diff.first == size - 1000 and diff.differing == 2
    assert peak < 16 << 20, peak
    path = a.path
    del a
    assert not path.exists()  # a StateFile's file goes with it


@pytest.mark.parametrize("a, b, layout, tolerance, same, says", [
    (b"\x00" * 8, b"\x00" * 8, "bytes", 0.0, True, "are equal"),
    (b"\x00" * 8, b"\x00" * 7 + b"\x01", "bytes", 0.0, False, "differ in 1 bytes, the first at offset 7"),
    (b"\x00" * 8, b"\x00" * 9, "bytes", 0.0, False, "holds 8 bytes"),
    (np.float32([1, 2]).tobytes(), np.float32([1, 2.0001]).tobytes(), "float32", 1e-3, True, "equal within"),
    (np.float32([1, 2]).tobytes(), np.float32([1, 2.01]).tobytes(), "float32", 1e-3, False, "the first at index 1"),
    (np.float32([1, 2]).tobytes(), np.float32([np.nan, 2]).tobytes(), "float32", 1e-3, False, "the first at index 0"),
    (np.float16([1, 2]).tobytes(), np.float16([1, 2.001]).tobytes(), "float16", 1e-2, True, "equal within"),
])
def test_state_comparison_by_layout(tmp_path, a, b, layout, tolerance, same, says):
    diff = compare(state_file(tmp_path, "a", a), state_file(tmp_path, "b", b), layout, tolerance)
    assert diff.same == same and says in diff.says("a", "b"), diff.says("a", "b")


@pytest.mark.parametrize("lines, problem", [
    ("state: {tolerance: 1.0e-5}\n", "state.tolerance=1e-05 needs a state.layout"),
    ("state: {layout: float64}\n", "state.layout='float64'"),
    ("tolerance: {float32: -1}\n", "tolerance.float32=-1; accepted: a finite number > 0"),
    ("supports: {techniques: [tail], state_in: 'yes'}\n", "supports.state_in='yes'; accepted: true, false"),
])
def test_a_bad_state_declaration_is_one_line_naming_the_key(lab, lines, problem):
    (lab / "engines").mkdir()
    (lab / "engines" / "p").write_text("#!/bin/sh\nexit 99\n")  # a program that exists (never run)
    text = ("name: x\ncontract: 1\nprogram: p\nabis: [host]\ninvoke: ['{program}']\nbuild: {prebuilt: {host: p}}\n" +
            ("" if lines.startswith("supports") else "supports: {techniques: [tail]}\n") + lines)
    (lab / "engines" / "x.yaml").write_text(text)
    with pytest.raises(UsageError, match="x.yaml") as e:
        engine_spec.load("x")
    assert problem in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_an_engine_that_does_not_restore_is_never_sent_a_state(lab, tmp_path):
    """The runner itself refuses to send state_in to an engine whose yaml does not declare supports.state_in."""
    from refimpl import gemma
    from testbed import devices
    from testbed.backends.engine import build, runner as engine_runner
    from testbed.backends.native.engine import export_weights
    from testbed.devices import load_profile

    wrapper_engine(lab, "plain", "pass", supports=CANNOT_RESTORE)
    spec = engine_spec.load("plain")
    cfg = gemma.tiny_config()
    request = engine_runner.Request("tail", np.arange(8), export_weights(cfg, gemma.init_weights(cfg, 0)), chunk=1,
                                    logits_at=[7], state_in=tmp_path / "state.bin", state_in_positions=7)
    device = devices.connect(load_profile("host"))
    with pytest.raises(UsageError, match="supports.state_in is not true"):
        engine_runner.call(device, spec, request, engine_runner.Expect(cfg.vocab), build.program_for(spec, "host"))
