"""Oracles on what an engine under test returns through engine contract v1 (testbed.backends.engine):
its state.bin after a padded tail rolled back, and the first token of each tail mode.

No engine may pass by agreeing with itself. Its padded state equal to its unpadded one (check_state_bytes)
shows the rollback is exact, but an empty state, one that is the same for every prompt or the state from
before the last call agree as well. So the agreement is judged only beside an oracle on what the state
holds (judged_with):
  state_continuation  (an engine that restores a state: supports.state_in) the state restored in a fresh
                      engine process, which then decodes the next tokens: their logits against the
                      reference's over the same prompt (check_continuation);
  state_properties    (an engine that cannot) what any state holding the prompt's caches has
                      (check_state_properties): (a) it differs from the state of a prompt whose last token
                      differs, (b) it differs from the state after every call but the last, (c) its size
                      holds the K/V rows the model's caches must keep after P + n positions and grows from a
                      shorter prompt's as those rows do. (a) and (b) are read only where the state is shown
                      to be a function of the prompt (padded and unpadded agree): an engine writing
                      arbitrary bytes differs from everything. (c) alone shows a size, not a content.
States are compared in bounded memory (testbed.backends.engine.state.compare), byte for byte, or as the
float layout and tolerance the engine's yaml declares (kernels whose rounding depends on the row count)."""

from __future__ import annotations

import hashlib

import numpy as np

from testbed.backends.engine.state import BLOCK, StateDiff, StateFile, compare
from testbed.backends.engine.tail import CacheBytes
from testbed.oracles.numerical import Verdict
from testbed.oracles.tokens import margin_for, tied_tokens


def sha256_of(state: StateFile | None) -> str:
    h = hashlib.sha256()
    if state is not None:
        with open(state.path, "rb") as f:
            for block in iter(lambda: f.read(BLOCK), b""):
                h.update(block)
    return h.hexdigest()


def check_state_bytes(padded, unpadded, layout: str = "bytes", tolerance: float = 0.0,
                      diff: StateDiff | None = None) -> Verdict:
    """state.bin of the prompt prefilled with its tail padded and the pad rows removed, against the same
    prompt with the last partial chunk appended unpadded: byte for byte (or as the engine's float layout,
    within its tolerance; where they differ, the first differing offset), and the next token equal. This
    is the engine agreeing with itself: see judged_with. `diff`: the two states' comparison, when made already."""
    problems = []
    diff = diff or compare(padded.state, unpadded.state, layout, tolerance)
    if diff.sizes[0] != diff.sizes[1]:
        problems.append(f"state.bin holds {diff.sizes[0]} bytes after the padded tail, {diff.sizes[1]} after the "
                        "unpadded one")
    elif not diff.same:
        problems.append(diff.says("state.bin after the padded tail", "after the unpadded one"))
    tokens = [int(np.argmax(r.logits[0])) for r in (padded, unpadded)]
    if tokens[0] != tokens[1]:
        problems.append(f"the next token differs: {tokens[0]} after the padded tail, {tokens[1]} unpadded")
    metrics = {"bytes": padded.state.size, "sha256": sha256_of(padded.state),
               "sha256_expected": sha256_of(unpadded.state), "layout": layout, "token_padded": tokens[0],
               "token_unpadded": tokens[1], **({"max_abs_diff": diff.max_abs, "tolerance": tolerance}
                                               if layout != "bytes" else {})}
    return Verdict("state_bytes", not problems, 0.0 if not problems else -1.0, metrics, "; ".join(problems))


def judged_with(agreement: Verdict, content: Verdict) -> Verdict:
    """The padded/unpadded agreement as a verdict: a disagreement fails whatever else holds; an agreement
    passes only when the content oracle passed (the states agree and hold the prompt). Otherwise it
    proves nothing: "not judged", saying why."""
    if agreement.unjudged or not agreement.passed or content.passed:
        return agreement
    why = (f"{content.oracle} failed" if content.verdict == "fail" else f"{content.oracle} was not judged")
    return Verdict.not_judged(agreement.oracle, f"the padded and unpadded states agree, but an empty or stale state "
                                                f"agrees too and {why}: nothing shows they hold the prompt",
                              agreement.metrics)


def check_continuation(reference: np.ndarray, logits: np.ndarray, fed: list[int], positions: int,
                       atol: float) -> Verdict:
    """The engine's logits after restoring its state (which holds `positions` positions) and decoding `fed`
    one token per call, against the reference's at the same positions (the reference's own greedy tokens
    fed to both): each row's token one the reference accepts (ties within atol) and its logits within
    atol. The first row that is not names its position."""
    reference = np.asarray(reference, np.float64)
    problems, diffs, tokens, margins = [], [], [], []
    for i, (ref, got) in enumerate(zip(reference, logits)):
        accepted = tied_tokens(ref, atol)
        token = int(np.argmax(got))
        diff = float(np.abs(np.asarray(got, np.float64) - ref).max())
        tokens.append(token)
        diffs.append(diff)
        margins.append(margin_for(np.asarray(got), accepted))
        if not problems and (token not in accepted or not diff <= atol):
            where = (f"continuing from its state.bin (restored in a fresh process), at position {positions + i} "
                     f"(token {i + 1} of {len(fed)} after the {positions} restored)")
            problems.append(f"{where} the engine gives token {token}, the reference {int(np.argmax(ref))} (accepted "
                            f"{accepted}); max |logit - reference| {diff:.3g}" if token not in accepted else
                            f"{where} the logits differ from the reference's by {diff:.3g} > {atol:g} (token {token} "
                            "as the reference's)")
    metrics = {"restored_positions": positions, "fed": [int(t) for t in fed], "tokens": tokens,
               "tokens_ref": [int(np.argmax(r)) for r in reference], "max_abs_diff": max(diffs) if diffs else None,
               "max_abs_diff_per_token": diffs, "atol": atol}
    return Verdict("state_continuation", not problems, min(margins) if margins else None, metrics, "; ".join(problems))


