"""What an oracle can say, and what a set of verdicts means for a gate.

An oracle record's verdict is one of four states, or the error of a run that broke:

  pass           judged, and equivalent to the reference
  fail           judged, and not equivalent: the only verdict that makes a run fail
  not supported  the engine or device refused, in its own words (an engine's "refused" status, a technique
                 its yaml does not list, a cache it does not expose): never a failure, never a pass
  not judged     nothing to compare (a state an engine returns that no property can tell from an empty
                 one, a reference that cannot be made here): never a pass
  error          the run broke before it could judge (a device failure, a signal, a killed run): fails
                 like a fail, since nothing says the code is right

A gate (`testbed run`, `sweep`, `nightly`, `ab`, `report`, `pytest --device`) reads a set of verdicts as
one exit status: 1 when any verdict fails or errs, 0 when at least one was judged and none failed, and
NOTHING_JUDGED (7) when every verdict was a refusal or not judged: a run that checked nothing is neither
green nor red. (A run with no verdicts at all, one that only measures, exits 0.) Summaries count each state ("13 pass, 4 not supported"), never a refusal as a failure.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping

PASS = "pass"
FAIL = "fail"
NOT_SUPPORTED = "not supported"
NOT_JUDGED = "not judged"
ERROR = "error"

VERDICTS = (PASS, FAIL, NOT_SUPPORTED, NOT_JUDGED, ERROR)
JUDGED = (PASS, FAIL)               # the oracle compared something with its reference
UNJUDGED = (NOT_SUPPORTED, NOT_JUDGED)
FAILING = (FAIL, ERROR)             # what makes a gate fail

# The exit status of a gate that judged nothing: every verdict a refusal or not judged (the other statuses:
# testbed.cli's docstring).
NOTHING_JUDGED = 7

# The order states are said in, and the word each is said with in a line that names one record.
ORDER = (PASS, FAIL, ERROR, NOT_SUPPORTED, NOT_JUDGED)
LABEL = {PASS: "PASS", FAIL: "FAIL", ERROR: "ERROR", NOT_SUPPORTED: "NOT SUPPORTED", NOT_JUDGED: "NOT JUDGED"}


def of(record: Mapping) -> str:
    """A record's verdict as a gate reads it: a pass from a run that did not end complete (the store marks
    such records incomplete) is an error, since the run never finished; a verdict testbed never writes is
    an error too, never anything better."""
    verdict = record.get("verdict")
    if verdict not in VERDICTS or (verdict == PASS and record.get("incomplete")):
        return ERROR
    return verdict


class Tally:
    """How many verdicts of each state a set of oracle records holds."""

    def __init__(self, verdicts: Iterable[str] = ()):
        self.counts = Counter({v: 0 for v in VERDICTS})
        self.counts.update(verdicts)

    @classmethod
    def of_records(cls, records: Iterable[Mapping], strict: bool = True) -> "Tally":
        """The oracle records among `records` (dicts or testbed.results.Record), each read by `of` (strict) or
        as stored."""
        def verdict(r):
            r = r if isinstance(r, Mapping) else vars(r)
            return of(r) if strict else r.get("verdict")
        return cls(verdict(r) for r in records if (r if isinstance(r, Mapping) else vars(r)).get("kind") == "oracle")

    def __add__(self, other: "Tally") -> "Tally":
        out = Tally()
        out.counts = self.counts + other.counts
        for v in VERDICTS:
            out.counts.setdefault(v, 0)
        return out

    def __getitem__(self, verdict: str) -> int:
        return self.counts[verdict]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def judged(self) -> int:
        return sum(self.counts[v] for v in JUDGED)

    @property
    def failed(self) -> int:
        return sum(self.counts[v] for v in FAILING)

    @property
    def unjudged(self) -> int:
        return sum(self.counts[v] for v in UNJUDGED)

    def exit_status(self) -> int:
        """1 when any verdict fails or errs; 0 when at least one passed, or when there are no verdicts at all
        (a run that only measures); NOTHING_JUDGED when every verdict is not supported or not judged."""
        if self.failed:
            return 1
        return 0 if self.counts[PASS] or not self.total else NOTHING_JUDGED

    def outcome(self) -> str:
        """A few words for the whole: failed, passed, nothing judged, or no verdicts."""
        if not self.total:
            return "no verdicts"
        return {1: "failed", 0: "passed"}.get(self.exit_status(), "nothing judged")

    def phrase(self) -> str:
        """"13 pass, 4 not supported": each state present, in ORDER; "no verdicts" when empty."""
        said = [f"{self.counts[v]} {v}" for v in ORDER if self.counts[v]]
        return ", ".join(said) if said else "no verdicts"

    def as_dict(self) -> dict[str, int]:
        return {v.replace(" ", "_"): self.counts[v] for v in ORDER}
