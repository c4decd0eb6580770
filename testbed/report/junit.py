"""Verdicts as JUnit XML, the file CI tools read (Jenkins' junit and xunit plugins, GitLab's test reports,
GitHub's test-report actions, the same shape pytest's --junitxml writes): `testbed run`, `sweep` and `nightly`
write it with --junit FILE.

One <testsuite> per run (its id, commit, device, backend and overrides as <properties>), one <testcase> per
oracle verdict, named by the record's case and oracle, its classname testbed.EXPERIMENT.DEVICE.BACKEND:

  pass           <testcase/>
  fail           <failure type="fail" message=DETAIL>the verdict's line</failure>
  error          <error type="error" message=DETAIL>: a run that broke, and the run's own error record
  not supported  <skipped message="not supported: THE ENGINE'S WORDS"/>
  not judged     <skipped message="not judged: WHY"/>

A run stopped before it ended (killed, interrupted: testbed.results.stopped_runs) is incomplete: its stop is one
<error> (the command's exit status says it too), and a pass it had reached is <skipped message="incomplete:
...">, never a pass. A nightly adds a testcase per device that did not answer (<error>) and per regression
flag (<failure>), so the file fails exactly when the night's exit status does. Every count (tests,
failures, errors, skipped) is on each suite and on <testsuites>; text is XML-escaped, and what acts on a
display or XML 1.0 cannot hold (an engine's control characters) is written as its escape (\\x1b, \\u202e).

The file is written whole or not at all: into a temporary file beside it, then renamed over it.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from testbed import verdicts
from testbed.errors import UsageError
from testbed.report import implementations
from testbed.report.tables import printable
from testbed.results import stopped_runs
from testbed.verdicts import ERROR, FAIL, NOT_JUDGED, NOT_SUPPORTED, PASS

# What XML 1.0 cannot hold (its Char production): C0 controls but tab, newline and carriage return, lone
# surrogates, U+FFFE and U+FFFF.
NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
MESSAGE_CHARS = 1000  # a message attribute is one line a CI page shows; the element's text holds the rest


def xml_text(value) -> str:
    """Text for an attribute or element: each line through tables.printable (the one escape of what engines
    and devices say: ESC as \\x1b, a right-to-left override as \\u202e), line breaks kept for an element's
    text, then what XML 1.0 still cannot hold (U+FFFE, U+FFFF) escaped the same way."""
    text = "\n".join(printable(line) for line in str(value).split("\n"))
    return NOT_XML.sub(lambda m: m.group().encode("unicode_escape", "backslashreplace").decode("ascii"), text)


@dataclass
class Case:
    """One testcase: its name and classname, and what it says (PASS, FAIL, ERROR or a skip's message)."""

    name: str
    classname: str
    outcome: str  # PASS, FAIL, ERROR, or "skipped"
    message: str = ""
    text: str = ""


@dataclass
class Suite:
    name: str
    cases: list[Case] = field(default_factory=list)
    properties: dict[str, str] = field(default_factory=dict)
    timestamp: str = ""  # ISO time without zone (the schema CI tools read), UTC
    seconds: float | None = None

    def count(self, outcome: str) -> int:
        return sum(c.outcome == outcome for c in self.cases)


def case_name(record: dict) -> str:
    oracle = str(record.get("oracle") or "")
    case = str(record["case"])
    return case if not oracle or case.endswith(oracle) else f"{case} {oracle}"


def _utc(text: str) -> dt.datetime | None:
    try:
        when = dt.datetime.fromisoformat(str(text))
    except ValueError:
        return None
    return (when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)).astimezone(dt.timezone.utc)


def run_suites(records: Iterable[dict]) -> list[Suite]:
    """One suite per run among `records` (as the store reads them back), in the order the runs started."""
    records = list(records)
    stopped = stopped_runs(records)
    runs: dict[str, list[dict]] = {}
    for r in records:
        runs.setdefault(r["run_id"], []).append(r)
    suites = []
    for run_id, rows in sorted(runs.items(), key=lambda kv: (str(kv[1][0]["started"]), kv[0])):
        first = rows[0]
        impl = implementations.of(first)
        classname = f"testbed.{first['experiment']}.{impl.device}.{impl.backend}"
        suite = Suite(f"{first['experiment']} on {impl.device} ({impl.backend}): run {run_id}",
                      properties={"run_id": run_id, "experiment": str(first["experiment"]), "device": impl.device,
                                  "backend": impl.backend, "model": impl.model, "git_commit": str(first["git_commit"]),
                                  "started": str(first["started"]),
                                  "emulated": str(bool(first.get("emulated"))).lower(),
                                  "overrides": " ".join(map(str, first.get("overrides") or []))})
        started = _utc(first["started"])
        if started is not None:
            suite.timestamp = started.replace(tzinfo=None).isoformat(timespec="seconds")
            ends = [t for t in (_utc(r.get("time") or "") for r in rows) if t is not None]
            suite.seconds = max(0.0, (max(ends) - started).total_seconds()) if ends else None
        for r in rows:
            if r["kind"] != "oracle":
                continue
            suite.cases.append(oracle_case(r, classname, stopped.get(run_id)))
        suites.append(suite)
    return suites


