"""Oracles for the hybrid model (refimpl.qwen35): chunk prefill with past and the padded tail over
GDN recurrent state, conv state and KV cache.

chunk with past  P positions prefilled in chunks, then n <= C tokens in one prefill_with_past call
                 padded to C rows, selecting the last real row. Against redecode of the P + n tokens
                 (all positions from scratch, serial GDN):
                   token  same argmax at position P + n - 1 (margin: the candidate's logit for the
                          reference token minus its best other logit, so negative when it differs)
                   state  every carried array (K/V rows, conv states, recurrent states) by NMSE
                 and against the model written out in float64 (refimpl.naive_qwen35, no code shared
                 with refimpl.qwen35, gemma or gdn, which redecode and the candidate share):
                   naive  the candidate's logits by NMSE, and the same argmax
padded tail      a prompt of N = b * C + t tokens prefilled with the tail padded to C rows, and with
                 the tail run one token at a time (scalar):
                   first_token  same argmax after the prompt (the token generation would start with)
                   tail_state   the states after both by NMSE; `bitexact` says whether every byte agrees
pad identity     the GDN op alone: pad rows with beta = 0 and g = 0 appended to a call must leave
                 the final state bit-identical (exp(0) = 1 and a zero delta are exact in float32).

Every verdict carries the reference's own top-1 minus top-2 logit margin, so a token flip on a near
tie is told apart from a real error. Token verdicts follow the Gemma token oracle's tie rule
(testbed.token_oracle): every token whose reference logit is within `logit_atol` of the reference's
best is accepted, and the verdict says so (metrics tie, tied_tokens). On a real Qwen3.5 prompt the
smallest top-2 gap is 3.9e-5: a correct candidate 3e-4 from the reference may rank such a pair either
way, and passes as a tie; a candidate whose token lies further below the best fails.
"""

from __future__ import annotations

import numpy as np

from refimpl import gdn, naive_qwen35, qwen35
from testbed.oracles import NMSE_THRESHOLD, Verdict, check_bitexact, check_nmse
from testbed.token_oracle import margin_for, tied_tokens, top2_margin

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
                          logit_atol: float = LOGIT_ATOL) -> list[Verdict]:
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
    return [check_token(ref_logits[-1], logits, logit_atol=logit_atol), check_state(ref_state, state, threshold),
            check_naive(naive_qwen35.logits(w, cfg, prompt[:past + n]), logits, threshold, logit_atol)]


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
