"""Tiny Qwen3.5 checkpoints made by transformers itself (no download), for the hybrid's tests on the
host and on devices: every parameter drawn at random (norm weights, A_log and dt_bias included, so no
term hides behind an identity initialisation), the gates in the regime a trained model keeps (as
Mamba2 initialises them: decays near 0.9 per token, so the states carry across chunks), saved with
save_pretrained; and transformers' own logits at every position and its states after the prompt, in
refimpl.qwen35's layouts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
VARIANTS = {
    "lllf": TINY,  # Qwen3.5's pattern: three GDN layers, then one full
    # every other layer full, tied embeddings, a kernel of 3, RoPE over half the head
    "lflf-tied": {**TINY, "full_attention_interval": 2, "tie_word_embeddings": True, "linear_conv_kernel_dim": 3,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
}


@dataclass
class Made:
    folder: Path
    prompt: np.ndarray        # int64 ids
    logits: np.ndarray        # [T, vocab], transformers' at every position
    states: dict              # {"0.conv", "0.recurrent", "3.k", ...} after the prompt, refimpl's layouts


def make_tiny_qwen35(folder: Path, settings: dict, prompt_tokens: int, seed: int = 0) -> Made:
    import torch
    import transformers

    config = transformers.Qwen3_5TextConfig(**settings)
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(1, 16)))
            elif name.endswith("dt_bias"):
                dt = torch.exp(torch.empty_like(p).uniform_(math.log(1e-3), math.log(1e-1)))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif p.ndim == 1:
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith("in_proj_a.weight"):
                p.copy_(0.1 * torch.randn_like(p) / p.shape[-1] ** 0.5)
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    prompt = np.random.default_rng(seed + 1).integers(0, settings["vocab_size"], prompt_tokens)
    cache = transformers.DynamicCache(config=config)
    with torch.no_grad():
        logits = model(torch.tensor(prompt)[None], cache=cache, use_cache=True).logits[0].numpy()
    states = {}
    kernel = settings["linear_conv_kernel_dim"]
    for i, t in enumerate(config.layer_types):
        if t == "linear_attention":
            # transformers keeps the last K conv inputs channels-first; the next call reads K - 1
            states[f"{i}.conv"] = cache.get_conv_state(i)[0].numpy()[:, -(kernel - 1):].T
            # [H_v, d_k, d_v] -> refimpl.gdn's transposed [H_v, d_v, d_k]
            states[f"{i}.recurrent"] = np.swapaxes(cache.get_recurrent_state(i)[0].numpy(), -1, -2)
        else:
            states[f"{i}.k"] = cache.layers[i].keys[0].numpy()
            states[f"{i}.v"] = cache.layers[i].values[0].numpy()
    return Made(Path(folder), prompt.astype(np.int64), logits, states)
