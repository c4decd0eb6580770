"""The four Gemma graphs of refimpl.gemma in jax.numpy, for export to IREE.

Same math and same flat argument order as refimpl.gemma and testbed.models.contract (K/V cached after
k-norm and RoPE, per layer [kv_heads, rows, head_dim]; tables and masks built on the host by
refimpl.gemma's builders). Weights are a dict by Hugging Face name; testbed.backends.iree.artifacts turns
them into module parameters (one module serves any weights of the shape) or constants.

  prefill_with_past  args: the contract's 44-argument order for FunctionGemma; results: the
                     selected row's logits, then K, V per layer extended by the chunk
  decode_with_past   the same with C = 1 and no select
  decode_in_cache    decode_with_past on a fixed-capacity cache: its arguments and a one-hot `write`
                     [capacity] last; results: the logits, then K, V per layer [kv_heads, capacity,
                     head_dim] with the new row written at `write` (what a device's decode loop
                     needs: the cache keeps its shape, so one module serves every step)
  prefill_at         tokens, select for positions 0..n-1; its tables and masks come from the host
                     builders at trace time (positions are implied), folded in as constants
  redecode           tokens, select -> logits only; like refimpl.redecode it builds its masks by its
                     own index comparison (in the graph), independent of the host builders
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict

import numpy as np

from refimpl import gemma as ref
from testbed.backends.iree.artifacts import Contract, Graph, TensorSpec
from testbed.models import contract as gemma_contract


def rms_norm(x, w, eps):
    import jax.numpy as jnp

    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * (1 + w)


def gelu_tanh(x):
    import jax.numpy as jnp

    return 0.5 * x * (1 + jnp.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def apply_rope(x, cos, sin):
    import jax.numpy as jnp

    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def attention(q, k, v, mask, scale):
    """q [heads, C, d], k/v [kv_heads, K, d], mask [1, heads, C, K]; head h reads KV head h // group."""
    import jax.numpy as jnp

    heads, c, d = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    scores = jnp.einsum("ngcd,nkd->ngck", q.reshape(kv_heads, group, c, d), k) * scale
    scores = scores.reshape(heads, c, -1) + mask[0]
    scores = jnp.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    return jnp.einsum("ngck,nkd->ngcd", probs.reshape(kv_heads, group, c, -1), v).reshape(heads, c, d)


