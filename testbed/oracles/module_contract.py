"""A user's prefill_with_past module (seed 000's contract) judged on one case, and when it is wrong, which
argument or result it gets wrong.

The module has fixed shapes: C chunk rows against R cache rows. For a case (P <= R cached positions,
n <= C utterance tokens) testbed makes every input itself, from the checkpoint: the past K/V are the
reference's (refimpl's prefill_at over the prompt's first P tokens, the "reference cache"), padded with
R - P empty rows that every mask hides; tokens, RoPE tables, masks and the one-hot select (the last
real row) from refimpl.gemma.chunk_inputs; all in the contract's order (testbed.models.contract). One
call on the device; then, on the host:

  token      the selected row's argmax equals redecode's at position P+n-1 (any tied token; and the
             pinned model.expected_token if set); margin as testbed.oracles.tokens's
  logits     within logit_atol of redecode's
  cache      the returned K/V, per layer [kv_heads, R + C, head_dim]: the R past rows as they were
             passed, the n real rows as prefill_at's K/V of those positions, each pad row as its token
             alone at its table position; within cache_atol
  mask_heads the same call with masks that differ per head (testbed.oracles.numerical.head_biased_mask)
             against refimpl.gemma.prefill_with_past on those inputs: a module that reads one head's
             mask for every head passes the three above and fails here. Its detail says a head reads
             another head's mask only where refimpl, given head h's mask for every head, agrees with
             the module; a module wrong whatever the masks (a RoPE, window or cache fault) fails here
             too, and is said to (the verdicts above failed), with where its outputs first differ

Diagnosis. Where a verdict fails, the outputs are explained, if they can be, by one contract fault
that the detail then names by argument or result (index and name):
  - the past rows of each K/V result are the K/V argument passed through; where a result holds
    another argument's rows, either the results come back in another order (the outputs reordered
    agree with the reference) or the module reads the arguments in another order (refimpl given them
    in that order agrees with the module);
  - select read one row off (refimpl's logits of the row before or after agree);
  - a layer type attending with another type's mask, or rotating with another type's tables, or with
    cos and sin exchanged (refimpl given those inputs agrees with the module).
Each is a counterfactual computed by refimpl on the host: no second device call; a cause is named only
where its counterfactual matched the module's outputs. Otherwise the detail says no single fault explains
it and where the outputs first differ: the first K/V row (a cache row, or the chunk's row and its
position), at it the first layer's result and KV head, the module's value and the reference's; or the
logits where every K/V result agrees.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from refimpl import gemma
from testbed.backends import TokenCase
from testbed.models.contract import Contract, pack_prefill_with_past
from testbed.oracles.numerical import Verdict, nmse
from testbed.oracles.tokens import (Reference, closeness, head_biased_inputs, margin_for, not_finite, tied_tokens,
                                    top2_margin)
from testbed.oracles.where import first_kv_difference

ModuleCall = Callable[[Sequence[np.ndarray]], list]


def case_inputs(ref: Reference, case: TokenCase, rows: int, build=gemma.chunk_inputs):
    """(chunk inputs, past K, past V) for a module of `rows` cache rows: the reference's cache of the
    first P positions, then rows - P empty rows."""
    cfg, P, n = ref.cfg, case.past, case.tokens
    ref.kv(P + n)  # one prefill_at serves the past and the rows the call must return
    k, v = ref.kv(P)
    empty = np.zeros((cfg.kv_heads, rows - P, cfg.head_dim), np.float32)
    ks = [np.concatenate([a, empty], axis=1).astype(np.float32) for a in k]
    vs = [np.concatenate([a, empty], axis=1).astype(np.float32) for a in v]
    positions = np.concatenate([np.arange(P), np.full(rows - P, -1)])
    inp = build(cfg, ref.prompt[P:P + n], rows, case.chunk, past_positions=positions, start=P)
    return inp, ks, vs


def expected_kv(ref: Reference, case: TokenCase, inp: gemma.ChunkInputs, ks, vs) -> tuple[list, list]:
    """What each K/V result must hold: the past as passed, then prefill_at's rows, then the pad rows."""
    P, n = case.past, case.tokens
    real_k, real_v = ref.kv(P + n)
    pads = [ref.pad_row(int(inp.tokens[r]), int(inp.table_positions[r])) for r in range(n, case.chunk)]
    out_k, out_v = [], []
    for i in range(ref.cfg.layers):
        out_k.append(np.concatenate([ks[i], real_k[i][:, P:], *[p[0][i] for p in pads]], axis=1))
        out_v.append(np.concatenate([vs[i], real_v[i][:, P:], *[p[1][i] for p in pads]], axis=1))
    return out_k, out_v


