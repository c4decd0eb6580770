#!/usr/bin/env python3
"""ExecuTorch behind engine contract v1 (README, "Engine under test"): export.py's model.pte run by
executorch's own Python runtime (executorch.runtime, the portable_lib bindings with the XNNPACK backend).

    adapter.py REQUEST_DIR RESPONSE_DIR

request/model/ is the export folder (model.pte, manifest.json). The program has one method,
forward(input_ids[1, rows], cache_position[rows]) -> logits[1, rows, vocab], over a static KV cache of
manifest.max_positions rows per layer that it keeps between calls (mutable buffers, addressed by position).

technique=chunk_prefill  tokens[0:past] in calls of C rows ("past"), then tokens[past:] in calls of C rows
    ("chunk"); the last partial call by tail.mode: none, its real rows only (the method takes any row count);
    padded, C rows with zero tokens as pads, whose cache rows lie past every later query and are
    overwritten before any query may see them (the cache is addressed by position: rolling back is moving
    the next position back); scalar, its real rows one call each ("decode"). logits.npy holds the rows at
    logits_at, each from the call that computed it; cache/k_L.npy, v_L.npy the rows [0, P + n) of each
    layer's cache, read from the runtime (Method.get_attribute on the buffers export.py named).
technique=tail  the prompt from position 0 in calls of C rows, the last partial one ("tail") by tail.mode as
    above; state.bin (state=true): per layer K then V, rows [0, n_tokens), float32, as the runtime holds them.
technique=hybrid, weights or a cache dtype other than float32, a sink, another window, or more positions than
    the export's cache holds: refused in status.json (recorded "not supported").
bench={reps, warmup}: after the plan, its utterance calls run again warmup + reps times at the same
    positions (the past stays cached: each repeat is the chunk call of C rows after P positions); only the
    reps are in timings.json. Without bench, every call is.
timings.json: each call's wall and CPU seconds around Method.execute (the runtime's own call), its rows, and
    the program load; the engine named by executorch's version and the .pte's sha256.
Exit 2 bad request, 3 the runtime missing, 4 the runtime failed (stderr: one line); nothing is written as ok
unless every file is.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CONTRACT = 1
ENGINE = "executorch"


class Refused(Exception):
    """The request asks for what this export cannot do: status "refused" with this reason."""


def die(code: int, message: str) -> None:
    print(f"executorch adapter: {message}", file=sys.stderr)
    sys.exit(code)


@dataclass
class Call:
    name: str      # past | chunk | tail | decode
    start: int     # first position
    real: int      # rows that are the sequence's
    rows: int      # rows sent (real + pads)


def plan(technique: str, n_tokens: int, past: int, chunk: int, mode: str) -> list[Call]:
    """The calls, in order: the past in calls of C rows, then the utterance; the last partial call by tail.mode."""
    calls = [Call("past", s, min(chunk, past - s), min(chunk, past - s)) for s in range(0, past, chunk)]
    for s in range(past, n_tokens, chunk):
        real = min(chunk, n_tokens - s)
        partial = real < chunk
        if partial and mode == "scalar":
            calls += [Call("decode", s + i, 1, 1) for i in range(real)]
        else:
            name = "tail" if partial and technique == "tail" else "chunk"
            calls.append(Call(name, s, real, chunk if partial and mode == "padded" else real))
    return calls


def read_request(folder: Path) -> dict:
    try:
        request = json.loads((folder / "request.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        die(2, f"{folder}/request.json is not readable JSON: {e}")
    if not isinstance(request, dict) or request.get("contract") != CONTRACT:
        die(2, f"request.json: contract={request.get('contract') if isinstance(request, dict) else request!r}; "
               f"this adapter speaks contract {CONTRACT}")
    return request


def read_manifest(model: Path) -> dict:
    try:
        manifest = json.loads((model / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        die(2, f"{model}/manifest.json is not readable ({e}): request/model/ must be engines/executorch/export.py's "
               "output folder")
    if manifest.get("runtime") != ENGINE or not (model / str(manifest.get("artifact", ""))).is_file():
        die(2, f"{model}/manifest.json names runtime={manifest.get('runtime')!r}, artifact={manifest.get('artifact')!r}; "
               "expected an ExecuTorch export (model.pte)")
    return manifest


def check(request: dict, manifest: dict, n_tokens: int) -> tuple[str, int, int, str, list[int]]:
    """The request's plan values, validated; what the export cannot serve raises Refused."""
    technique = request.get("technique")
    past, chunk = request.get("past", 0), request.get("chunk", 1)
    mode = (request.get("tail") or {}).get("mode", "none")
    at = request.get("logits_at") or []
    for key, value in (("past", past), ("chunk", chunk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (key == "chunk"):
            die(2, f"request.json: {key}={value!r}; accepted: an integer >= {int(key == 'chunk')}")
    if past >= n_tokens:
        die(2, f"request.json: past={past} leaves no utterance in tokens.npy's {n_tokens} tokens")
    if mode not in ("none", "padded", "scalar"):
        die(2, f"request.json: tail.mode={mode!r}; accepted: none, padded, scalar")
    if not isinstance(at, list) or any(isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < n_tokens for p in at):
        die(2, f"request.json: logits_at={at!r}; accepted: positions 0..{n_tokens - 1}")
    if technique not in ("chunk_prefill", "tail"):
        raise Refused(f"technique={technique}: this ExecuTorch export is transformers' static KV-cache recipe, "
                      "attention layers only; it serves chunk_prefill and tail")
    if request.get("model", {}).get("weights", "f32") != "f32":
        raise Refused(f"weights={request['model']['weights']}: the export lowers the checkpoint in float32")
    cache = request.get("cache") or {}
    if cache.get("dtype", "float32") != "float32":
        raise Refused(f"cache.dtype={cache['dtype']}: the export's static cache is float32")
    if cache.get("sink", 0):
        raise Refused(f"cache.sink={cache['sink']}: the model's sliding window keeps no sink rows")
    window = manifest["model"].get("sliding_window") or 0
    if cache.get("window", 0) not in (0, window):
        raise Refused(f"cache.window={cache['window']}: the export's window is the model's ({window})")
    calls = plan(technique, n_tokens, past, chunk, mode)
    reach = max(c.start + c.rows for c in calls)
    if reach > manifest["max_positions"]:
        raise Refused(f"the export's static KV cache holds {manifest['max_positions']} positions; this request "
                      f"reaches position {reach - 1} (past={past}, n_tokens={n_tokens}, chunk={chunk}, tail.mode={mode})")
    if max(c.rows for c in calls) > manifest["rows"][1]:
        raise Refused(f"chunk={chunk}: the export's method takes at most {manifest['rows'][1]} rows per call")
    if request.get("state") and technique != "tail":
        raise Refused("state=true: this adapter writes state.bin for technique=tail")
    return technique, past, chunk, mode, at


class Engine:
    """The .pte loaded by executorch's runtime; run() is one call of the method, timed around it."""

    def __init__(self, model: Path, manifest: dict, threads: int):
        try:
            import torch
            from executorch.extension.pybindings import portable_lib
            from executorch.runtime import Runtime, Verification
        except ImportError as e:
            die(3, f"executorch's runtime is not installed ({e}); pip install 'testbed[executorch]'")
        self.torch = torch
        if threads > 0:
            portable_lib._unsafe_reset_threadpool(threads)  # XNNPACK's thread pool, as the runner's -cpu_threads
        wall, cpu = time.perf_counter(), time.process_time()
        program = Runtime.get().load_program(model / manifest["artifact"], verification=Verification.Minimal)
        self.method = program.load_method(manifest["method"])
        self.load = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}
        self.manifest = manifest

    def run(self, tokens, start: int, rows: int):
        """One call of `rows` rows at positions start.. (tokens zero-padded to rows): (logits [rows, vocab], wall, cpu)."""
        torch = self.torch
        ids = torch.zeros((1, rows), dtype=torch.long)
        ids[0, :len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
        positions = torch.arange(start, start + rows, dtype=torch.long)
        wall, cpu = time.perf_counter(), time.process_time()
        out = self.method.execute([ids, positions])
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return out[0][0].numpy(), wall, cpu

    def cache(self, layer: int, rows: int):
        """Layer `layer`'s K and V rows [0, rows) as [kv_heads, rows, head_dim] float32, read from the runtime."""
        method = self.method._method  # executorch.runtime.Method wraps the binding, which reads named buffers
        return tuple(method.get_attribute(f"{part}_cache_{layer}")[0, :, :rows].numpy().astype("float32")
                     for part in ("key", "value"))


def serve(request: dict, folder: Path, out: Path) -> dict:
    import numpy as np

    model = folder / "model"
    manifest = read_manifest(model)
    try:
        tokens = np.load(folder / "tokens.npy", allow_pickle=False).astype(np.int64).reshape(-1)
    except (OSError, ValueError) as e:
        die(2, f"{folder}/tokens.npy is not readable: {e}")
    if tokens.size == 0 or tokens.min() < 0 or tokens.max() >= manifest["model"]["vocab"]:
        die(2, f"tokens.npy holds ids outside 0..{manifest['model']['vocab'] - 1}")
    technique, past, chunk, mode, at = check(request, manifest, int(tokens.size))
    calls = plan(technique, int(tokens.size), past, chunk, mode)
    engine = Engine(model, manifest, int(request.get("threads") or 1))
    logits = np.zeros((len(at), manifest["model"]["vocab"]), np.float32)
    bench = request.get("bench") or {}
    reps, warmup = int(bench.get("reps", 0) or 0), int(bench.get("warmup", 0) or 0)
    timed = []
    for call in calls:
        rows, wall, cpu = engine.run(tokens[call.start:call.start + call.real], call.start, call.rows)
        for i, position in enumerate(at):
            if call.start <= position < call.start + call.real:
                logits[i] = rows[position - call.start]
        if not reps:
            timed.append({"name": call.name, "rows": call.real, "wall_s": wall, "cpu_s": cpu, "counted": False})
    end = int(tokens.size)
    if technique == "chunk_prefill":
        (out / "cache").mkdir()
        for layer in range(manifest["model"]["layers"]):
            k, v = engine.cache(layer, end)
            np.save(out / "cache" / f"k_{layer}.npy", k)
            np.save(out / "cache" / f"v_{layer}.npy", v)
    if request.get("state"):
        with open(out / "state.bin", "wb") as f:
            for layer in range(manifest["model"]["layers"]):
                for part in engine.cache(layer, end):
                    f.write(np.ascontiguousarray(part).tobytes())
    utterance = [c for c in calls if c.name != "past"]
    for r in range(-warmup, reps):
        for call in utterance:
            _, wall, cpu = engine.run(tokens[call.start:call.start + call.real], call.start, call.rows)
            if r >= 0:
                timed.append({"name": call.name, "rows": call.real, "wall_s": wall, "cpu_s": cpu, "counted": False})
    np.save(out / "logits.npy", logits)
    return {"contract": CONTRACT, "calls": timed, "marks": [], "reps": max(reps, 1), "load": engine.load,
            "device_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "engine": {"name": ENGINE, "version": manifest["versions"]["executorch"],
                       "source_hash": manifest["artifact_sha256"], "delegate": manifest.get("delegate"),
                       "threads": int(request.get("threads") or 1)}}


def respond(out: Path, status: dict, timings: dict) -> None:
    (out / "timings.json").write_text(json.dumps(timings) + "\n")
    (out / "status.json").write_text(json.dumps(status) + "\n")  # last: a response is ok only when complete


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        die(2, "usage: adapter.py REQUEST_DIR RESPONSE_DIR (engine contract v1)")
    folder, out = Path(argv[0]), Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    request = read_request(folder)
    try:
        timings = serve(request, folder, out)
    except Refused as why:
        respond(out, {"contract": CONTRACT, "status": "refused", "reason": str(why)},
                {"contract": CONTRACT, "calls": [], "engine": {"name": ENGINE}})
        return 0
    except (RuntimeError, ValueError) as e:  # the runtime's own errors (a failed load or execute)
        die(4, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
    respond(out, {"contract": CONTRACT, "status": "ok"}, timings)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main(sys.argv[1:]))