def decoder_layer(w, cfg: ref.GemmaConfig, i, x, cos, sin, past_k, past_v, mask):
    import jax.numpy as jnp

    p = f"model.layers.{i}."
    c = x.shape[0]
    h = rms_norm(x, w[p + "input_layernorm.weight"], cfg.rms_eps)

    def heads_first(name, n):
        return (h @ w[p + name].T).reshape(c, n, cfg.head_dim).transpose(1, 0, 2)

    q = apply_rope(rms_norm(heads_first("self_attn.q_proj.weight", cfg.heads),
                            w[p + "self_attn.q_norm.weight"], cfg.rms_eps), cos, sin)
    k = apply_rope(rms_norm(heads_first("self_attn.k_proj.weight", cfg.kv_heads),
                            w[p + "self_attn.k_norm.weight"], cfg.rms_eps), cos, sin)
    v = heads_first("self_attn.v_proj.weight", cfg.kv_heads)
    k_all = jnp.concatenate([past_k, k], axis=1)
    v_all = jnp.concatenate([past_v, v], axis=1)
    o = attention(q, k_all, v_all, mask, cfg.scale).transpose(1, 0, 2).reshape(c, -1)
    x = x + rms_norm(o @ w[p + "self_attn.o_proj.weight"].T, w[p + "post_attention_layernorm.weight"], cfg.rms_eps)
    h = rms_norm(x, w[p + "pre_feedforward_layernorm.weight"], cfg.rms_eps)
    m = (gelu_tanh(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
        @ w[p + "mlp.down_proj.weight"].T
    x = x + rms_norm(m, w[p + "post_feedforward_layernorm.weight"], cfg.rms_eps)
    return x, k_all, v_all


def embed(w, cfg: ref.GemmaConfig, tokens):
    import jax.numpy as jnp

    return jnp.take(w["model.embed_tokens.weight"], tokens, axis=0) * math.sqrt(cfg.hidden)


def lm_head(w, cfg: ref.GemmaConfig, row):
    import jax.numpy as jnp

    head = w["model.embed_tokens.weight"] if cfg.tie_embeddings else w["lm_head.weight"]
    logits = head @ rms_norm(row, w["model.norm.weight"], cfg.rms_eps)
    if cfg.final_logit_softcap:
        logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
    return logits


def _layers(w, cfg, x, tables, past_k, past_v, masks):
    ks, vs = [], []
    for i, t in enumerate(cfg.layer_types):
        x, k, v = decoder_layer(w, cfg, i, x, *tables[t], past_k[i], past_v[i], masks[t])
        ks.append(k)
        vs.append(v)
    return x, ks, vs


def _interleave(logits, ks, vs):
    return (logits, *(a for kv in zip(ks, vs) for a in kv))


# --- the graphs ------------------------------------------------------------------------------------


def _model_tag(cfg: ref.GemmaConfig) -> str:
    return hashlib.sha256(json.dumps(asdict(cfg), sort_keys=True).encode()).hexdigest()[:10]


def _convert(c: gemma_contract.Contract) -> Contract:
    return Contract(c.graph, tuple(TensorSpec(s.name, tuple(s.shape), s.dtype) for s in c.args),
                    tuple(TensorSpec(s.name, tuple(s.shape), s.dtype) for s in c.results))


def _with_past(cfg: ref.GemmaConfig, names: list[str], args):
    named = dict(zip(names, args))
    tables = {t: (named[f"cos_{t}"], named[f"sin_{t}"]) for t in cfg.types_in_use}
    masks = {t: named[f"mask_{t}"] for t in cfg.types_in_use}
    past_k = [named[f"k_{i}"] for i in range(cfg.layers)]
    past_v = [named[f"v_{i}"] for i in range(cfg.layers)]
    return named["tokens"], tables, past_k, past_v, masks


def prefill_with_past(cfg: ref.GemmaConfig, w: dict, chunk: int, past: int, constants: bool = False) -> Graph:
    contract = _convert(gemma_contract.prefill_with_past_contract(cfg, chunk, past))
    names = [a.name for a in contract.args]

    def fn(weights, *args):
        tokens, tables, past_k, past_v, masks = _with_past(cfg, names, args)
        x, ks, vs = _layers(weights, cfg, embed(weights, cfg, tokens), tables, past_k, past_v, masks)
        return _interleave(lm_head(weights, cfg, args[-1] @ x), ks, vs)

    return Graph(f"gemma_{_model_tag(cfg)}_prefill_with_past_C{chunk}_P{past}{'_const' if constants else ''}",
                 fn, contract, w, constants)


def decode_with_past(cfg: ref.GemmaConfig, w: dict, past: int, constants: bool = False) -> Graph:
    contract = _convert(gemma_contract.decode_with_past_contract(cfg, past))
    names = [a.name for a in contract.args]

    def fn(weights, *args):
        tokens, tables, past_k, past_v, masks = _with_past(cfg, names, args)
        x, ks, vs = _layers(weights, cfg, embed(weights, cfg, tokens), tables, past_k, past_v, masks)
        return _interleave(lm_head(weights, cfg, x[0]), ks, vs)

    return Graph(f"gemma_{_model_tag(cfg)}_decode_with_past_P{past}{'_const' if constants else ''}",
                 fn, contract, w, constants)


def decode_in_cache(cfg: ref.GemmaConfig, w: dict, capacity: int, constants: bool = False) -> Graph:
    """decode_with_past against `capacity` cache rows (empty ones masked by the host's mask), the new
    row then written into the cache at the one-hot `write` row instead of appended."""
    import jax.numpy as jnp

    base = _convert(gemma_contract.decode_with_past_contract(cfg, capacity))
    names = [a.name for a in base.args]
    kv = (cfg.kv_heads, capacity, cfg.head_dim)
    results = (base.results[0], *(TensorSpec(r.name, kv, r.dtype) for r in base.results[1:]))
    contract = Contract("decode_in_cache", (*base.args, TensorSpec("write", (capacity,), "float32")), results)

    def fn(weights, *args):
        tokens, tables, past_k, past_v, masks = _with_past(cfg, names, args[:-1])
        x, ks, vs = _layers(weights, cfg, embed(weights, cfg, tokens), tables, past_k, past_v, masks)
        row = args[-1][None, :, None] > 0

        def written(extended):  # [kv, capacity + 1, d]: the cache, then the new row
            return jnp.where(row, extended[:, -1:], extended[:, :-1])

        return _interleave(lm_head(weights, cfg, x[0]), [written(k) for k in ks], [written(v) for v in vs])

    return Graph(f"gemma_{_model_tag(cfg)}_decode_in_cache_P{capacity}{'_const' if constants else ''}",
                 fn, contract, w, constants)


def prefill_at(cfg: ref.GemmaConfig, w: dict, n: int, constants: bool = False) -> Graph:
    import jax.numpy as jnp

    contract = _convert(gemma_contract.prefill_at_contract(cfg, n))
    # Positions 0..n-1 are implied: the host builders run once here and their output is folded in.
    # Masks travel as booleans [n, n] (a quarter of the bytes) and become additive in the graph.
    host = ref.chunk_inputs(cfg, np.zeros(n, np.int64), 0, n)
    allowed = {t: host.masks[t][0, 0] == 0 for t in cfg.types_in_use}
    past_k, past_v = ref.empty_cache(cfg)

    def fn(weights, tokens, select):
        masks = {t: jnp.where(a, 0.0, ref.MASKED).astype(jnp.float32)[None, None]
                 * jnp.ones((1, cfg.heads, 1, 1), jnp.float32) for t, a in allowed.items()}
        x, ks, vs = _layers(weights, cfg, embed(weights, cfg, tokens), host.tables, past_k, past_v, masks)
        return _interleave(lm_head(weights, cfg, select @ x), ks, vs)

    return Graph(f"gemma_{_model_tag(cfg)}_prefill_at_N{n}{'_const' if constants else ''}",
                 fn, contract, w, constants)


def redecode(cfg: ref.GemmaConfig, w: dict, n: int, constants: bool = False) -> Graph:
    """All positions from scratch, logits of the selected one; masks from its own index comparison."""
    import jax.numpy as jnp

    contract = _convert(gemma_contract.redecode_contract(cfg, n))
    pos = np.arange(n)
    tables = {t: ref.rope_tables(pos, cfg.head_dim, cfg.rope_base(t), cfg.rope_scaling(t)) for t in cfg.types_in_use}
    past_k, past_v = ref.empty_cache(cfg)

    def fn(weights, tokens, select):
        query, key = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
        visible = {"global": key <= query, "local": (key <= query) & (query - key < cfg.window)}
        masks = {t: jnp.broadcast_to(jnp.where(visible[t], 0.0, ref.MASKED).astype(jnp.float32),
                                     (1, cfg.heads, n, n)) for t in cfg.types_in_use}
        x, _, _ = _layers(weights, cfg, embed(weights, cfg, tokens), tables, past_k, past_v, masks)
        return (lm_head(weights, cfg, select @ x),)

    return Graph(f"gemma_{_model_tag(cfg)}_redecode_N{n}{'_const' if constants else ''}",
                 fn, contract, w, constants)
