"""Oracles for the hybrid model (refimpl.qwen35): chunk prefill with past and the padded tail over
GDN recurrent state, conv state and KV cache.

chunk with past  P positions prefilled in chunks, then n <= C tokens in one prefill_with_past call
                 padded to C rows, selecting the last real row. Against redecode of the P + n tokens
                 (all positions from scratch, serial GDN):
                   token  same argmax at position P + n - 1 (margin: the candidate's logit for the
                          reference token minus its best other logit, so negative when it differs);
                          for the engine on a device (check_engine_case) at every chunk boundary, the
                          past's calls included (check_boundaries); model.expected_token pinned at the
                          last position the cases reach
                   state  every carried array (K/V rows, conv states, recurrent states) by NMSE
                 and against the model written out in float64 (refimpl.naive_qwen35, no code shared
                 with refimpl.qwen35, gemma or gdn, which redecode and the candidate share):
                   naive  the candidate's logits by NMSE, and its token by the tie rule
chunk sizes      (an engine under test) one prompt prefilled in calls of C rows for each C:
                   chunk_invariance  the same first token for every C, one redecode accepts
padded tail      a prompt of N = b * C + t tokens prefilled with the tail padded to C rows, and with
                 the tail run one token at a time (scalar):
                   first_token  same argmax after the prompt (the token generation would start with)
                   tail_state   the states after both by NMSE; `bitexact` says whether every byte agrees
                   tail_bytes   (the engine) against the same tail in a call of its own length: every
                                state byte and the logits identical (check_tail_bytes)
pad identity     the GDN op alone: pad rows with beta = 0 and g = 0 appended to a call must leave
                 the final state bit-identical (exp(0) = 1 and a zero delta are exact in float32).

Every verdict carries the reference's own top-1 minus top-2 logit margin, so a token flip on a near
tie is told apart from a real error. Token verdicts follow the Gemma token oracle's tie rule
(testbed.oracles.tokens): every token whose reference logit is within `logit_atol` of the reference's
best is accepted, and the verdict says so (metrics tie, tied_tokens). On a real Qwen3.5 prompt the
smallest top-2 gap is 3.9e-5: a correct candidate 3e-4 from the reference may rank such a pair either
way, and passes as a tie; a candidate whose token lies further below the best fails.
"""

from __future__ import annotations

import numpy as np

from refimpl import gdn, naive_qwen35, qwen35
from testbed.oracles.numerical import NMSE_THRESHOLD, Verdict, check_bitexact, check_nmse, digest
from testbed.oracles.tokens import margin_for, tied_tokens, top2_margin

LOGIT_ATOL = 1e-3  # the Gemma token verdict's default: a tie is a gap below it


def check_token(reference: np.ndarray, candidate: np.ndarray, name: str = "token", logit_atol: float = LOGIT_ATOL,
                said: str = "reference") -> Verdict:
    """The candidate's argmax against the reference's, by the tie rule: any token whose reference logit
    is within logit_atol of the reference's best passes. Margin: the candidate's best accepted logit
    minus its best other logit (negative when its argmax is not accepted)."""
    ref_token, got = int(np.argmax(reference)), int(np.argmax(candidate))
    accepted = tied_tokens(reference, logit_atol)
    margin = margin_for(candidate, accepted)
    tie = len(accepted) > 1
    metrics = {"token_ref": ref_token, "token": got, "margin_ref": top2_margin(reference), "tie": tie,
               "tied_tokens": accepted, "logit_atol": logit_atol}
    if got not in accepted:
        ties = f" (ties {accepted} within {logit_atol:g})" if tie else ""
        detail = f"token {got}, {said} {ref_token}{ties}"
    else:
        detail = f"a tie within {logit_atol:g}: {said} {ref_token}, token {got}, both accepted" if tie and got != ref_token \
            else ""
    return Verdict(name, got in accepted, margin, metrics, detail)


