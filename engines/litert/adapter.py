#!/usr/bin/env python3
"""LiteRT behind engine contract v1 (README, "Engine under test"): export.py's model.tflite run by ai-edge-litert's
interpreter (TFLite's CPU kernels with XNNPACK), signature by signature, as LiteRT-LM drives such a model.

    adapter.py REQUEST_DIR RESPONSE_DIR

request/model/ is the export folder (model.tflite, manifest.json): signatures prefill_C (C rows: tokens, input_pos,
the causal mask [1, 1, C, N] built here, every layer's K/V in and out) for the chunk sizes it was exported with,
and decode (one row, with the logits). The K/V caches live here between calls (numpy arrays handed in and taken
back, as LiteRT-LM holds them), so they can be read: cache/ for chunk_prefill.

technique=chunk_prefill  tokens[0:past] in prefill_C calls ("past"), then tokens[past:L] ("chunk"), where L is the
    position logits_at asks for, then the token at L through decode ("decode"), whose logits are the row: the
    prefill signatures emit no logits (LiteRT-LM samples from decode), so this is how LiteRT gives the token at a
    position. A partial call is padded to C rows with zero tokens at the positions after it (LiteRT-LM's own
    padding); its pad rows lie past every later query and are overwritten before any query may see them. With
    chunk=1 every call is decode (the utterance's named "chunk"). logits_at must be one position.
technique=tail or hybrid: refused. A tail's reference is the last partial chunk appended unpadded; a fixed-size
    prefill signature cannot take it, and decode steps compute other bytes than a chunk (no byte-identical
    reference exists), so the rollback cannot be judged here. Weights or a cache other than float32, a chunk size
    without a prefill signature, or more positions than the cache holds: refused too.
bench={reps, warmup}: after the plan, its utterance calls run again warmup + reps times at the same positions,
    each from the cache the past left; only the reps are in timings.json. Without bench, every call is.
timings.json: each call's wall and CPU seconds around the signature runner's call (the interpreter's own
    invoke, with its input and output copies), its rows, and the model load.
Exit 2 bad request, 3 the runtime missing, 4 the runtime failed (stderr: one line); nothing is written as ok
unless every file is.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CONTRACT = 1
ENGINE = "litert"


class Refused(Exception):
    """The request asks for what this export cannot do: status "refused" with this reason."""


def die(code: int, message: str) -> None:
    print(f"litert adapter: {message}", file=sys.stderr)
    sys.exit(code)


@dataclass
class Call:
    name: str        # past | chunk | decode
    signature: str   # prefill_C | decode
    start: int       # first position
    real: int        # rows that are the sequence's
    rows: int        # rows the signature takes (real + pads)


def plan(end: int, past: int, chunk: int, prefill: dict) -> list[Call]:
    """The calls that put positions [0, end) in the cache and then run `end` through decode (with chunk=1, every
    call is decode: the utterance's, `end` included, are its calls of C = 1 row)."""
    if chunk == 1:
        return [Call("past" if s < past else "chunk", "decode", s, 1, 1) for s in range(end + 1)]
    calls = []
    for lo, hi, name in ((0, min(past, end), "past"), (past, end, "chunk")):
        calls += [Call(name, prefill[str(chunk)], s, min(chunk, hi - s), chunk) for s in range(lo, hi, chunk)]
    return calls + [Call("decode", "decode", end, 1, 1)]


def read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        die(2, f"{path} is not readable JSON ({e}){what}")
    if not isinstance(data, dict):
        die(2, f"{path} is not a JSON object{what}")
    return data


def check(request: dict, manifest: dict, n_tokens: int) -> tuple[int, int, int]:
    """(past, chunk, the position whose logits are asked), validated; what the export cannot serve raises Refused."""
    technique = request.get("technique")
    past, chunk = request.get("past", 0), request.get("chunk", 1)
    at = request.get("logits_at") or []
    for key, value in (("past", past), ("chunk", chunk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (key == "chunk"):
            die(2, f"request.json: {key}={value!r}; accepted: an integer >= {int(key == 'chunk')}")
    if not isinstance(at, list) or not at or \
            any(isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < n_tokens for p in at):
        die(2, f"request.json: logits_at={at!r}; accepted: positions 0..{n_tokens - 1}")
    if technique != "chunk_prefill":
        raise Refused(f"technique={technique}: LiteRT's prefill signatures take exactly C rows, so a tail's unpadded "
                      "reference cannot be computed and a rollback cannot be judged; this engine serves chunk_prefill")
    if (request.get("tail") or {}).get("mode", "none") != "none":
        raise Refused(f"tail.mode={request['tail']['mode']}: every partial call is padded to C rows here (the "
                      "signature's size); tail.mode none is the only plan")
    if len(at) != 1:
        raise Refused(f"logits_at={at}: LiteRT's prefill signatures emit no logits; one position, through decode")
    if request.get("model", {}).get("weights", "f32") != "f32":
        raise Refused(f"weights={request['model']['weights']}: this export is float32 (quantization_recipe none)")
    if (request.get("cache") or {}).get("dtype", "float32") != "float32":
        raise Refused(f"cache.dtype={request['cache']['dtype']}: the export's KV cache is float32")
    if request.get("state"):
        raise Refused("state=true: this adapter writes no state.bin (it serves chunk_prefill only)")
    if chunk > 1 and str(chunk) not in manifest["prefill"]:
        raise Refused(f"chunk={chunk}: the export has prefill signatures for C = "
                      f"{', '.join(sorted(manifest['prefill'], key=int))} (export.py --chunk)")
    end = at[0]
    reach = max(c.start + c.rows for c in plan(end, past, chunk, manifest["prefill"]))
    if reach > manifest["cache_length"]:
        raise Refused(f"the export's KV cache holds {manifest['cache_length']} positions; this request reaches "
                      f"position {reach - 1} (past={past}, logits_at={end}, chunk={chunk})")
    return past, chunk, end


class Engine:
    """model.tflite in ai-edge-litert's interpreter, and the K/V caches this adapter holds between calls."""

    def __init__(self, model: Path, manifest: dict, threads: int):
        try:
            import numpy as np
            from ai_edge_litert.interpreter import Interpreter
        except ImportError as e:
            die(3, f"ai-edge-litert is not installed ({e}); pip install 'testbed[litert]'")
        self.np, self.manifest = np, manifest
        wall, cpu = time.perf_counter(), time.process_time()
        interpreter = Interpreter(model_path=str(model / manifest["artifact"]), num_threads=threads)
        names = {manifest["decode"], *manifest["prefill"].values()}
        self.runners = {name: interpreter.get_signature_runner(name) for name in names}
        self.load = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}
        m, n = manifest["model"], manifest["cache_length"]
        self.k = [np.zeros((1, m["kv_heads"], n, m["head_dim"]), np.float32) for _ in range(m["layers"])]
        self.v = [np.zeros((1, m["kv_heads"], m["head_dim"], n), np.float32) for _ in range(m["layers"])]

    def run(self, call: Call, tokens):
        """One signature call: (its logits [vocab] or None, wall, cpu). The caches are replaced by its outputs."""
        np, n = self.np, self.manifest["cache_length"]
        ids = np.zeros((1, call.rows), np.int32)
        ids[0, :len(tokens)] = tokens
        positions = np.arange(call.start, call.start + call.rows, dtype=np.int32)
        mask = np.triu(np.full((call.rows, n), -np.inf, np.float32), k=call.start + 1)[None, None]  # causal
        inputs = {"tokens": ids, "input_pos": positions, "mask": mask}
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            inputs[f"kv_cache_k_{layer}"], inputs[f"kv_cache_v_{layer}"] = k, v
        wall, cpu = time.perf_counter(), time.process_time()
        out = self.runners[call.signature](**inputs)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        self.k = [out[f"kv_cache_k_{layer}"] for layer in range(len(self.k))]
        self.v = [out[f"kv_cache_v_{layer}"] for layer in range(len(self.v))]
        logits = out.get("logits")
        return (None if logits is None else logits.reshape(-1, logits.shape[-1])[-1]), wall, cpu

    def cache(self, layer: int, rows: int):
        """Layer `layer`'s K and V rows [0, rows) as [kv_heads, rows, head_dim]."""
        return (self.np.ascontiguousarray(self.k[layer][0, :, :rows]),
                self.np.ascontiguousarray(self.v[layer][0].transpose(0, 2, 1)[:, :rows]))


def serve(request: dict, folder: Path, out: Path) -> dict:
    import numpy as np

    model = folder / "model"
    manifest = read_json(model / "manifest.json", ": request/model/ must be engines/litert/export.py's output folder")
    if manifest.get("runtime") != ENGINE or not (model / str(manifest.get("artifact", ""))).is_file():
        die(2, f"{model}/manifest.json names runtime={manifest.get('runtime')!r}, artifact={manifest.get('artifact')!r}; "
               "expected a LiteRT export (model.tflite)")
    try:
        tokens = np.load(folder / "tokens.npy", allow_pickle=False).astype(np.int32).reshape(-1)
    except (OSError, ValueError) as e:
        die(2, f"{folder}/tokens.npy is not readable: {e}")
    if tokens.size == 0 or tokens.min() < 0 or tokens.max() >= manifest["model"]["vocab"]:
        die(2, f"tokens.npy holds ids outside 0..{manifest['model']['vocab'] - 1}")
    past, chunk, end = check(request, manifest, int(tokens.size))
    calls = plan(end, past, chunk, manifest["prefill"])
    engine = Engine(model, manifest, int(request.get("threads") or 1))
    bench = request.get("bench") or {}
    reps, warmup = int(bench.get("reps", 0) or 0), int(bench.get("warmup", 0) or 0)
    timed, row = [], None
    for call in calls:
        logits, wall, cpu = engine.run(call, tokens[call.start:call.start + call.real])
        if call is calls[-1]:
            row = logits
        if not reps:
            timed.append({"name": call.name, "rows": call.real, "wall_s": wall, "cpu_s": cpu, "counted": False})
    if row is None:
        die(4, f"the {manifest['decode']} signature returned no logits")
    (out / "cache").mkdir()
    for layer in range(manifest["model"]["layers"]):
        k, v = engine.cache(layer, end + 1)
        np.save(out / "cache" / f"k_{layer}.npy", k)
        np.save(out / "cache" / f"v_{layer}.npy", v)
    if reps:
        settled = (engine.k, engine.v)
        utterance = [c for c in calls if c.name != "past"]
        for r in range(-warmup, reps):
            engine.k, engine.v = settled  # the past's cache (the utterance rows are rewritten at their positions)
            for call in utterance:
                _, wall, cpu = engine.run(call, tokens[call.start:call.start + call.real])
                if r >= 0:
                    timed.append({"name": call.name, "rows": call.real, "wall_s": wall, "cpu_s": cpu, "counted": False})
    np.save(out / "logits.npy", row[None].astype(np.float32))
    return {"contract": CONTRACT, "calls": timed, "marks": [], "reps": max(reps, 1), "load": engine.load,
            "device_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "engine": {"name": ENGINE, "version": manifest["versions"]["ai-edge-litert"],
                       "source_hash": manifest["artifact_sha256"], "threads": int(request.get("threads") or 1)}}


def respond(out: Path, status: dict, timings: dict) -> None:
    (out / "timings.json").write_text(json.dumps(timings) + "\n")
    (out / "status.json").write_text(json.dumps(status) + "\n")  # last: a response is ok only when complete


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        die(2, "usage: adapter.py REQUEST_DIR RESPONSE_DIR (engine contract v1)")
    folder, out = Path(argv[0]), Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    request = read_json(folder / "request.json", "")
    if request.get("contract") != CONTRACT:
        die(2, f"request.json: contract={request.get('contract')!r}; this adapter speaks contract {CONTRACT}")
    try:
        timings = serve(request, folder, out)
    except Refused as why:
        respond(out, {"contract": CONTRACT, "status": "refused", "reason": str(why)},
                {"contract": CONTRACT, "calls": [], "engine": {"name": ENGINE}})
        return 0
    except (RuntimeError, ValueError) as e:  # the interpreter's own errors (a failed load or invoke)
        die(4, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
    respond(out, {"contract": CONTRACT, "status": "ok"}, timings)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
