"""The token-at-position oracle for chunk prefill with past (seed 000).

A case is (P cached positions, an utterance of n tokens, chunk size C). The candidate path runs on
the backend's device (`backend.utterance`, testbed.backends): the cache of positions 0..P-1 from
prefill_at, then the n tokens in ceil(n/C) prefill_with_past calls (the last one zero-padded to C; pad
rows are dropped from the cache between calls), selecting the last real row. It must agree, here on
the host, with

- redecode (refimpl, the ground truth) at position P+n-1: same argmax, and logits within logit_atol;
- the token-by-token path: n decode_with_past calls from the same P-position cache;
- a pinned expected token, if the config gives one (the seed's real model gives 48);
- the cache: the returned K/V rows of real tokens equal prefill_at's K/V for positions 0..P+n-1
  (K/V rows are position-independent once written), and each pad row equals its token run alone at
  its table position (the contract: a pad row attends only itself). Each call's K/V must have P+C
  rows (the contract's result shape).

- an engine under test, where the last call is partial: the chunk path again with that call padded to C and
  its pads dropped (tail.mode=padded): its token and logits as the chunk path's, its cache the P+n real
  rows and not one pad row more (an engine that refuses it is said so beside the verdicts: tail_padded);

- the model written out a second time in float64 (refimpl.naive_gemma), which shares no code with
  refimpl.gemma: redecode and the candidate may share a bug of refimpl.gemma's building blocks (a
  norm, RoPE, the attention), the naive model does not. Both paths' logits within logit_atol of it,
  and their token one the naive model accepts.

Four verdicts per case: "token" (margin: the candidate's logit for the reference token minus its
best other logit, so negative when the argmax differs), "logits", "cache" and "naive" (margin: log10
of tolerance over the worst difference, null where a difference is not finite). Beside them: the
reference's own top-1 minus top-2 margin, and, where the checkpoint has a tokenizer, each token as
text (token_text beside token_ref).

Masks per head (check_mask_heads, for a backend that runs the host's masks): the real masks are the
same for every head, so a graph reading every head's mask from one head would pass every verdict
above. The case's utterance with masks that differ per head (testbed.oracles.numerical.head_biased_mask) must
give refimpl.gemma's logits for the same masks, within logit_atol.

A tie: where the reference's top logits are closer than logit_atol, a backend within tolerance may
rank them either way (a correct reduced-precision backend does). The position is recorded as a tie
(metrics tie, tied_tokens) and any tied token is accepted; the margin is then how far each path is
from choosing a token outside the tie.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from refimpl import gemma, naive_gemma
from testbed.backends import ContractBroken, GemmaRunner, TokenCase
from testbed.backends.refimpl import gemma as refimpl_backend
from testbed.oracles.numerical import Verdict, head_biased_mask, nmse

InputsBuilder = Callable[..., gemma.ChunkInputs]
# the name of an engine's padded chunk path in the verdicts (engine contract v1's tail.mode=padded)
PADDED = "chunk (tail padded)"


def top2_margin(logits: np.ndarray) -> float:
    """Top-1 minus top-2 logit: how far the argmax is from flipping."""
    a, b = np.partition(logits.astype(np.float64), -2)[-2:][::-1]
    return float(max(a, b) - min(a, b))


def margin_for(logits: np.ndarray, tokens: list[int]) -> float:
    """The best logit of `tokens` minus the best other logit: positive iff the argmax is one of them."""
    logits = logits.astype(np.float64)
    return float(logits[tokens].max() - np.delete(logits, tokens).max())


def tied_tokens(reference: np.ndarray, atol: float) -> list[int]:
    """The tokens whose reference logit is within atol of the best: the argmax, and any tied with it."""
    reference = reference.astype(np.float64)
    return sorted(int(t) for t in np.flatnonzero(reference >= reference.max() - atol))


def not_finite(what: str, logits: np.ndarray) -> str | None:
    """Why `logits` cannot be judged (NaN or inf among them), or None."""
    logits = np.asarray(logits, np.float64)
    nan, inf = int(np.isnan(logits).sum()), int(np.isinf(logits).sum())
    if not nan and not inf:
        return None
    return f"{what} hold {nan} NaN and {inf} inf of {logits.size} values: no token can be judged"


def closeness(name: str, diff: float, atol: float, detail: str) -> Verdict:
    passed = bool(np.isfinite(diff) and diff <= atol)
    margin = 30.0 if diff == 0 else (None if not np.isfinite(diff) else min(30.0, math.log10(atol / diff)))
    return Verdict(name, passed, margin, {f"max_abs_{name}_diff": diff, f"{name}_atol": atol},
                   "" if passed else detail)


class Reference:
    """refimpl's answers for one prompt, computed once and shared by every case of a run."""

    def __init__(self, w: dict, cfg: gemma.GemmaConfig, prompt: np.ndarray):
        self.w, self.cfg, self.prompt = w, cfg, np.asarray(prompt)
        self._logits: dict[int, np.ndarray] = {}
        self._rows: dict[int, np.ndarray] = {}  # logits_at's
        self._naive: dict[int, np.ndarray] = {}
        self._kv: tuple[list, list] | None = None

    def logits(self, position: int) -> np.ndarray:
        if position not in self._logits:
            self._logits[position] = gemma.redecode(self.w, self.cfg, self.prompt, position)
        return self._logits[position]

    def logits_at(self, positions) -> np.ndarray:
        """redecode's logits at several positions [len(positions), vocab] from one run of the prompt
        (refimpl.gemma.redecode_at): what localising a failure compares many rows with."""
        missing = sorted({int(p) for p in positions} - set(self._rows))
        if missing:
            self._rows.update(zip(missing, gemma.redecode_at(self.w, self.cfg, self.prompt, missing)))
        return np.stack([self._rows[int(p)] for p in positions])

    def naive_logits(self, position: int) -> np.ndarray:
        """The float64 logits of refimpl.naive_gemma at `position`: the reference independent of refimpl.gemma."""
        if position not in self._naive:
            self._naive[position] = naive_gemma.logits(self.w, self.cfg, self.prompt, position)
        return self._naive[position]

    def kv(self, rows: int) -> tuple[list, list]:
        """K/V of positions 0..rows-1 (a row depends only on tokens up to it, so one prefill serves all)."""
        if self._kv is None or self._kv[0][0].shape[1] < rows:
            _, k, v = gemma.prefill_at(self.w, self.cfg, self.prompt[: max(rows, 1)], 0)
            self._kv = (k, v)
        return [k[:, :rows] for k in self._kv[0]], [v[:, :rows] for v in self._kv[1]]

    def pad_row(self, token: int, position: int) -> tuple[list, list]:
        """K/V of one token alone at `position`: what a pad row must hold."""
        empty_k, empty_v = gemma.empty_cache(self.cfg)
        _, k, v = gemma.decode_with_past(self.w, self.cfg, token, position, empty_k, empty_v)
        return k, v