def check_state(reference: qwen35.HybridState, candidate: qwen35.HybridState, threshold: float = NMSE_THRESHOLD,
                name: str = "state") -> Verdict:
    """NMSE of every carried array, and the positions consumed; `bitexact` in the metrics."""
    if candidate.length != reference.length:
        return Verdict(name, False, float("-inf"), {"length": candidate.length, "length_ref": reference.length},
                       f"state after {candidate.length} positions, reference after {reference.length}")
    ref, got = reference.arrays(), candidate.arrays()
    shapes = [k for k in ref if ref[k].shape != got[k].shape]
    if shapes:
        return Verdict(name, False, float("-inf"), {}, f"{shapes[0]} has shape {got[shapes[0]].shape}, "
                                                         f"reference {ref[shapes[0]].shape}")
    v = check_nmse(ref, got, threshold)
    worst = max(ref, key=lambda k: v.metrics[f"nmse_{k}"])
    metrics = {"nmse": v.metrics["nmse"], "worst_array": worst, "bitexact": check_bitexact(ref, got).passed}
    return Verdict(name, v.passed, v.margin, metrics, v.detail and f"{worst}: {v.detail}")


def check_chunk_with_past(w: dict, cfg: qwen35.HybridConfig, prompt, past: int, n: int, chunk: int,
                          gdn_fn: qwen35.GDNFn, threshold: float = NMSE_THRESHOLD,
                          logit_atol: float = LOGIT_ATOL, expected: int | None = None) -> list[Verdict]:
    if not 1 <= n <= chunk:
        raise ValueError(f"n={n} tokens do not fit one chunk of {chunk}; accepted: 1..{chunk}")
    prompt = np.asarray(prompt)
    if past + n > prompt.size:
        raise ValueError(f"P={past} + n={n} exceeds the {prompt.size}-token prompt")
    ref_logits, ref_state = qwen35.redecode(w, cfg, prompt[:past + n])
    state = qwen35.prefill(w, cfg, prompt[:past], chunk, gdn_fn)[1] if past else qwen35.empty_state(cfg)
    tokens = np.zeros(chunk, np.int64)
    tokens[:n] = prompt[past:past + n]
    logits, state = qwen35.prefill_with_past(w, cfg, tokens, state, gdn_fn, n=n)
    token = check_token(ref_logits[-1], logits, logit_atol=logit_atol)
    if expected is not None:
        token = pin_expected(token, ref_logits[-1], expected)
    return [token, check_state(ref_state, state, threshold),
            check_naive(naive_qwen35.logits(w, cfg, prompt[:past + n]), logits, threshold, logit_atol)]


def pin_expected(token: Verdict, reference: np.ndarray, expected: int) -> Verdict:
    """A token verdict with the config's pinned token (model.expected_token), which must be among the
    reference's accepted ones (the tie rule); the margin then also how far the reference is from it."""
    tied = token.metrics["tied_tokens"]
    metrics = {**token.metrics, "expected": expected}
    if expected in tied:
        return Verdict(token.oracle, token.passed, token.margin, metrics, token.detail)
    said = f"reference {tied[0]}" if len(tied) == 1 else f"reference ties {tied}"
    detail = "; ".join(d for d in (token.detail, f"{said}, the config pins {expected}") if d)
    return Verdict(token.oracle, False, min(token.margin, margin_for(reference, [expected])), metrics, detail)


def check_naive(naive_logits: np.ndarray, candidate: np.ndarray, threshold: float = NMSE_THRESHOLD,
                logit_atol: float = LOGIT_ATOL) -> Verdict:
    """The candidate's logits against the naive float64 model's: NMSE within threshold, and its token one
    the naive model accepts by the tie rule (never the argmax alone: a near tie may flip). Margin: the
    NMSE's (log10 of threshold over it), at most the token margin where the token is not accepted."""
    v = check_nmse({"logits": naive_logits}, {"logits": candidate}, threshold)
    token = check_token(naive_logits, candidate, logit_atol=logit_atol, said="the naive float64 model")
    problems = [p for p in (v.detail, token.detail if not token.passed else "") if p]
    margin = v.margin if token.passed or v.margin is None else min(v.margin, token.margin)
    return Verdict("naive", v.passed and token.passed, margin,
                   {"nmse": v.metrics["nmse"], "token_naive": token.metrics["token_ref"], "token": token.metrics["token"],
                    "tie": token.metrics["tie"], "tied_tokens": token.metrics["tied_tokens"],
                    "naive_reference": "refimpl.naive_qwen35, float64"},
                   "; ".join(problems) or (token.detail if token.metrics["tie"] else ""))