def _max_diff(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    return max(float(np.abs(np.asarray(x, np.float64) - y).max()) for x, y in zip(a, b))


def check_results_shape(contract: Contract, outputs: list) -> str | None:
    if len(outputs) != len(contract.results):
        return f"the module returned {len(outputs)} results, the contract has {len(contract.results)}"
    for i, (spec, a) in enumerate(zip(contract.results, outputs)):
        a = np.asarray(a)
        if tuple(a.shape) != spec.shape or a.dtype != np.dtype(spec.dtype):
            return (f"result {i} ({spec.name}) is {a.dtype}{list(a.shape)}, the contract says "
                    f"{spec.dtype}{list(spec.shape)}")
    return None


def check_module(call: ModuleCall, ref: Reference, case: TokenCase, rows: int, contract: Contract, *,
                 expected: int | None = None, logit_atol: float = 1e-3, cache_atol: float = 1e-3,
                 token_text: Callable[[int], str] | None = None) -> list[Verdict]:
    """Verdicts token, logits, cache, mask_heads for one case (see the module docstring)."""
    cfg = ref.cfg
    inp, ks, vs = case_inputs(ref, case, rows)
    args = pack_prefill_with_past(cfg, inp, ks, vs)
    outputs = call(args)
    reference = ref.logits(case.position)
    ref_token = int(np.argmax(reference))
    info = {"position": case.position, "calls": 1, "token_ref": ref_token, "margin_ref": top2_margin(reference),
            "expected": expected, "select_row": int(np.argmax(inp.select)), "module_rows": rows}
    if token_text:
        info["token_text"] = token_text(ref_token)
    names = ("token", "logits", "cache", "mask_heads")
    broken = check_results_shape(contract, outputs)
    if broken:
        return [Verdict(name, False, None, info, broken) for name in names]
    logits, out_k, out_v = np.asarray(outputs[0]), list(outputs[1::2]), list(outputs[2::2])

    def named(token: int) -> str:
        return f"{token} ({token_text(token)!r})" if token_text else str(token)

    # token
    accepted = tied_tokens(reference, logit_atol)
    said = f"redecode {named(ref_token)}" if len(accepted) == 1 else f"redecode ties {accepted} within {logit_atol:g}"
    unusable = not_finite("the module's logits", logits)
    token = int(np.argmax(logits))
    problems = [unusable] if unusable else ([] if token in accepted else
                                            [f"the module gives token {named(token)} at position {case.position}, {said}"])
    margin = None if unusable else margin_for(logits, accepted)
    if expected is not None and expected not in accepted:
        problems.append(f"{said}, the config pins {named(expected)}")
        margin = None if margin is None else min(margin, margin_for(reference, [expected]))
    verdicts = [Verdict("token", not problems, margin, {**info, "token_chunk": token, "tie": len(accepted) > 1,
                                                        "tied_tokens": accepted, "margin_chunk": top2_margin(logits)},
                        "; ".join(problems))]
    # logits
    diff = float(np.abs(np.asarray(logits, np.float64) - reference).max())
    verdicts.append(closeness("logits", diff, logit_atol, f"max |logit - redecode| {diff:.3g} > {logit_atol:g}"))
    # cache
    want_k, want_v = expected_kv(ref, case, inp, ks, vs)
    kv_diff = _max_diff(out_k + out_v, want_k + want_v)
    cache = closeness("cache", kv_diff, cache_atol, f"the returned K/V differ from the reference's by {kv_diff:.3g} "
                                                    f"(tolerance {cache_atol:g})")
    cache.metrics["nmse_kv"] = nmse(np.concatenate([a.ravel() for a in want_k + want_v]),
                                    np.concatenate([np.asarray(a, np.float64).ravel() for a in out_k + out_v]))
    verdicts.append(cache)
    for v in verdicts[1:]:
        v.metrics.update(info)
    if not all(v.passed for v in verdicts):
        diagnosis = diagnose(ref, inp, ks, vs, outputs, contract, want_k, want_v, reference, logit_atol, cache_atol)
        for v in verdicts:
            v.metrics["diagnosis"] = diagnosis
            if not v.passed:
                v.detail = f"{v.detail}; {diagnosis}"
    failed = [v.oracle for v in verdicts if not v.passed]
    verdicts.append(check_mask_heads(call, ref, case, rows, logit_atol, cache_atol, contract, failed))
    return verdicts


def check_mask_heads(call: ModuleCall, ref: Reference, case: TokenCase, rows: int, logit_atol: float,
                     cache_atol: float, contract: Contract, failed_plain: Sequence[str] = ()) -> Verdict:
    """The same call with masks that differ per head, against refimpl on the same inputs. Where it fails,
    the detail names a head reading another head's mask only where refimpl, given every head head h's
    mask, agrees with the module; `failed_plain`: the verdicts the call with the contract's own masks
    failed (then the module is wrong whatever the masks, and their diagnosis says how)."""
    inp, ks, vs = case_inputs(ref, case, rows, build=head_biased_inputs)
    out = call(pack_prefill_with_past(ref.cfg, inp, ks, vs))
    logits, want_k, want_v = gemma.prefill_with_past(ref.w, ref.cfg, inp.tokens, inp.tables, ks, vs, inp.masks,
                                                     inp.select)
    logit_diff = float(np.abs(np.asarray(out[0], np.float64) - logits).max())
    kv_diff = _max_diff(out[1::2] + out[2::2], want_k + want_v)
    passed = logit_diff <= logit_atol and kv_diff <= cache_atol
    said = f"with masks that differ per head the module differs from refimpl.gemma by {logit_diff:.3g} in the " \
           f"logits, {kv_diff:.3g} in K/V"
    detail = "" if passed else f"{said}: " + mask_heads_cause(
        ref, inp, ks, vs, out, contract, list(want_k), list(want_v), logits, logit_atol, cache_atol, failed_plain)
    verdict = closeness("mask_heads", logit_diff, logit_atol, detail)
    verdict.metrics.update({"max_abs_kv_diff": kv_diff, "cache_atol": cache_atol, "position": case.position})
    if not kv_diff <= cache_atol:
        verdict = Verdict("mask_heads", False, verdict.margin, verdict.metrics, detail)
    return verdict


def mask_heads_cause(ref: Reference, inp: gemma.ChunkInputs, ks, vs, outputs, contract: Contract, want_k, want_v,
                     want_logits, logit_atol: float, cache_atol: float, failed_plain: Sequence[str]) -> str:
    """Why the call with per-head masks differs: the cause whose counterfactual refimpl computed and the
    module's outputs matched (every head reading one head's mask), or no single known fault and where the
    outputs first differ."""
    cfg = ref.cfg
    module_kv = list(outputs[1::2]) + list(outputs[2::2])
    for h in range(cfg.heads):
        masks = {t: np.broadcast_to(m[:, h:h + 1], m.shape).copy() for t, m in inp.masks.items()}
        got = gemma.prefill_with_past(ref.w, cfg, inp.tokens, inp.tables, ks, vs, masks, inp.select)
        if _agrees(outputs[0], module_kv, got[0], list(got[1]) + list(got[2]), logit_atol, cache_atol):
            return (f"a head reads another head's mask: every head attends with head {h}'s rows of the mask_* "
                    f"arguments (refimpl given head {h}'s mask for every head agrees with the module)")
    also = (f"the module fails with the contract's own masks too ({', '.join(failed_plain)}: see their diagnosis); "
            if failed_plain else "")
    first = first_difference(contract, inp, outputs, want_k, want_v, want_logits, ks[0].shape[1], cache_atol)
    return (f"{also}no single known fault explains the per-head difference (a head reading one head's mask does "
            f"not); {first}")


def _agrees(logits, kv, want_logits, want_kv, logit_atol: float, cache_atol: float) -> bool:
    logits = np.asarray(logits, np.float64)
    return int(np.argmax(logits)) == int(np.argmax(want_logits)) and \
        float(np.abs(logits - want_logits).max()) <= logit_atol and _max_diff(kv, want_kv) <= cache_atol


def row_named(inp: gemma.ChunkInputs, row: int, past_rows: int) -> str:
    """A K/V result's row as the contract lays it out: the passed cache's rows (the first P of them hold
    positions 0..P-1, the rest are empty), then the chunk's real rows and its pad rows."""
    if row < past_rows:
        cached = int(inp.table_positions[0])  # the chunk starts at position P
        return f"row {row} (cache row, position {row})" if row < cached else f"row {row} (an empty cache row)"
    i = row - past_rows
    return f"row {row} ({'chunk' if i < inp.n else 'pad'} row {i}, position {int(inp.table_positions[i])})"


def first_difference(contract: Contract, inp: gemma.ChunkInputs, outputs, want_k, want_v, want_logits,
                     past_rows: int, cache_atol: float) -> str:
    """Where the module's outputs first differ from what they must be: the first K/V row (by row, then
    layer, then KV head, K before V), or the logits where the K/V agree."""
    out_k, out_v = list(outputs[1::2]), list(outputs[2::2])
    found = first_kv_difference(out_k, out_v, want_k, want_v, cache_atol)
    if found is None:
        diff = float(np.abs(np.asarray(outputs[0], np.float64) - want_logits).max())
        return (f"the K/V results agree; {_result(contract, 'logits')} differs by {diff:.3g} (the final norm, the "
                f"LM head, or {_arg(contract, 'select')})")
    name = f"{found.part.lower()}_{found.layer}_out"
    diff = float(np.abs(np.asarray((out_k if found.part == "K" else out_v)[found.layer], np.float64)
                        - (want_k if found.part == "K" else want_v)[found.layer]).max())
    return (f"the first result that differs is {_result(contract, name)}, first at "
            f"{row_named(inp, found.row, past_rows)} KV head {found.head}: {found.value:.4g} vs "
            f"{found.value_ref:.4g} (by {diff:.3g} at most)")


# --- diagnosis -------------------------------------------------------------------------------------


def _arg(contract: Contract, name: str) -> str:
    i = next(i for i, a in enumerate(contract.args) if a.name == name)
    return f"argument {i} ({name})"


def _result(contract: Contract, name: str) -> str:
    i = next(i for i, r in enumerate(contract.results) if r.name == name)
    return f"result {i} ({name})"


def diagnose(ref: Reference, inp: gemma.ChunkInputs, ks, vs, outputs, contract: Contract, want_k, want_v,
             reference: np.ndarray, logit_atol: float, cache_atol: float) -> str:
    """The one contract fault that explains the module's outputs, named by argument or result; or the
    first result that differs (see the module docstring)."""
    cfg = ref.cfg
    layers = cfg.layers
    logits, out_k, out_v = np.asarray(outputs[0], np.float64), list(outputs[1::2]), list(outputs[2::2])
    past = ks[0].shape[1]

    def agrees(got_logits, got_kv, want_logits, want_kv, kv: bool = True) -> bool:
        if int(np.argmax(got_logits)) != int(np.argmax(want_logits)):
            return False
        if float(np.abs(np.asarray(got_logits, np.float64) - want_logits).max()) > logit_atol:
            return False
        return not kv or _max_diff(got_kv, want_kv) <= cache_atol

    def refimpl(tables=None, masks=None, past_k=None, past_v=None, select=None):
        got = gemma.prefill_with_past(ref.w, cfg, inp.tokens, tables or inp.tables, past_k or ks, past_v or vs,
                                      masks or inp.masks, inp.select if select is None else select)
        return got[0], list(got[1]) + list(got[2])

    module_kv = out_k + out_v
    # K/V passed through: which argument each K/V result's past rows hold
    passed = ks + vs
    arg_names = [f"k_{i}" for i in range(layers)] + [f"v_{i}" for i in range(layers)]
    result_names = [f"{n}_out" for n in arg_names]
    held = [int(np.argmin([float(np.abs(np.asarray(r)[:, :past] - a).max()) for a in passed])) for r in module_kv]
    if held != list(range(2 * layers)):
        moved = [j for j, h in enumerate(held) if h != j]
        if sorted(held) == list(range(2 * layers)):
            # the results in another order?
            reordered = [None] * (2 * layers)
            for j, h in enumerate(held):
                reordered[h] = module_kv[j]
            if agrees(logits, reordered, reference, want_k + want_v):
                pairs = ", ".join(f"{_result(contract, result_names[j])} holds {result_names[held[j]]}"
                                  for j in moved)
                return f"diagnosis: the K/V results come back in another order: {pairs}"
            # the arguments read in another order? refimpl given them so
            order = [passed[h] for h in held]
            want_logits, want_kv = refimpl(past_k=order[:layers], past_v=order[layers:])
            if agrees(logits, module_kv, want_logits, want_kv):
                pairs = ", ".join(f"{_arg(contract, arg_names[held[j]])} as {arg_names[j]}" for j in moved)
                return f"diagnosis: the module reads K/V arguments in another order: it reads {pairs}"
        j = moved[0]
        return (f"diagnosis: {_result(contract, result_names[j])} does not begin with {_arg(contract, arg_names[j])} "
                f"passed through: its first {past} rows are closest to {arg_names[held[j]]}")
    # select read one row off
    row = int(np.argmax(inp.select))
    for shift, how in ((1, "one row late: the row after"), (-1, "one row early: the row before")):
        if 0 <= row + shift < inp.select.size:
            want_logits, _ = refimpl(select=np.roll(inp.select, shift))
            if agrees(logits, None, want_logits, None, kv=False):
                return (f"diagnosis: {_arg(contract, 'select')} is read {how} the one-hot's row {row} "
                        f"(the logits are refimpl's of row {row + shift})")
    # a layer type with another type's mask or tables, or cos and sin exchanged
    types = list(cfg.types_in_use)
    for t in types:
        for u in types:
            if u == t:
                continue
            want_logits, want_kv = refimpl(masks={**inp.masks, t: inp.masks[u]})
            if agrees(logits, module_kv, want_logits, want_kv):
                return (f"diagnosis: the module's {t} layers attend with {_arg(contract, f'mask_{u}')}, not "
                        f"{_arg(contract, f'mask_{t}')}: a mask of the wrong type")
    if len(types) == 2:
        t, u = types
        want_logits, want_kv = refimpl(masks={t: inp.masks[u], u: inp.masks[t]})
        if agrees(logits, module_kv, want_logits, want_kv):
            return (f"diagnosis: {_arg(contract, f'mask_{t}')} and {_arg(contract, f'mask_{u}')} are read in each "
                    f"other's place: masks of the wrong type")
    for t in types:
        cos, sin = inp.tables[t]
        want_logits, want_kv = refimpl(tables={**inp.tables, t: (sin, cos)})
        if agrees(logits, module_kv, want_logits, want_kv):
            return (f"diagnosis: {_arg(contract, f'cos_{t}')} and {_arg(contract, f'sin_{t}')} are read in each "
                    f"other's place")
        for u in types:
            if u != t:
                want_logits, want_kv = refimpl(tables={**inp.tables, t: inp.tables[u]})
                if agrees(logits, module_kv, want_logits, want_kv):
                    return (f"diagnosis: the module's {t} layers rotate with {_arg(contract, f'cos_{u}')} and "
                            f"{_arg(contract, f'sin_{u}')}, not cos_{t} and sin_{t} (missing tables of the "
                            f"first {t} layer)")
    # nothing single explains it: where it starts
    where = first_difference(contract, inp, outputs, want_k, want_v, reference, past, cache_atol)
    if where.startswith("the K/V results agree"):
        return f"diagnosis: {where}"
    return f"diagnosis: no single argument or result fault explains it; {where}"