def check_token_at_position(backend: GemmaRunner, ref: Reference, case: TokenCase, *, expected: int | None = None,
                            logit_atol: float = 1e-3, cache_atol: float = 1e-3,
                            build: InputsBuilder = gemma.chunk_inputs,
                            token_text: Callable[[int], str] | None = None) -> list[Verdict]:
    prompt = ref.prompt
    if case.position >= prompt.size:
        raise ValueError(f"case {case.name} reaches position {case.position} of a {prompt.size}-token prompt")
    reference = ref.logits(case.position)
    broken = not_finite(f"redecode's logits at position {case.position} (the reference)", reference)
    if broken:  # nothing to compare with: every verdict fails, saying so
        info = {"position": case.position, "calls": case.calls, "expected": expected}
        return [Verdict(name, False, None, info, broken) for name in ("token", "logits", "cache", "naive")]
    ref_token = int(np.argmax(reference))
    info = {"position": case.position, "calls": case.calls, "token_ref": ref_token,
            "margin_ref": top2_margin(reference), "expected": expected}
    if token_text:
        info["token_text"] = token_text(ref_token)

    def named(token: int) -> str:
        return f"{token} ({token_text(token)!r})" if token_text else str(token)

    try:
        run = backend.utterance(prompt, case, build)
    except ContractBroken as e:
        return [Verdict(name, False, None, info, str(e)) for name in ("token", "logits", "cache", "naive")]
    chunk_logits, decode_logits, ks, vs, last = run.chunk_logits, run.decode_logits, run.k, run.v, run.last
    # an engine's chunk path again with its partial last call padded, its pads dropped: judged as the chunk path
    padded = run.padded if run.padded is not None and not run.padded.refused else None
    if run.padded is not None:
        info["tail_padded"] = f"not supported: {run.padded.refused}" if run.padded.refused else "judged"
    paths = {"chunk": chunk_logits, "decode": decode_logits, **({PADDED: padded.logits} if padded else {})}

    # token: chunk == redecode == token-by-token (== pinned), any of them where the reference ties
    accepted = tied_tokens(reference, logit_atol)
    said = f"redecode {named(ref_token)}" if len(accepted) == 1 else f"redecode ties {accepted} within {logit_atol:g}"
    tokens = {path: int(np.argmax(logits)) for path, logits in paths.items()}
    unusable = [why for path, logits in paths.items() if (why := not_finite(f"the {path} path's logits", logits))]
    problems = unusable or [f"{path} gives token {named(t)}, {said}" for path, t in tokens.items() if t not in accepted]
    margin = None if unusable else min(margin_for(logits, accepted) for logits in paths.values())
    if expected is not None and expected not in accepted:
        problems.append(f"{said}, the config pins {named(expected)}")
        margin = None if margin is None else min(margin, margin_for(reference, [expected]))
    chunk_text = {"token_chunk_text": token_text(tokens["chunk"])} if token_text else {}
    token = Verdict("token", not problems, margin,
                    {**info, "token_chunk": tokens["chunk"], "token_decode": tokens["decode"], **chunk_text,
                     "margin_chunk": top2_margin(chunk_logits), "tie": len(accepted) > 1,
                     "tied_tokens": accepted}, "; ".join(problems))

    # logits: every path within tolerance of redecode
    diff = max(float(np.abs(logits - reference).max()) for logits in paths.values())
    logits = closeness("logits", diff, logit_atol, f"max |logit - redecode| {diff:.3g} > {logit_atol:g}")
    logits.metrics.update(info)

    # cache: real rows as prefill_at's, pad rows as their token alone; an engine under test that exposes
    # no cache (engine contract v1: cache/ is optional) leaves this verdict unjudged ("not supported")
    if ks is None:
        cache = Verdict("cache", False, None, {**info, "cache_exposed": False},
                        "the engine exposes no K/V (no response/cache/): the cache is not judged")
        return [token, logits, cache, *_naive(ref, case, info, chunk_logits, decode_logits, tokens, unusable,
                                               logit_atol, named)]
    want_k, want_v = ref.kv(case.past + case.tokens)
    real = max(float(np.abs(a - b).max()) for a, b in zip(ks + vs, want_k + want_v))
    kept_pads = 0  # rows the padded path's cache holds past P + n: pad rows it failed to drop
    if padded is not None and padded.k is not None:
        kept_pads = padded.k[0].shape[1] - (case.past + case.tokens)
        if kept_pads >= 0:
            real = max(real, *(float(np.abs(a[:, :a.shape[1] - kept_pads] - b).max())
                               for a, b in zip(padded.k + padded.v, want_k + want_v)))
    pad = 0.0
    # every pad row the backend returned (an engine under test may have removed its pads: none to judge)
    for row in range(last.n, min(case.chunk, last.n + (run.pad_k[0].shape[1] if run.pad_k else 0))):
        pk, pv = ref.pad_row(int(last.tokens[row]), int(last.table_positions[row]))
        col = row - last.n
        pad = max(pad, max(float(np.abs(a[:, col:col + 1] - b).max()) for a, b in zip(run.pad_k + run.pad_v, pk + pv)))
    cache = closeness("cache", max(real, pad), cache_atol,
                      f"cache differs from prefill_at by {real:.3g} on real rows, {pad:.3g} on pad rows "
                      f"(tolerance {cache_atol:g})")
    if kept_pads:
        cache = Verdict("cache", False, None, cache.metrics,
                        f"with tail.mode=padded the cache holds {padded.k[0].shape[1]} rows after the utterance, "
                        f"P + n = {case.past + case.tokens}: "
                        f"{f'{kept_pads} pad row(s) kept' if kept_pads > 0 else f'{-kept_pads} real row(s) dropped'}; "
                        f"the contract drops exactly the C - n_last = {case.calls * case.chunk - case.tokens} pads"
                        + (f"; {cache.detail}" if cache.detail else ""))
    kv_nmse = nmse(np.concatenate([a.ravel() for a in want_k + want_v]), np.concatenate([a.ravel() for a in ks + vs]))
    cache.metrics.update({**info, "max_abs_real_rows_diff": real, "max_abs_pad_rows_diff": pad, "nmse_kv": kv_nmse,
                          **({"padded_rows_past_real": kept_pads} if padded is not None and padded.k else {})})
    return [token, logits, cache, *_naive(ref, case, info, chunk_logits, decode_logits, tokens, unusable, logit_atol,
                                          named)]