def check_padded_tail(w: dict, cfg: qwen35.HybridConfig, prompt, chunk: int, gdn_fn: qwen35.GDNFn,
                      threshold: float = NMSE_THRESHOLD, logit_atol: float = LOGIT_ATOL) -> list[Verdict]:
    scalar_logits, scalar_state = qwen35.prefill(w, cfg, prompt, chunk, gdn_fn, tail="scalar")
    padded_logits, padded_state = qwen35.prefill(w, cfg, prompt, chunk, gdn_fn, tail="padded")
    return [check_token(scalar_logits, padded_logits, "first_token", logit_atol, said="the scalar tail's"),
            check_state(scalar_state, padded_state, threshold, "tail_state")]


def check_pad_identity(x: gdn.GDNInputs, pads: int, gdn_fn: qwen35.GDNFn, head_map: str = qwen35.HEAD_MAP) -> Verdict:
    """The op with `pads` rows of beta = g = 0 (and arbitrary q, k, v) appended: same final state, byte
    for byte, as without them."""
    rng = np.random.default_rng(0)

    def padded(a, fill):
        extra = fill(a.shape[:1] + (pads,) + a.shape[2:]).astype(a.dtype)
        return np.concatenate([a, extra], axis=1)

    q, k, v = (padded(a, lambda s: rng.uniform(-1, 1, s)) for a in (x.q, x.k, x.v))
    g, beta = padded(x.g, np.zeros), padded(x.beta, np.zeros)
    _, exact = gdn_fn(x.q, x.k, x.v, x.g, x.beta, x.state, head_map=head_map)
    _, with_pads = gdn_fn(q, k, v, g, beta, x.state, head_map=head_map)
    v = check_bitexact({"state": exact}, {"state": with_pads})
    return Verdict("pad_identity", v.passed, v.margin, v.metrics, v.detail)


# --- the engine on a device (testbed.backends.native.hybrid): every call's logits and the states pulled ---


def check_boundaries(reference: np.ndarray, call_logits: np.ndarray, positions, logit_atol: float = LOGIT_ATOL,
                     expected: int | None = None, token_text=None) -> Verdict:
    """The token at every chunk boundary: each call's selected row (its last real one, at `positions`)
    against the reference's logits at that position [T, vocab], by the tie rule; and, when the config
    pins one, the expected token at the last position among the reference's accepted ones. Margin: the
    least over the calls of the candidate's best accepted logit minus its best other logit."""
    positions = [int(p) for p in positions]
    problems, margins, ties = [], [], []
    for row, pos in zip(call_logits, positions):
        v = check_token(reference[pos], row, logit_atol=logit_atol, said="redecode")
        margins.append(v.margin)
        if v.metrics["tie"]:
            ties.append(pos)
        if not v.passed:
            problems.append(f"position {pos}: {v.detail}")
    last = check_token(reference[positions[-1]], call_logits[-1], logit_atol=logit_atol, said="redecode")
    metrics = {**last.metrics, "position": positions[-1], "calls": len(positions), "boundaries": positions,
               "tie_positions": ties, "expected": expected}
    if token_text:
        metrics |= {"token_text": token_text(last.metrics["token_ref"]), "token_chunk_text": token_text(last.metrics["token"])}
    margin = min(margins)
    if expected is not None and expected not in last.metrics["tied_tokens"]:
        said = (f"redecode {last.metrics['token_ref']}" if not last.metrics["tie"]
                else f"redecode ties {last.metrics['tied_tokens']}")
        problems.append(f"position {positions[-1]}: {said}, the config pins {expected}")
        margin = min(margin, margin_for(reference[positions[-1]], [expected]))
    detail = "; ".join(problems) or (f"ties within {logit_atol:g} at positions {ties}, accepted" if ties else "")
    return Verdict("token", not problems, margin, metrics, detail)


