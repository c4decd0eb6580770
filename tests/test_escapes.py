"""What an engine, a device or a file says reaches a terminal line or Markdown inert (issue 44, item 4):
every control character escaped by the one helper, testbed.report.tables.printable; HTML is escaped by
the report's templates (jinja's autoescape). An engine that refuses with a hostile reason (ANSI
sequences that clear the screen and recolour, a carriage return, a right-to-left override, C1's CSI,
markup) is run through the CLI; what it said is read back from the terminal, `testbed table`, and the
report's Markdown and HTML."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pandas as pd
import pytest

from testbed import PROJECT_ROOT
from testbed.report.tables import fit, markdown, printable

HOSTILE = "\x1b[2J\x1b[31mwiped\x1b[0m\rover \u202egnp.exe <b>bold</b> \x9b31m"
SHOWN = "\\x1b[2J\\x1b[31mwiped\\x1b[0m\\rover \\u202egnp.exe <b>bold</b> \\x9b31m"
ACTING = ("\x1b", "\r", "\u202e", "\x9b")


@pytest.mark.parametrize("text, shown", [
    ("plain text, é, 中文, ✓", "plain text, é, 中文, ✓"),
    (HOSTILE, SHOWN),
    ("two\nlines\tand a tab", "two\\nlines\\tand a tab"),
    ("back\bspace and bell\a and NUL\x00", "back\\x08space and bell\\x07 and NUL\\x00"),
    ("zero\u200bwidth, line\u2028separator, BOM\ufeff", "zero\\u200bwidth, line\\u2028separator, BOM\\ufeff"),
    (b"not utf-8 \xff".decode("utf-8", "surrogateescape"), "not utf-8 \\udcff"),
    (42, "42"),
])
def test_printable_escapes_what_acts_on_a_display_and_keeps_text(text, shown):
    assert printable(text) == shown
    assert printable(shown) == shown  # already inert: unchanged


def test_a_markdown_table_cell_and_header_are_escaped():
    table = markdown(pd.DataFrame({"col\x1b[1m": [HOSTILE]}))
    assert not any(c in table for c in ACTING) and SHOWN in table and "col\\x1b[1m" in table


REFUSER = """\
name: refuser
contract: 1
build: {prebuilt: {host: ../refuser.py}}
program: refuser.py
abis: [host]
supports: {techniques: [chunk_prefill]}
invoke: ["{program}", "{request}", "{response}"]
timeout_s: 600
counts: process
"""


def test_an_engines_hostile_refusal_reason_reaches_terminal_table_and_report_inert(tmp_path):
    lab, results = tmp_path / "lab", tmp_path / "results"
    (lab / "engines").mkdir(parents=True)
    (lab / "engines" / "refuser.yaml").write_text(REFUSER)
    (lab / "refuser.py").write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""\
        import json, sys
        from pathlib import Path
        out = Path(sys.argv[2])
        out.mkdir(parents=True, exist_ok=True)
        (out / "status.json").write_text(json.dumps({{"contract": 1, "status": "refused", "reason": {HOSTILE!r}}}))
        """))
    (lab / "refuser.py").chmod(0o755)
    env = {**os.environ, "TESTBED_LAB": str(lab), "TESTBED_RESULTS": str(results),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))}

    def testbed(*args):
        return subprocess.run([sys.executable, "-m", "testbed", *args], cwd=PROJECT_ROOT, env=env, capture_output=True,
                              text=True, timeout=1800)

    ran = testbed("run", "chunk_prefill", "backend=engine", "engine=refuser", "mode=oracle",
                  "cases=[{past: 5, tokens: 7}]", "chunk=4")
    assert ran.returncode == 7, ran.stderr  # every verdict "not supported": nothing judged
    stored = [json.loads(line) for line in (results / "records.jsonl").read_text().splitlines()]
    assert any(HOSTILE in str(r.get("detail")) for r in stored)  # the record keeps what the engine said, exactly
    table = testbed("table", "chunk_prefill")
    report = testbed("report", f"--out={tmp_path / 'report'}")
    assert table.returncode == 0 and report.returncode == 7, table.stderr + report.stderr  # 7: nothing judged
    md = (tmp_path / "report" / "report.md").read_text()
    # the escapes as they read (in Markdown's source, its own backslashes and brackets escaped once more)
    for where, text, shown in (("run", ran.stdout + ran.stderr, "\\x1b[2J\\x1b[31mwiped"),
                               ("table", table.stdout + table.stderr, "\\x1b[2J\\x1b[31mwiped"),
                               ("report.md", md, "\\\\x1b\\[2J\\\\x1b\\[31mwiped")):
        assert not any(c in text for c in ACTING), (where, [c for c in ACTING if c in text])
        assert shown in text, (where, text[-2000:])
    assert "&lt;b&gt;bold&lt;/b&gt;" in md and "<b>bold" not in md
    html = (tmp_path / "report" / "report.html").read_text()
    assert "&lt;b&gt;bold&lt;/b&gt;" in html and "<b>bold" not in html  # jinja's autoescape


@pytest.mark.quick
def test_a_terminal_table_cuts_escaped_text_by_what_it_shows():
    """A cell whose characters each show as an escape (U+202E as \\u202e: 6 columns) is cut by its shown width:
    cutting the raw text to 40 characters left 240 columns, and the cut that could not shrink it looped."""
    df = pd.DataFrame({"backend": ["\u202eevil" * 30, "plain"], "case": ["x" * 90, "y"], "n": [1, 2]})
    shown, _, left_out = fit(df, 120)
    assert all(len(line) <= 120 for line in markdown(shown).splitlines()), markdown(shown)
    assert not any("\u202e" in str(v) for v in shown.to_numpy().ravel()) and "n" in [*shown.columns, *left_out]