def _naive(ref, case, info, chunk_logits, decode_logits, tokens, unusable, logit_atol, named) -> list[Verdict]:
    """naive: both paths against the float64 model written out independently of refimpl.gemma."""
    naive_logits = ref.naive_logits(case.position)
    broken = not_finite(f"the naive float64 model's logits at position {case.position}", naive_logits)
    if broken:
        return [Verdict("naive", False, None, {**info, "naive_reference": "refimpl.naive_gemma"}, broken)]
    naive_accepted = tied_tokens(naive_logits, logit_atol)
    naive_said = (f"the naive float64 model {named(naive_accepted[0])}" if len(naive_accepted) == 1
                  else f"the naive float64 model ties {naive_accepted}")
    naive_diff = max(float(np.abs(path - naive_logits).max()) for path in (chunk_logits, decode_logits))
    naive = closeness("naive", naive_diff, logit_atol,
                      f"max |logit - naive float64 model| {naive_diff:.3g} > {logit_atol:g}")
    naive.metrics.update({**info, "token_naive": int(np.argmax(naive_logits)), "naive_reference": "refimpl.naive_gemma"})
    off = [f"{path} gives token {named(t)}, {naive_said}" for path, t in tokens.items() if t not in naive_accepted]
    if off and not unusable:  # the margin is then the token's: how far each path is from a token the naive model accepts
        margin = min(margin_for(chunk_logits, naive_accepted), margin_for(decode_logits, naive_accepted))
        naive = Verdict("naive", False, margin, naive.metrics, "; ".join(off + [naive.detail] * bool(naive.detail)))
    return [naive]


