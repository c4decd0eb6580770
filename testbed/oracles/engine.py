"""Oracles on what an engine under test returns through engine contract v1 (testbed.backends.engine):
the sequence's state bytes after a padded tail rolled back, and the first token of each tail mode."""

from __future__ import annotations

import hashlib

import numpy as np

from testbed.oracles.numerical import Verdict
from testbed.oracles.tokens import margin_for, tied_tokens


def check_state_bytes(padded, unpadded) -> Verdict:
    """state.bin of the prompt prefilled with its tail padded and the pad rows removed, against the same
    prompt with the last partial chunk appended unpadded: byte for byte (where they differ, the first
    differing offset), and the next token equal."""
    a, b = padded.state or b"", unpadded.state or b""
    problems = []
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if len(a) != len(b):
        problems.append(f"state.bin holds {len(a)} bytes after the padded tail, {len(b)} after the unpadded one")
    elif first is not None:
        differing = int(np.count_nonzero(np.frombuffer(a, np.uint8) != np.frombuffer(b, np.uint8)))
        problems.append(f"state.bin differs in {differing} bytes, the first at offset {first}")
    tokens = [int(np.argmax(r.logits[0])) for r in (padded, unpadded)]
    if tokens[0] != tokens[1]:
        problems.append(f"the next token differs: {tokens[0]} after the padded tail, {tokens[1]} unpadded")
    metrics = {"bytes": len(a), "sha256": hashlib.sha256(a).hexdigest(), "sha256_expected": hashlib.sha256(b).hexdigest(),
               "token_padded": tokens[0], "token_unpadded": tokens[1]}
    return Verdict("state_bytes", not problems, 0.0 if not problems else -1.0, metrics, "; ".join(problems))


def check_first_token_agrees(reference: np.ndarray, by_mode: dict[str, np.ndarray], atol: float) -> Verdict:
    """Each tail mode's first-token logits against the reference engine's (refimpl on the same caches):
    the token one the reference accepts (ties within atol), the logits within atol."""
    accepted = tied_tokens(reference, atol)
    problems, diffs = [], {}
    for mode, logits in by_mode.items():
        token = int(np.argmax(logits))
        diffs[mode] = float(np.abs(np.asarray(logits, np.float64) - reference).max())
        if token not in accepted:
            problems.append(f"{mode} tail gives token {token}, the reference {accepted}")
        if not diffs[mode] <= atol:
            problems.append(f"{mode} tail's logits differ from the reference by {diffs[mode]:.3g} > {atol:g}")
    margin = min(margin_for(logits, accepted) for logits in by_mode.values())
    metrics = {"token_ref": accepted[0], **{f"max_abs_{m}_diff": d for m, d in diffs.items()},
               **{f"token_{m}": int(np.argmax(x)) for m, x in by_mode.items()}}
    return Verdict("first_token", not problems, margin, metrics, "; ".join(problems))
