"""The numpy reference graphs as a backend (float32, on the host)."""

from __future__ import annotations

from refimpl import gemma
from testbed.backends import GemmaBackend


def backend(w, cfg, run_cfg=None, device=None, progress=None, attention=gemma.attention) -> GemmaBackend:
    def prefill_with_past(inp, past_k, past_v):
        return gemma.prefill_with_past(w, cfg, inp.tokens, inp.tables, past_k, past_v, inp.masks, inp.select,
                                       attention)

    return GemmaBackend(
        name="refimpl",
        prefill_at=lambda tokens, row: gemma.prefill_at(w, cfg, tokens, row, attention),
        prefill_with_past=prefill_with_past,
        decode_with_past=prefill_with_past,
        cfg=cfg,
    )
