"""The hybrid engine in C (kernels/tb_hybrid.h, program tb_hybrid_bench) run on a device: the
Qwen3.5-style model of refimpl.qwen35, every call computed there, the conv states, recurrent states
and KV caches staying there between calls; what an oracle compares (logits, every layer's state) is
pulled at the end.

    prefill(device, cfg, w, tokens, past=P, tokens_n=n, chunk=C, tail=...)  -> HybridRun

The program is built for the device's ABI and pushed once per content; the weights go as ONE
safetensors file in Hugging Face's names (exported here, float32, cached and pushed by content hash);
the prompt as tokens.npy. Every run carries its Evidence (testbed.backends): the program's sha256, the
command, the device-side seconds, and on a device that counts (the emulated ones) the instructions of
each timed prefill (testbed.measure.counts).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from refimpl import qwen35
from testbed.backends import Evidence
from testbed.backends.native import build as kernel_build
from testbed.backends.native.device import NativeJob, program_digest, run_native, stage_program
from testbed.devices import Device
from testbed.errors import UsageError
from testbed.measure import counts as counting

PROGRAM = "tb_hybrid_bench"
WEIGHTS_DIR = kernel_build.ROOT / ".cache" / "engine"
TAILS = ("exact", "padded", "scalar")
FORMS = ("serial", "chunkwise", "none")
PRECISIONS = ("f32", "fp16-acc32", "fp16-acc16")


def export_weights(cfg: qwen35.HybridConfig, w: dict, folder: Path = WEIGHTS_DIR) -> Path:
    """The weights as one float32 safetensors file holding exactly refimpl.qwen35.weight_shapes' tensors,
    named by the hash of its content (written once)."""
    from safetensors.numpy import save_file

    shapes = qwen35.weight_shapes(cfg)
    missing = sorted(set(shapes) - set(w))
    if missing:
        raise UsageError(f"the weights lack tensor {missing[0]!r} of this configuration")
    tensors = {name: np.ascontiguousarray(w[name], np.float32) for name in sorted(shapes)}
    bad = [n for n, a in tensors.items() if a.shape != shapes[n]]
    if bad:
        raise UsageError(f"tensor {bad[0]!r} has shape {tensors[bad[0]].shape}, the configuration needs {shapes[bad[0]]}")
    h = hashlib.sha256(b"testbed-qwen35 f32")
    for name, a in tensors.items():
        h.update(f"{name} {a.shape}".encode() + a.tobytes())
    path = folder / f"qwen35-{h.hexdigest()[:20]}.safetensors"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".tmp{os.getpid()}")
        save_file(tensors, str(partial), metadata={"format": "testbed-qwen35", "weights_dtype": "f32"})
        partial.replace(path)
    return path


def model_args(cfg: qwen35.HybridConfig) -> list[str]:
    """The model's shape as the program's arguments (the weights file must match it exactly)."""
    types = "".join("F" if t == "full" else "L" for t in cfg.layer_types)
    return [f"vocab={cfg.vocab}", f"hidden={cfg.hidden}", f"layers={cfg.layers}", f"mlp={cfg.mlp}",
            f"heads={cfg.heads}", f"kv_heads={cfg.kv_heads}", f"head_dim={cfg.head_dim}",
            f"k_heads={cfg.linear_k_heads}", f"v_heads={cfg.linear_v_heads}", f"linear_dim={cfg.linear_head_dim}",
            f"conv_kernel={cfg.conv_kernel}", f"types={types}", f"rotary_dim={cfg.rotary_dim}",
            f"rope_theta={cfg.rope_theta!r}", f"eps={cfg.rms_eps!r}", f"tied={int(cfg.tie_embeddings)}"]


def program_for(device: Device, avx512: bool = True, fused: bool = False) -> Path:
    """The hybrid program built for the device's ABI (cached by content hash); avx512=False: the host
    build valgrind can run (host instruction counts); fused: the FMA build (judged by tolerance; the
    default unfused build is bit-exact across targets)."""
    target = kernel_build.target_for_abi(device.profile.abi)
    return kernel_build.build_programs(target, fused=fused, avx512=avx512 or target != "host") / PROGRAM


@dataclass
class HybridRun:
    """One prefill on the device: P past tokens, then n, in calls of C rows."""

    call_logits: np.ndarray        # [calls, vocab]: each call's last real row
    call_positions: np.ndarray     # [calls]: that row's position
    call_rows: np.ndarray          # [calls]: the call's rows (C for a padded remainder)
    state: qwen35.HybridState      # after the P + n tokens, pulled from the device
    logits_all: np.ndarray | None  # [P + n, vocab] with all_logits
    timings: dict
    evidence: Evidence
    counts: counting.Counts | None

    @property
    def logits(self) -> np.ndarray:
        """The last call's logits: the token after the prompt."""
        return self.call_logits[-1]