def continuation_failed(positions: int, why: str) -> Verdict:
    """The engine could not continue from the state it gave (its restore or its decoding broke)."""
    return Verdict("state_continuation", False, None, {"restored_positions": positions},
                   f"continuing from its own state.bin ({positions} positions) in a fresh process: {why}")


def _size(state: StateFile, positions: int, cache: CacheBytes, shorter: tuple[int, int] | None) -> tuple[bool, str]:
    """(c): state.bin holds at least the K/V rows the caches must keep after `positions` positions, and
    from a shorter prompt's state (positions, bytes) of the same caches it grew as those rows say."""
    floor = cache.floor(positions)
    if state.size < floor:
        held = cache.held(positions)
        return False, (f"(c) state.bin holds {state.size} bytes; after {positions} positions the model's caches "
                       f"hold at least {floor} ({held['global']} rows per global layer, {held['local']} per local "
                       f"one, {cache.row} bytes a row in {cache.dtype})")
    if shorter is not None:
        before, size = shorter
        least, most = cache.growth(before, positions)
        grown = state.size - size
        if not least <= grown <= most:
            return False, (f"(c) state.bin grew by {grown} bytes from {before} to {positions} positions; the caches' "
                           f"rows say {least} to {most} ({cache.row} bytes a row per layer, in {cache.dtype})")
        return True, f"{state.size} bytes >= {floor}, grown by {grown} in [{least}, {most}] from {before} positions"
    return True, f"{state.size} bytes >= {floor}"


def check_state_properties(state: StateFile, positions: int, cache: CacheBytes, agreement: StateDiff | None,
                           other: StateFile | None, before_last: StateFile | None,
                           shorter: tuple[int, int] | None = None, layout: str = "bytes",
                           tolerance: float = 0.0) -> Verdict:
    """What the state of a prompt of `positions` tokens must have, for an engine that cannot restore one:
    (a) it differs from `other`, the state of the prompt with its last token changed; (b) it differs from
    `before_last`, the state after every call but the last (None: the engine wrote none); (c) its size
    (see _size). `agreement`: padded against unpadded (None when the engine refused the unpadded tail);
    (a) and (b) are read only where it shows the state is a function of the prompt. Fails on any property
    that fails; passes when (a) or (b) held; otherwise not judged, saying why."""
    reproducible = agreement is not None and agreement.same
    unread = ("the engine refused the unpadded tail, so nothing shows its state.bin is a function of the prompt"
              if agreement is None else
              "the padded and unpadded states differ, so a difference shows nothing" if not agreement.same else "")
    checked, failed, said = {}, [], []

    def judge(name: str, held: bool, text: str) -> None:
        checked[name] = "pass" if held else "fail"
        (said if held else failed).append(text)

    if not reproducible or other is None:
        checked["distinct"] = f"not checked: {unread or 'no second prompt'}"
    else:
        d = compare(state, other, layout, tolerance)
        judge("distinct", not d.same, "(a) differs from the state of the prompt with its last token changed" if not d.same
              else "(a) state.bin is the same for two prompts that differ in their last token")
    if before_last is None or not reproducible:
        checked["last_call"] = f"not checked: {unread or 'the engine wrote no state_before_last.bin'}"
    else:
        d = compare(before_last, state, layout, tolerance)
        judge("last_call", not d.same, "(b) changed when the last call ran" if not d.same else
              "(b) state.bin is what it was before the last call ran")
    held, text = _size(state, positions, cache, shorter)
    judge("size", held, text if not held else f"(c) {text}")
    metrics = {"bytes": state.size, "floor_bytes": cache.floor(positions), "row_bytes": cache.row,
               **{f"property.{k}": v for k, v in checked.items()}}
    if failed:
        return Verdict("state_properties", False, None, metrics, "; ".join(failed))
    if "pass" not in (checked["distinct"], checked["last_call"]):
        return Verdict.not_judged("state_properties", f"(a) and (b) not checked: {unread or 'nothing to compare'}; "
                                                      "a size alone does not show the state holds the prompt", metrics)
    return Verdict("state_properties", True, None, metrics, "; ".join(said))


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
               **{f"token_{m}": int(np.argmax(x)) for m, x in by_mode.items()}, "atol": atol}
    return Verdict("first_token", not problems, margin, metrics, "; ".join(problems))
