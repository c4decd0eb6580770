"""The Gemma graphs compiled with IREE (testbed.backends.iree.graphs.gemma) as a backend: `backend=iree target=NAME`.

Each graph is compiled per shape through the artifact cache. The past K/V length is rounded up to a
multiple of `iree.past_bucket` with empty cache rows, so the token-by-token path does not need one
module per position: an empty row is a row the mask hides from every query (the host-built mask
gets one masked column per empty row, between the past and the chunk), which is what a device's
fixed-capacity cache does. Results come back without the empty rows, so callers see exactly the
contract's shapes for their true past length.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from refimpl import gemma as ref
from testbed.contract import pack_prefill_with_past
from testbed.backends import GemmaBackend
from testbed.backends.iree.graphs import gemma as graphs
from testbed.backends.iree.runtime import TargetRunner


def backend(w, cfg: ref.GemmaConfig, run_cfg, device=None) -> GemmaBackend:
    options = run_cfg.get("iree", {}) or {}
    runner = TargetRunner(run_cfg.target, options.get("driver"))
    bucket = int(options.get("past_bucket", 128))
    constants = options.get("weights", "parameters") == "constants"

    def with_past(inp: ref.ChunkInputs, past_k, past_v, decode: bool):
        past = past_k[0].shape[1]
        empty = -past % bucket
        padded = past + empty
        chunk = inp.tokens.size
        graph = (graphs.decode_with_past(cfg, w, padded, constants) if decode
                 else graphs.prefill_with_past(cfg, w, chunk, padded, constants))
        hidden = np.full((1, cfg.heads, chunk, empty), ref.MASKED, np.float32)
        masks = {t: np.concatenate([m[..., :past], hidden, m[..., past:]], axis=-1) for t, m in inp.masks.items()}
        rows = np.zeros((cfg.kv_heads, empty, cfg.head_dim), np.float32)
        ks = [np.concatenate([k, rows], axis=1) for k in past_k]
        vs = [np.concatenate([v, rows], axis=1) for v in past_v]
        args = pack_prefill_with_past(cfg, dataclasses.replace(inp, masks=masks), ks, vs)
        if decode:  # decode_with_past's contract: prefill_with_past's order without the select
            args = args[:-1]
        out = runner(graph, *args)
        keep = np.r_[0:past, padded:padded + chunk]
        return out[0], [k[:, keep] for k in out[1::2]], [v[:, keep] for v in out[2::2]]

    def prefill_at(tokens, row):
        tokens = np.asarray(tokens).reshape(-1)
        select = np.eye(tokens.size, dtype=np.float32)[int(row)]
        out = runner(graphs.prefill_at(cfg, w, tokens.size, constants), tokens.astype(np.int32), select)
        return out[0], list(out[1::2]), list(out[2::2])

    return GemmaBackend(
        name="iree",
        prefill_at=prefill_at,
        prefill_with_past=lambda inp, k, v: with_past(inp, k, v, decode=False),
        decode_with_past=lambda inp, k, v: with_past(inp, k, v, decode=True),
        cfg=cfg,
    )
