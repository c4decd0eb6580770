"""Oracles: decide whether an optimised path is equivalent to the reference, and by how much.

Each returns a Verdict with a margin: how far the result is from failing, in the oracle's own unit,
positive when it passes and negative when it fails. Every oracle has tests that plant a realistic bug
and see it caught (tests/test_*_planted.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from testbed.verdicts import FAIL, NOT_JUDGED, PASS, UNJUDGED

NMSE_THRESHOLD = 1e-7  # test-backend-ops' default max_nmse_err, for float32


@dataclass
class Verdict:
    oracle: str
    passed: bool
    margin: float | None
    metrics: dict[str, Any] = field(default_factory=dict)
    detail: str = ""
    # "not supported" or "not judged" (testbed.verdicts) where the oracle could not compare: never a pass
    unjudged: str | None = None

    def __post_init__(self):
        if self.unjudged is not None and (self.unjudged not in UNJUDGED or self.passed):
            raise ValueError(f"a verdict {self.unjudged!r} is one of {UNJUDGED} and never passed")

    @property
    def verdict(self) -> str:
        return self.unjudged or (PASS if self.passed else FAIL)

    @classmethod
    def not_judged(cls, oracle: str, why: str, metrics: dict[str, Any] | None = None,
                   state: str = NOT_JUDGED) -> "Verdict":
        """An oracle that had nothing to compare (or, state="not supported", was refused): `why` says so."""
        return cls(oracle, False, None, dict(metrics or {}), why, state)


def nmse(ref: np.ndarray, out: np.ndarray) -> float:
    """Normalised mean squared error, sum((ref - out)^2) / sum(ref^2), in float64 (test-backend-ops).
    Both sides are first divided by their largest magnitude (the ratio does not change), so sums of
    squares of large values (1e200) do not overflow to inf / inf = NaN, nor tiny ones underflow to 0."""
    ref = np.asarray(ref, np.float64)
    out = np.asarray(out, np.float64)
    if ref.shape != out.shape:
        raise ValueError(f"shape mismatch: reference {ref.shape} vs output {out.shape}")
    scale = float(max(np.max(np.abs(ref), initial=0.0), np.max(np.abs(out), initial=0.0)))
    if scale == 0.0:
        return 0.0
    if not np.isfinite(scale):
        return float("nan")
    ref, out = ref / scale, out / scale
    num = float(np.sum((ref - out) ** 2))
    den = float(np.sum(ref**2))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def check_nmse(ref: dict[str, np.ndarray], out: dict[str, np.ndarray], threshold: float = NMSE_THRESHOLD) -> Verdict:
    """NMSE of every named output against the reference, each <= threshold; NaN or inf on either side
    fails. (A NaN in the reference makes the NMSE NaN, which max() and <= let through as a pass.)

    Margin: log10(threshold / worst NMSE), the orders of magnitude of headroom (capped at 30 for an
    exact match); None where the NMSE is not finite (NaN or inf on either side: no headroom to state)."""
    metrics: dict[str, Any] = {}
    worst = 0.0
    problems = []
    for name, r in ref.items():
        o = out[name]
        bad = {side: int(np.sum(~np.isfinite(a))) for side, a in (("output", o), ("reference", r))}
        if any(bad.values()):
            problems.append(f"{name}: " + ", ".join(f"the {side} has {n} NaN/inf values"
                                                    for side, n in bad.items() if n))
            metrics[f"nmse_{name}"] = float("inf")
            worst = float("inf")
            continue
        e = nmse(r, o)
        metrics[f"nmse_{name}"] = e
        if not e <= float("inf"):  # NaN: never let max() and <= read it as a pass
            problems.append(f"{name}: the NMSE is not a number")
            worst = float("inf")
            continue
        worst = max(worst, e)
    metrics["nmse"] = worst
    passed = not problems and worst <= threshold
    margin = None if not np.isfinite(worst) else 30.0 if worst == 0.0 else min(float(np.log10(threshold / worst)), 30.0)
    if not passed and not problems:
        problems.append(f"NMSE {worst:.3g} > {threshold:g}")
    return Verdict("nmse", passed, margin, metrics, "; ".join(problems))


def head_biased_mask(mask: np.ndarray, query_positions, key_positions) -> np.ndarray:
    """An additive mask [1, heads, Q, K] with each head's attended entries biased by ALiBi's per-head
    slope times the distance from the query's position back to the key's. A real mask is the same for
    every head, so a kernel or graph that reads every head's rows from one head (a wrong or missing
    head stride) passes with it; with this one no two heads agree and it fails. Masked entries stay
    masked; the bias depends on positions, not columns, so any cache layout gets the same one."""
    heads = mask.shape[1]
    slopes = 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)
    distance = np.maximum(np.asarray(query_positions)[:, None] - np.asarray(key_positions)[None, :], 0)
    return np.where(mask == 0, -slopes[None, :, None, None] * distance, mask).astype(np.float32)


def digest(*arrays: np.ndarray) -> str:
    """sha256 over the raw bytes (and shapes and dtypes) of arrays: what byte-identical means."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def check_bitexact(ref: dict[str, np.ndarray], out: dict[str, np.ndarray]) -> Verdict:
    """Byte equality of every named output (memcmp, not ==: -0.0 vs 0.0 and NaN payloads count).

    Margin: 0 when identical, else minus the number of differing elements."""
    metrics: dict[str, Any] = {}
    differing = 0
    problems = []
    for name, r in ref.items():
        o = out[name]
        r_b, o_b = np.ascontiguousarray(r), np.ascontiguousarray(o)
        if r_b.dtype != o_b.dtype or r_b.shape != o_b.shape:
            problems.append(f"{name}: {o_b.dtype}{o_b.shape} vs reference {r_b.dtype}{r_b.shape}")
            differing += max(r_b.size, 1)
            continue
        if r_b.size == 0:  # nothing to compare (a zero-width array); shapes already agree
            metrics[f"differing_{name}"] = 0
            continue
        bad = r_b.view(np.uint8).reshape(r_b.size, -1) != o_b.view(np.uint8).reshape(o_b.size, -1)
        n = int(np.any(bad, axis=1).sum())
        metrics[f"differing_{name}"] = n
        metrics[f"sha256_{name}"] = digest(o_b)
        if n:
            first = int(np.argmax(np.any(bad, axis=1)))
            problems.append(f"{name}: {n} elements differ, first at flat index {first}")
            differing += n
    return Verdict("bitexact", differing == 0, float(-differing), metrics, "; ".join(problems))
