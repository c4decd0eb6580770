"""What a command said on stderr, apart from its progress lines.

Off a terminal, `run` and `sweep` print one progress line per step ("[12 s] gdn oracle 3/12 ...",
testbed.cli.ProgressLine). A test of how a failure is said (one line, no traceback) reads the rest.
"""

from __future__ import annotations

import itertools
import re

PROGRESS = re.compile(r"^\[\d+ s\] ")


def said(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not PROGRESS.match(line)]


def table_rows(stdout: str) -> list[str]:
    """The data rows of the first Markdown table a command printed. On the terminal a table that would
    not fit 120 columns says the settings common to every row once, above it (testbed.report.tables.fit),
    so a row is found by its place, not by the columns it starts with."""
    lines = stdout.splitlines()
    ruled = next(i for i, line in enumerate(lines) if line.startswith("| -"))
    return list(itertools.takewhile(lambda line: line.startswith("| "), lines[ruled + 1:]))