def oracle_case(record: dict, classname: str, stopped: str | None) -> Case:
    """A verdict as a testcase; `stopped`: how its run was stopped, if it was."""
    detail = str(record.get("detail") or "")
    name = case_name(record)
    if stopped is not None and record.get("verdict") == PASS:
        return Case(name, classname, "skipped", f"incomplete: the run was stopped before it ended ({stopped}); "
                                                "this pass does not count")
    verdict = record.get("verdict") if stopped is not None else verdicts.of(record)
    if verdict == PASS:
        return Case(name, classname, PASS)
    if verdict in (NOT_SUPPORTED, NOT_JUDGED):
        return Case(name, classname, "skipped", f"{verdict}: {detail}" if detail else verdict)
    if verdict == FAIL:
        return Case(name, classname, FAIL, detail or "fail", verdict_text(record))
    why = detail or ("its run did not end complete" if record.get("verdict") == PASS else "error")
    return Case(name, classname, ERROR, why, verdict_text(record, why))


def verdict_text(record: dict, why: str | None = None) -> str:
    """What the failure or error element holds: the verdict in full, where it ran, and its margin."""
    lines = [f"{verdicts.LABEL.get(verdicts.of(record), 'ERROR')} {record['experiment']} {case_name(record)} on "
             f"{record['device']} ({implementations.of(record).backend}), run {record['run_id']}, commit "
             f"{str(record['git_commit'])[:10]}", why or str(record.get("detail") or "")]
    if isinstance(record.get("margin"), (int, float)) and not isinstance(record.get("margin"), bool):
        lines.append(f"margin {record['margin']}")
    return "\n".join(line for line in lines if line)


def document(suites: list[Suite], name: str = "testbed") -> bytes:
    """The XML document: <testsuites> holding `suites`, every count on each level."""
    root = ET.Element("testsuites", name=xml_text(name))
    totals = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    seconds = 0.0
    for suite in suites:
        counts = {"tests": len(suite.cases), "failures": suite.count(FAIL), "errors": suite.count(ERROR),
                  "skipped": suite.count("skipped")}
        for k, v in counts.items():
            totals[k] += v
        attrs = {"name": xml_text(suite.name), **{k: str(v) for k, v in counts.items()}}
        if suite.timestamp:
            attrs["timestamp"] = suite.timestamp
        if suite.seconds is not None:
            attrs["time"] = f"{suite.seconds:.3f}"
            seconds += suite.seconds
        element = ET.SubElement(root, "testsuite", attrs)
        if suite.properties:
            properties = ET.SubElement(element, "properties")
            for key, value in suite.properties.items():
                ET.SubElement(properties, "property", name=xml_text(key), value=xml_text(value))
        for case in suite.cases:
            testcase = ET.SubElement(element, "testcase", name=xml_text(case.name), classname=xml_text(case.classname))
            if case.outcome == "skipped":
                ET.SubElement(testcase, "skipped", message=xml_text(case.message[:MESSAGE_CHARS]))
            elif case.outcome in (FAIL, ERROR):
                tag = "failure" if case.outcome == FAIL else "error"
                child = ET.SubElement(testcase, tag, message=xml_text(case.message[:MESSAGE_CHARS]), type=case.outcome)
                child.text = xml_text(case.text)
    root.attrib.update({k: str(v) for k, v in totals.items()})
    root.set("time", f"{seconds:.3f}")
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"


def check_target(path: str | os.PathLike) -> Path:
    """A --junit FILE that can be written, checked before anything runs (one line, exit 2 otherwise)."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"--junit {path}: is a folder; accepted: a file path (written whole at the end)")
    if not target.parent.is_dir():
        raise UsageError(f"--junit {path}: its folder {target.parent} does not exist; accepted: a file in an "
                         "existing folder")
    if not os.access(target.parent, os.W_OK):
        raise UsageError(f"--junit {path}: its folder {target.parent} is not writable")
    return target


def write(path: str | os.PathLike, suites: list[Suite], name: str = "testbed") -> Path:
    """Write the document whole or not at all: a temporary file beside `path`, renamed over it (a symlink at
    `path` is replaced, never followed)."""
    target = Path(path)
    data = document(suites, name)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
