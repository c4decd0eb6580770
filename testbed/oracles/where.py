"""Where a chunk prefill first goes wrong: the call of the plan, the row in it, and in the cache the layer
and head; asked of an engine under test only once a verdict has failed (a passing run asks nothing more).

The plan of a case (P cached positions, n utterance tokens, chunk C) is its calls: tokens[0:P] in calls
of C rows, then tokens[P:P+n] in calls of C rows (testbed.backends.engine.hybrid.call_ends). A path that
gave wrong logits at the case's position is asked again (engine contract v1: `logits_at` takes several
positions):

  1. the first call whose last row differs from redecode's: the last rows of every call in one
     request (or, past `budget` rows a request, a search over the plan: evenly spaced calls, then the
     stretch between the last that agrees and the first that differs, until they meet);
  2. the first row of that call that differs: its rows in one request; where the engine gives one row
     per call (testbed-c), one request per row asked, each the plan cut after that row (the call then
     ends there: a row depends only on the rows before it), by bisection.

A row differs where its logits are further than logit_atol from redecode's or its argmax is not one the
reference accepts. The search assumes a wrong row stays wrong in later calls (the cache carries it). With
the engine's cache exposed (response/cache/), the first cache row that differs from prefill_at's, and in
it the first layer, then the first KV head, K before V, with the engine's and the reference's values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from testbed.backends import NotSupported, TokenCase
from testbed.backends.engine.hybrid import call_ends
from testbed.errors import DeviceError
from testbed.oracles.tokens import Reference, tied_tokens

LOGITS_BUDGET_BYTES = 64 << 20  # logits rows asked of an engine per request: at most this many bytes

# (positions, end) -> logits rows [len(positions), vocab]: the case's plan cut after tokens[:end]
Ask = Callable[[list[int], int], np.ndarray]


@dataclass(frozen=True)
class Plan:
    """The calls of a chunk-prefill plan as (first row, last row) pairs."""

    calls: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, past: int, total: int, chunk: int) -> "Plan":
        ends = call_ends(past, total, chunk)
        return cls(tuple(zip([0, *(e + 1 for e in ends[:-1])], ends)))

    def call_of(self, row: int) -> int:
        return next(i for i, (first, last) in enumerate(self.calls) if first <= row <= last)


@dataclass
class Row:
    """A row asked of the engine, against redecode's at its position."""

    position: int
    token: int
    token_ref: int
    accepted: list[int]
    diff: float
    atol: float

    @property
    def differs(self) -> bool:
        return not self.diff <= self.atol or self.token not in self.accepted

    def said(self) -> str:
        tokens = f"token {self.token} vs reference {self.token_ref}" if self.token not in self.accepted else \
            f"token {self.token} as the reference"
        return f"{tokens}, |dlogit| {self.diff:.3g}"


@dataclass
class Found:
    """What localising one path found; `said` is the FAIL line's clause."""

    path: str
    chunk: int
    calls: int
    call: int | None = None          # 0-based index in the plan
    rows: tuple[int, int] | None = None
    row: Row | None = None
    requests: int = 0
    stopped: str = ""                # why the search stopped short, in the engine's words

    def said(self) -> str:
        head = f"{self.path} path (C={self.chunk})"
        if self.call is None:
            return f"{head}: {self.stopped or 'every call agrees with redecode at its last row'}"
        first, last = self.rows
        text = f"{head} first differs at call {self.call + 1} of {self.calls}"
        if last == first and self.row is not None:  # a call of one row: that row
            text += f" (row {first}, position {first}): {self.row.said()}"
        else:
            text += f" (rows {first}-{last})" if last > first else f" (row {first})"
            if self.row is not None:
                text += f", row {self.row.position} (position {self.row.position}): {self.row.said()}"
        return text + (f" ({self.stopped})" if self.stopped else "")

    def metrics(self) -> dict:
        out = {"path": self.path, "chunk": self.chunk, "calls": self.calls, "requests": self.requests}
        if self.call is not None:
            out |= {"call": self.call + 1, "call_rows": list(self.rows)}
        if self.row is not None:
            out |= {"row": self.row.position, "token": self.row.token, "token_ref": self.row.token_ref,
                    "max_abs_logit_diff": self.row.diff}
        return out | ({"stopped": self.stopped} if self.stopped else {})