def check_engine_case(w: dict, cfg: qwen35.HybridConfig, prompt, past: int, n: int, run, threshold: float = NMSE_THRESHOLD,
                      logit_atol: float = LOGIT_ATOL, expected: int | None = None, token_text=None,
                      reference: tuple | None = None, naive_logits: np.ndarray | None = None) -> list[Verdict]:
    """A device run (HybridRun: P tokens, then n, in calls of C) against redecode of the P + n tokens:
    the token at every chunk boundary, every carried array by NMSE, and the last call's logits against
    the naive float64 model (NMSE and the tie rule). `reference`: redecode's (logits, state), and
    `naive_logits` the naive model's at the last position, if known."""
    prompt = np.asarray(prompt)
    ref_logits, ref_state = reference or qwen35.redecode(w, cfg, prompt[:past + n])
    if naive_logits is None:
        naive_logits = naive_qwen35.logits(w, cfg, prompt[:past + n])
    return [check_boundaries(ref_logits, run.call_logits, run.call_positions, logit_atol, expected, token_text),
            check_state(ref_state, run.state, threshold),
            check_naive(naive_logits, run.call_logits[-1], threshold, logit_atol)]


def check_tail_bytes(padded, exact) -> Verdict:
    """A tail padded to C rows (pads: beta = g = 0, conv state at the last real row, pad K/V not kept)
    against the same tail in a call of its own length: every byte of every carried state identical,
    and the logits equal. Margin: 0 when identical, else minus the differing elements."""
    v = check_bitexact({**exact.state.arrays(), "logits": exact.call_logits[-1]},
                       {**padded.state.arrays(), "logits": padded.call_logits[-1]})
    differing = {k[len("differing_"):]: n for k, n in v.metrics.items() if k.startswith("differing_") and n}
    metrics = {"bitexact": v.passed, "differing": int(-v.margin), "arrays_differing": sorted(differing),
               "length": padded.state.length, "length_exact": exact.state.length,
               "state_sha256": digest(*(a for _, a in sorted(padded.state.arrays().items())))}
    if padded.state.length != exact.state.length:
        return Verdict("tail_bytes", False, None, metrics, f"the padded run's state is after {padded.state.length} "
                                                           f"positions, the exact run's after {exact.state.length}")
    detail = "" if v.passed else f"the padded tail's state differs from the unpadded one: {v.detail}"
    return Verdict("tail_bytes", v.passed, v.margin, metrics, detail)


def check_engine_tail(padded, exact, scalar, threshold: float = NMSE_THRESHOLD,
                      logit_atol: float = LOGIT_ATOL) -> list[Verdict]:
    """Device runs of one prompt with its tail padded, exact and scalar: first_token and tail_state
    (padded against scalar, as on the host) and tail_bytes (padded against exact, byte for byte)."""
    return [check_token(scalar.call_logits[-1], padded.call_logits[-1], "first_token", logit_atol,
                        said="the scalar tail's"),
            check_state(scalar.state, padded.state, threshold, "tail_state"),
            check_tail_bytes(padded, exact)]


def check_chunk_invariance(reference: np.ndarray, by_chunk: dict[int, np.ndarray],
                           logit_atol: float = LOGIT_ATOL) -> Verdict:
    """The first token after one prompt prefilled in calls of C rows, for each C (the recurrent state
    carried across a different set of call boundaries each time): the same token for every C, and one
    the reference (redecode) accepts by the tie rule. Margin: the least over C of the candidate's best
    accepted logit minus its best other logit."""
    accepted = tied_tokens(reference, logit_atol)
    tokens = {c: int(np.argmax(logits)) for c, logits in by_chunk.items()}
    problems = [f"C={c} gives token {t}, redecode {accepted}" for c, t in tokens.items() if t not in accepted]
    if len(set(tokens.values())) > 1:
        problems.insert(0, f"the first token differs across chunk sizes: {tokens}")
    spread = max(float(np.abs(np.asarray(a, np.float64) - reference).max()) for a in by_chunk.values())
    metrics = {"token_ref": accepted[0], "tied_tokens": accepted, "tokens": {str(c): t for c, t in tokens.items()},
               "chunks": sorted(by_chunk), "max_abs_diff_vs_ref": spread, "margin_ref": top2_margin(reference)}
    margin = min(margin_for(logits, accepted) for logits in by_chunk.values())
    return Verdict("chunk_invariance", not problems, margin, metrics, "; ".join(problems))
