"""What a command said on stderr, apart from its progress lines.

Off a terminal, `run` and `sweep` print one progress line per step ("[12 s] gdn oracle 3/12 ...",
testbed.cli.ProgressLine). A test of how a failure is said (one line, no traceback) reads the rest.
"""

from __future__ import annotations

import re

PROGRESS = re.compile(r"^\[\d+ s\] ")


def said(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not PROGRESS.match(line)]
