"""testbed.oracles.where's search on its own, fast: the first index that holds with at most `budget` asks
at a time, and the first call and row of a plan whose logits differ, against answers made from refimpl
with a wrong row planted. (A real engine's failure is located in tests/test_engine_contract.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from refimpl import gemma
from testbed.backends import NotSupported, TokenCase
from testbed.oracles.tokens import Reference
from testbed.oracles.where import Localiser, Plan, first_kv_difference, first_true


@pytest.mark.parametrize("n, first, budget", [(1, 0, 1), (1, 1, 4), (12, 0, 1), (12, 11, 1), (12, 5, 1), (12, 12, 1),
                                              (100, 37, 4), (100, 99, 8), (100, 100, 8), (100, 0, 200), (7, 3, 2)])
def test_first_true_finds_the_first_index_asking_at_most_budget_at_a_time(n, first, budget):
    asked = []

    def holds(picks):
        asked.append(picks)
        return [i >= first for i in picks]

    assert first_true(n, holds, budget) == (first if first < n else None)
    assert max(len(p) for p in asked) <= budget
    if budget == 1 and n > 1:  # bisection: about log2(n) asks
        assert len(asked) <= int(np.ceil(np.log2(n))) + 1


def test_a_plan_is_the_past_then_the_utterance_in_calls_of_c_rows():
    assert Plan.of(5, 12, 4).calls == ((0, 3), (4, 4), (5, 8), (9, 11))
    assert Plan.of(5, 12, 4).call_of(9) == 3 and Plan.of(8, 9, 4).calls == ((0, 3), (4, 7), (8, 8))


@pytest.fixture(scope="module")
def reference():
    cfg = gemma.tiny_config()
    w = gemma.init_weights(cfg, 0)
    return Reference(w, cfg, np.random.default_rng(1).integers(0, cfg.vocab, 40))


def engine_answers(ref: Reference, wrong_from: int, chunk: int, past: int, one_row_per_call: bool):
    """Answers an engine with rows from `wrong_from` on off by 0.5 would give; like testbed-c, optionally
    refusing two rows of one call in a request."""
    asked = []

    def ask(positions, end):
        asked.append((list(positions), end))
        if one_row_per_call and len(positions) > 1:
            plan = Plan.of(past if end > past else (end - 1) // chunk * chunk, end, chunk)
            calls = [plan.call_of(p) for p in positions]
            if len(set(calls)) < len(calls):
                raise NotSupported("engine toy refused: logits_at: one logits row per call")
        logits = ref.logits_at(positions).copy()
        logits[[p >= wrong_from for p in positions]] += np.linspace(0, 0.5, logits.shape[1], dtype=np.float32)
        return logits

    return ask, asked


@pytest.mark.parametrize("wrong_from, one_row_per_call, call, requests", [
    (9, True, 3, 4),      # the calls' last rows in one request; the call's rows refused; rows 9-11 bisected: 10, 9
    (10, False, 3, 2),    # the call's rows in one request
    (4, True, 1, 1),      # a call of one row, in the past
    (6, True, 2, 4),      # the calls' last rows; the call's rows refused; rows 5-8 bisected: 6 differs, 5 does not
])
def test_the_first_call_and_row_that_differ_are_found(reference, wrong_from, one_row_per_call, call, requests):
    case = TokenCase(5, 7, 4)
    ask, asked = engine_answers(reference, wrong_from, 4, 5, one_row_per_call)
    found = Localiser(ask, reference, case, 4, 1e-3, budget=64).find("chunk")
    assert (found.call, found.row.position) == (call, wrong_from), found.said()
    assert found.row.differs and found.requests == len(asked) == requests, asked


def test_an_engine_that_refuses_every_localising_request_is_said_so(reference):
    def refusing(positions, end):
        raise NotSupported("engine toy refused: not today")

    found = Localiser(refusing, reference, TokenCase(5, 7, 4), 4, 1e-3, budget=64).find("chunk")
    assert found.call is None and "the engine did not answer a localising request: engine toy refused" in found.said()


def test_the_first_kv_difference_is_the_earliest_row_then_layer_then_head():
    rng = np.random.default_rng(0)
    want_k = [rng.standard_normal((2, 10, 4)).astype(np.float32) for _ in range(3)]
    want_v = [rng.standard_normal((2, 10, 4)).astype(np.float32) for _ in range(3)]
    k, v = [a.copy() for a in want_k], [a.copy() for a in want_v]
    assert first_kv_difference(k, v, want_k, want_v, 1e-3) is None
    v[2][1, 6, 3] += 1.0   # a later layer at an earlier row wins over an earlier layer at a later row
    k[0][0, 8, 0] += 1.0
    found = first_kv_difference(k, v, want_k, want_v, 1e-3)
    assert (found.row, found.layer, found.head, found.part) == (6, 2, 1, "V")
    k[1][1, 6, 0] += 1.0   # the same row: the lower layer
    found = first_kv_difference(k, v, want_k, want_v, 1e-3)
    assert (found.row, found.layer, found.head, found.part) == (6, 1, 1, "K")
    assert found.value == pytest.approx(want_k[1][1, 6, 0] + 1.0) and found.value_ref == want_k[1][1, 6, 0]
