"""Planted bugs in the hybrid engine (kernels/hybrid.c): each a realistic one-line slip built into its
own engine program (tests/native_support.mutant_hybrid_program) for the selected device (the host in
the host suite), run there, and judged by the hybrid experiment's own oracles
(testbed.oracles.hybrid), which must catch it while the real program passes the same checks (the first
test here). The oracles run on the host whatever the device, and the engine computes the same bytes on
every target (tests/device/test_hybrid_on_device.py checks it on each device), so these stay out of the
device suites: each plant is one more build per ABI."""

import numpy as np
import pytest

from refimpl import qwen35
from testbed.backends.native import hybrid as engine
from testbed.backends.native.build import target_for_abi
from testbed.oracles.hybrid import check_engine_case, check_engine_tail
from tests.native_support import mutant_hybrid_program

pytestmark = [pytest.mark.requires("native")]

CFG = qwen35.tiny_config()
CHUNK = 32
PAST, TOKENS = 45, 20  # the past: 32, then 13 padded to 32 (a boundary at 44); the case: 20 padded to 32
TAIL = CHUNK + 9


@pytest.fixture(scope="module")
def model():
    w = qwen35.init_weights(CFG, 0)
    prompt = np.random.default_rng(3).integers(0, CFG.vocab, 100)
    return w, prompt, qwen35.redecode(w, CFG, prompt[:PAST + TOKENS])


def failures(device, model, program=None) -> set[str]:
    """The oracles a program fails: the chunk case (token at every boundary, state, naive) and the
    padded tail (first token and state against scalar, bytes against the unpadded tail)."""
    w, prompt, reference = model
    case = engine.prefill(device, CFG, w, prompt, past=PAST, tokens=TOKENS, chunk=CHUNK, program=program)
    verdicts = check_engine_case(w, CFG, prompt, PAST, TOKENS, case, reference=reference)
    runs = [engine.prefill(device, CFG, w, prompt, past=0, tokens=TAIL, chunk=CHUNK, tail=tail, program=program)
            for tail in ("padded", "exact", "scalar")]
    verdicts += check_engine_tail(*runs)
    return {v.oracle for v in verdicts if not v.passed}


def planted(device, find, replace, file="hybrid.c"):
    return mutant_hybrid_program(target_for_abi(device.profile.abi), file, find, replace)


def test_the_real_engine_passes(device, model):
    assert failures(device, model) == set()


def test_a_conv_state_shifted_by_one_row_is_caught(device, model):
    # the conv state taken one row early: the next call's kernel reads a row twice and misses the last
    prog = planted(device, "memcpy(e->conv[i], e->rows + (size_t)n * cd,", "memcpy(e->conv[i], e->rows + (size_t)(n - 1) * cd,")
    assert {"state", "token", "naive"} <= failures(device, model, prog)


def test_a_gate_read_on_the_wrong_axis_is_caught(device, model):
    # the gate projection [rows, H_v] read head-major: each token gets another token's (and head's) decay
    prog = planted(device, "softplus1(e->a[at] + w->dt_bias[hv])", "softplus1(e->a[(size_t)hv * rows + t] + w->dt_bias[hv])")
    assert {"state", "naive"} <= failures(device, model, prog)


def test_pad_rows_leaking_into_the_recurrent_state_are_caught(device, model):
    # pads keep their beta: each pad row writes its delta into the recurrent state
    prog = planted(device, "e->beta[at] = t < n ? sigmoid1(e->b[at]) : 0.0f;", "e->beta[at] = sigmoid1(e->b[at]);")
    caught = failures(device, model, prog)
    assert {"tail_bytes", "tail_state", "state"} <= caught


def test_a_padded_calls_logits_from_its_last_row_are_caught_at_the_boundary(device, model):
    # the logits of the call's last row, a pad's when the call is padded: every full chunk is right, so
    # only the token at the past's padded boundary (and the padded tail's first token) can tell
    prog = planted(device, "const int first = select == TB_HYBRID_ALL_ROWS ? 0 : select,",
                   "const int first = select == TB_HYBRID_ALL_ROWS ? 0 : rows - 1,")
    caught = failures(device, model, prog)
    assert "token" in caught and "state" not in caught


def test_threads_and_decode_steps_give_the_same_bytes(device, model):
    """Threads split output columns and heads, never a sum: two threads give one thread's bytes. A tail
    of decode steps gives the bytes of the same rows in one call with the serial recurrence (which
    walks the tokens one by one either way)."""
    from testbed.oracles.numerical import digest

    w, prompt, _ = model
    runs = [engine.prefill(device, CFG, w, prompt, past=PAST, tokens=TOKENS, chunk=CHUNK, threads=t) for t in (1, 2)]
    assert digest(runs[0].call_logits, *runs[0].state.arrays().values()) == \
        digest(runs[1].call_logits, *runs[1].state.arrays().values())
    scalar, exact = (engine.prefill(device, CFG, w, prompt, past=0, tokens=TAIL, chunk=CHUNK, tail=tail, gdn="serial")
                     for tail in ("scalar", "exact"))
    assert digest(scalar.logits, *scalar.state.arrays().values()) == digest(exact.logits, *exact.state.arrays().values())