@dataclass
class KVFound:
    row: int
    layer: int
    head: int
    part: str       # "K" or "V"
    value: float
    value_ref: float

    def said(self, plan: Plan) -> str:
        return (f"K/V first differ at row {self.row} (call {plan.call_of(self.row) + 1}), layer {self.layer} head "
                f"{self.head}: {self.part} {self.value:.4g} vs reference {self.value_ref:.4g}")

    def metrics(self) -> dict:
        return {"row": self.row, "layer": self.layer, "head": self.head, "part": self.part, "value": self.value,
                "value_ref": self.value_ref}


def first_true(n: int, test: Callable[[list[int]], list[bool]], budget: int, last_known: bool = False) -> int | None:
    """The smallest i in [0, n) for which `test` holds, where it holds for every index after the first
    that does; `test` is asked about at most `budget` indices at a time. `last_known`: it holds at n - 1."""
    lo, hi = 0, (n - 1 if last_known else n)  # every index below lo fails; hi holds (or hi == n: none known)
    while lo < hi:
        span = hi - lo
        picks = list(range(lo, hi)) if span <= budget else \
            sorted({lo + (i + 1) * span // (budget + 1) for i in range(budget)})
        held = test(picks)
        first = next((j for j, h in enumerate(held) if h), None)
        if first is None:
            lo = picks[-1] + 1
        else:
            hi = picks[first]
            lo = picks[first - 1] + 1 if first else lo
        if span <= budget:
            return hi if hi < n else None
    return hi if hi < n else None


class Localiser:
    """Asks one path of the engine (its chunk C) about rows of a case, against the reference."""

    def __init__(self, ask: Ask, ref: Reference, case: TokenCase, chunk: int, logit_atol: float, budget: int):
        """`chunk`: the path's C (the case's for the chunk path, 1 for the token-by-token path)."""
        self.ask, self.ref, self.case, self.logit_atol, self.budget = ask, ref, case, logit_atol, budget
        self.plan = Plan.of(case.past, case.past + case.tokens, chunk)
        self.plan_chunk = chunk
        self.requests = 0

    def rows(self, positions: list[int], end: int) -> list[Row]:
        self.requests += 1
        got = np.asarray(self.ask(positions, end), np.float64)
        want = self.ref.logits_at(positions)
        out = []
        for position, logits, reference in zip(positions, got, want):
            accepted = tied_tokens(reference, self.logit_atol)
            out.append(Row(position, int(np.argmax(logits)), int(np.argmax(reference)), accepted,
                           float(np.abs(logits - reference).max()), self.logit_atol))
        return out

    def find(self, path: str) -> Found:
        found = Found(path, self.plan_chunk, len(self.plan.calls))
        seen: dict[int, Row] = {}
        ends = [last for _, last in self.plan.calls]
        try:
            try:  # every call's last row in as few requests as the budget allows
                call = first_true(len(ends), lambda picks: self._differ([ends[i] for i in picks], seen), self.budget)
            except NotSupported:  # one row a request, each the plan cut after it: any engine answers that
                call = first_true(len(ends), lambda picks: self._differ([ends[i] for i in picks], seen), 1)
            if call is not None:
                found.call, found.rows = call, self.plan.calls[call]
                found.row = self._first_row(found.rows, seen)
        except (NotSupported, DeviceError) as e:
            found.stopped = f"the engine did not answer a localising request: {e}"
        found.requests = self.requests
        return found

    def _differ(self, positions: list[int], seen: dict[int, Row]) -> list[bool]:
        """Whether each row differs: several in one request of the whole plan, or one in a request of the
        plan cut after it."""
        total = self.case.past + self.case.tokens
        rows = self.rows(positions, total) if len(positions) > 1 else self.rows(positions, positions[0] + 1)
        seen.update({r.position: r for r in rows})
        return [r.differs for r in rows]

    def _first_row(self, rows: tuple[int, int], seen: dict[int, Row]) -> Row:
        first, last = rows
        positions = list(range(first, last + 1))
        if len(positions) > 1 and len(positions) <= self.budget:
            try:  # the call's rows in one request, where the engine gives several rows of one call
                if any(self._differ(positions, seen)):
                    return next(seen[p] for p in positions if seen[p].differs)
                return seen[last]
            except NotSupported:
                pass
        # one row a request (the plan cut after it), by bisection over the call's rows: its last differs
        found = first_true(len(positions), lambda picks: self._differ([positions[i] for i in picks], seen), 1,
                           last_known=True)
        return seen[positions[found]]


def first_kv_difference(ks, vs, want_k, want_v, atol: float) -> KVFound | None:
    """The first cache row (position) whose K or V differs from the reference's beyond `atol`: at that
    row the first layer, then the first KV head, K before V."""
    best = None
    for layer, (k, v, rk, rv) in enumerate(zip(ks, vs, want_k, want_v)):
        for part, got, want in (("K", k, rk), ("V", v, rv)):
            rows = min(got.shape[1], want.shape[1])
            diff = np.abs(np.asarray(got[:, :rows], np.float64) - want[:, :rows])  # [heads, rows, dim]
            bad = np.flatnonzero(~(diff.max(axis=(0, 2)) <= atol))
            if bad.size and (best is None or bad[0] < best[0]):
                row = int(bad[0])
                head = int(np.flatnonzero(~(diff[:, row].max(axis=1) <= atol))[0])
                i = int(np.argmax(diff[head, row]))
                best = (row, KVFound(row, layer, head, part, float(got[head, row, i]), float(want[head, row, i])))
    return best[1] if best else None


@dataclass
class Where:
    """What localising a failing case found, for every failing verdict's detail and metrics."""

    found: list[Found] = field(default_factory=list)
    kv: KVFound | None = None
    kv_exposed: bool = True
    plan: Plan | None = None
    kept: str = ""

    def said(self) -> str:
        parts = [f.said() for f in self.found] or ["the logits agree with redecode at the case's position"]
        if self.kv is not None:
            parts.append(self.kv.said(self.plan))
        elif self.kv_exposed:
            parts.append("the cache's real rows agree with prefill_at's")
        return "where: " + "; ".join(parts) + (f"; {self.kept}" if self.kept else "")

    def metrics(self) -> dict:
        return {"paths": [f.metrics() for f in self.found], "kv": self.kv.metrics() if self.kv else None}


def locate(asks: dict[str, Ask], ref: Reference, case: TokenCase, final: dict[str, np.ndarray], cache,
           logit_atol: float, cache_atol: float, vocab: int) -> Where:
    """Where a failing case breaks. `asks`: per path ("chunk", "decode") how to ask the engine; `final`:
    each path's logits at the case's position as the oracles judged them; `cache`: the chunk path's K and
    V lists (real rows), or None where the engine exposes none."""
    budget = max(1, LOGITS_BUDGET_BYTES // (4 * vocab))
    reference = ref.logits(case.position)
    accepted = tied_tokens(reference, logit_atol)
    where = Where(plan=Plan.of(case.past, case.past + case.tokens, case.chunk), kv_exposed=cache is not None)
    for path, ask in asks.items():
        logits = np.asarray(final[path], np.float64)
        if np.abs(logits - reference).max() <= logit_atol and int(np.argmax(logits)) in accepted:
            continue  # this path is right where the oracle looked
        chunk = case.chunk if path == "chunk" else 1
        where.found.append(Localiser(ask, ref, case, chunk, logit_atol, budget).find(path))
    if cache is not None:
        ks, vs = cache
        want_k, want_v = ref.kv(case.past + case.tokens)
        where.kv = first_kv_difference(ks, vs, want_k, want_v, cache_atol)
    return where
