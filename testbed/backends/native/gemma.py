"""The reference Gemma graphs with the native attention layer (kernels/, through testbed.backends.native.library):
norms, projections, RoPE and MLP stay numpy float32; every attention call, chunk or decode step,
runs tb_attention with `threads` threads over heads."""

from __future__ import annotations

from omegaconf import OmegaConf

from testbed.backends.native import library as native
from testbed.backends import GemmaBackend
from testbed.backends.refimpl import gemma as refimpl


def backend(w, cfg, run_cfg=None, device=None) -> GemmaBackend:
    native.library()  # a missing or stale library says how to rebuild before anything runs
    threads = int(OmegaConf.select(run_cfg, "threads", default=1)) if run_cfg is not None else 1

    def attention(q, k, v, mask, scale):
        return native.attention(q, k, v, mask, scale, threads=threads)

    be = refimpl.backend(w, cfg, run_cfg, device, attention=attention)
    be.name = "native"
    return be