def head_biased_inputs(cfg: gemma.GemmaConfig, tokens, past_len: int, chunk: int, past_positions=None,
                       **kw) -> gemma.ChunkInputs:
    """gemma.chunk_inputs with every mask biased per head by position (testbed.oracles.numerical.head_biased_mask)."""
    inp = gemma.chunk_inputs(cfg, tokens, past_len, chunk, past_positions, **kw)
    past = np.arange(past_len) if past_positions is None else np.asarray(past_positions)
    keys = np.concatenate([past, inp.positions])
    inp.masks = {t: head_biased_mask(m, inp.positions, keys) for t, m in inp.masks.items()}
    return inp


def check_mask_heads(backend: GemmaRunner, ref: Reference, case: TokenCase, logit_atol: float = 1e-3) -> Verdict:
    """The case's utterance with masks that differ per head (head_biased_inputs), on the backend and on
    refimpl.gemma: the chunk path's and the token-by-token path's logits within logit_atol. Margin:
    log10 of tolerance over the worst difference, null where it is not finite."""
    want = refimpl_backend.backend(ref.w, ref.cfg).utterance(ref.prompt, case, head_biased_inputs)
    got = backend.utterance(ref.prompt, case, head_biased_inputs)
    diff = max(float(np.abs(np.asarray(got.chunk_logits, np.float64) - want.chunk_logits).max()),
               float(np.abs(np.asarray(got.decode_logits, np.float64) - want.decode_logits).max()))
    verdict = closeness("mask_heads", diff, logit_atol,
                        f"with masks that differ per head the logits differ from refimpl.gemma's by {diff:.3g} "
                        f"(tolerance {logit_atol:g}): a head reads another head's mask")
    verdict.metrics["position"] = case.position
    return verdict