def state_from(cfg: qwen35.HybridConfig, out: dict, length: int) -> qwen35.HybridState:
    layers = []
    for i, t in enumerate(cfg.layer_types):
        if t == "linear":
            layers.append({"conv": out[f"layer{i}.conv"], "recurrent": out[f"layer{i}.recurrent"]})
        else:
            layers.append({"k": out[f"layer{i}.k"], "v": out[f"layer{i}.v"]})
    return qwen35.HybridState(length, layers)


def prefill(device: Device, cfg: qwen35.HybridConfig, w: dict, prompt, *, past: int, tokens: int, chunk: int,
            tail: str = "padded", gdn: str = "chunkwise", gdn_chunk: int = 64, precision: str = "f32",
            all_logits: bool = False, threads: int = 1, warmup: int = 0, reps: int = 1, measured: bool = False,
            count: bool = False, program: Path | None = None, fused: bool = False) -> HybridRun:
    """The first `past` tokens of `prompt`, then the next `tokens`, each in calls of `chunk` rows with
    the remainder by `tail` (exact | padded | scalar), the GDN layers by `gdn` (serial | chunkwise |
    none), on the device. `count` on a device that does not count by itself (the host): one run under
    valgrind, whose instructions come back in `counts` (its times are valgrind's)."""
    for name, value, accepted in (("tail", tail, TAILS), ("gdn", gdn, FORMS), ("precision", precision, PRECISIONS)):
        if value not in accepted:
            raise UsageError(f"{name}={value!r} is not accepted; accepted: {', '.join(accepted)}")
    ids = np.asarray(prompt, np.int64).reshape(-1)[: past + tokens]
    if ids.size < past + tokens:
        raise UsageError(f"the prompt has {ids.size} tokens, P + n = {past + tokens}")
    valgrind = count and not device.profile.has("counts")
    program = program or program_for(device, avx512=not valgrind, fused=fused)
    weights = export_weights(cfg, w)
    remote_weights = stage_program(device, weights)
    argv = [".", ".", f"weights=../../{remote_weights}", *model_args(cfg), f"past={past}", f"tokens={tokens}",
            f"chunk={chunk}", f"tail={tail}", f"gdn={gdn}", f"gdn_chunk={gdn_chunk}", f"precision={precision}",
            f"all_logits={int(all_logits)}", f"threads={threads}", f"warmup={warmup}", f"reps={reps}"]
    outputs = ["call_logits", "call_positions", "call_rows"] + (["logits_all"] if all_logits else [])
    for i, t in enumerate(cfg.layer_types):
        outputs += [f"layer{i}.conv", f"layer{i}.recurrent"] if t == "linear" else [f"layer{i}.k", f"layer{i}.v"]
    job = NativeJob(program, {"tokens": ids.astype(np.int32)}, outputs, argv, measured=measured, count=valgrind)
    result = run_native(device, job)
    evidence = dataclasses.replace(result.evidence, detail={**result.evidence.detail,
                                                            "weights_sha256": program_digest(weights)})
    out = result.outputs
    return HybridRun(out["call_logits"], out["call_positions"], out["call_rows"],
                     state_from(cfg, out, past + tokens), out.get("logits_all"), result.timings, evidence,
                     result.counts)
