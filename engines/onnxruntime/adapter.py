#!/usr/bin/env python3
"""ONNX Runtime behind engine contract v1 (README, "Engine under test"): what `engine=onnxruntime` runs.

    adapter.py REQUEST_DIR RESPONSE_DIR

request/model/ is export.py's output (request.json: model.format "hf", model.exported the engine's name): one
ONNX graph of the model with its past key/values as inputs and outputs, run by onnxruntime's CPU execution
provider. The adapter keeps the cache itself (per layer K and V [1, kv_heads, rows, head_dim], every row,
as numpy arrays), so a call's pad rows are removed by slicing what the graph returns.

technique=chunk_prefill  tokens[0:past] in calls of C rows, then tokens[past:n_tokens] in calls of C rows:
    every call is C rows, a partial one zero-padded to C (the seed's fixed-size chunk call) and its pad
    rows then dropped from the cache; with tail.mode scalar the last partial call's real rows go one
    decode step each instead. logits.npy: the rows at logits_at (the graph computes those rows' logits
    only, as seed 000's select vector picks one); cache/k_L.npy, v_L.npy: every row the cache holds.
technique=tail  the prompt from an empty cache in calls of C rows; the last partial chunk by tail.mode:
    padded (padded to C, the pad rows removed), none (its real rows in one unpadded call), scalar (one
    decode step per row). logits.npy: the first token's; state.bin (state=true): every layer's K then V
    rows (float32, the bytes as the cache holds them).
Refused (status.json "refused", in this engine's words): another technique, a model the exporter did not
export (its refused.json), weights or cache other than float32, a cache window other than the model's
sliding window (the window is in the graph's masks), attention sinks (no sink in the graph), a past with a
tail.
bench={reps, warmup}: the plan again warmup + reps times from an empty cache; each call is timed (wall
and process CPU seconds) and named past, chunk, decode (chunk_prefill) or prefill (tail: the whole
prompt).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

CONTRACT = 1


class Refused(Exception):
    """A request this engine does not serve: said in status.json, never a failure."""


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value) + "\n")


class Engine:
    """The exported graph on onnxruntime's CPU execution provider, and the cache it is fed."""

    def __init__(self, folder: Path, threads: int):
        import onnxruntime

        self.manifest = json.loads((folder / "export.json").read_text())
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = onnxruntime.InferenceSession(str(folder / self.manifest["file"]), options,
                                                    providers=["CPUExecutionProvider"])
        self.version = onnxruntime.__version__
        self.layers = int(self.manifest["layers"])
        self.calls: list[dict] = []
        self.clear()

    def clear(self) -> None:
        shape = (1, int(self.manifest["kv_heads"]), 0, int(self.manifest["head_dim"]))
        self.cache = [np.zeros(shape, np.float32) for _ in range(2 * self.layers)]

    @property
    def rows(self) -> int:
        return self.cache[0].shape[2]

    def call(self, name: str, tokens: np.ndarray, position: int, width: int, rows: list[int], timed: bool):
        """`tokens` as one call of `width` rows (zero-padded) at positions position.., appended to the
        cache; the pad rows are dropped after. Returns the logits of the call's `rows`."""
        real, kept = len(tokens), self.rows
        ids = np.zeros((1, width), np.int64)
        ids[0, :real] = tokens
        positions = np.arange(position, position + width, dtype=np.int64)[None]
        feeds = {"input_ids": ids, "position_ids": positions, "logits_rows": np.asarray(rows or [real - 1], np.int64),
                 **{name: kv for name, kv in zip(self.manifest["inputs"][3:], self.cache)}}
        wall, cpu = time.perf_counter(), time.process_time()
        out = self.session.run(None, feeds)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if timed:
            self.calls.append({"name": name, "rows": width, "wall_s": wall, "cpu_s": cpu, "counted": False})
        # the pad rows (past the call's real rows) never stay in the cache
        self.cache = [np.ascontiguousarray(kv[:, :, :kept + real]) for kv in out[1:]]
        return out[0][0, :len(rows)]

    def prefill(self, tokens: np.ndarray, past: int, chunk: int, mode: str, wanted: list[int], timed: bool,
                names=("past", "chunk")) -> dict[int, np.ndarray]:
        """tokens[0:past], then the rest, in calls of `chunk` rows; the last partial call as `mode` says
        (padded: zero-padded to C; none: its real rows unpadded; scalar: one row per call). Returns the
        logits of every position in `wanted`."""
        logits, n = {}, len(tokens)
        plan = [(s, min(s + chunk, past), names[0]) for s in range(0, past, chunk)] + \
               [(s, min(s + chunk, n), names[1]) for s in range(past, n, chunk)]
        for s, end, name in plan:
            last = end == n and end - s < chunk
            if last and mode == "scalar":
                for i in range(s, end):
                    at = [p for p in wanted if p == i]
                    logits |= dict(zip(at, self.call("decode", tokens[i:i + 1], i, 1, [0] * len(at), timed)))
                continue
            width = end - s if last and mode == "none" else chunk
            at = [p for p in wanted if s <= p < end]
            position = s                      # the call's first position: the rows before it are cached
            rows = [p - s for p in at]        # the call's rows whose logits are asked
            logits |= dict(zip(at, self.call(name, tokens[s:end], position, width, rows, timed)))
        return logits


def check(request: dict, folder: Path) -> None:
    """What this engine refuses, in its own words (Refused)."""
    technique = request.get("technique")
    if technique not in ("chunk_prefill", "tail"):
        raise Refused(f"technique={technique}: the onnxruntime engine serves chunk_prefill and tail (the Qwen3.5 "
                      "hybrid's recurrent state is not in its export)")
    model = request.get("model", {})
    if model.get("format") != "hf" or not model.get("exported"):
        raise Refused(f"model.format={model.get('format')}, exported={model.get('exported')}: the onnxruntime engine "
                      "reads export.py's export of a Hugging Face folder")
    if (folder / "refused.json").is_file():
        raise Refused(json.loads((folder / "refused.json").read_text())["reason"])
    if not (folder / "export.json").is_file():
        raise Refused("request/model/ holds no export.json: not export.py's export")
    if model.get("weights", "f32") != "f32":
        raise Refused(f"weights={model.get('weights')}: the export is float32")
    cache = request.get("cache") or {}
    if cache.get("dtype", "float32") != "float32":
        raise Refused(f"cache.dtype={cache.get('dtype')}: the graph's past and present key/values are float32")
    if cache.get("sink", 0):
        raise Refused(f"cache.sink={cache['sink']}: the exported graph's sliding window has no attention sinks")
    manifest = json.loads((folder / "export.json").read_text())
    local = "sliding_attention" in manifest["layer_types"]
    if technique == "tail" and local and cache.get("window") not in (None, 0, manifest["sliding_window"]):
        raise Refused(f"cache.window={cache['window']}: the exported graph's sliding window is the model's "
                      f"({manifest['sliding_window']}), fixed in its masks")
    if technique == "tail" and request.get("past", 0):
        raise Refused(f"past={request['past']}: the tail prefills a prompt from an empty cache")
    if request.get("tail", {}).get("mode", "none") not in ("none", "padded", "scalar"):
        raise Refused(f"tail.mode={request['tail']['mode']} is not one of none, padded, scalar")


def serve(request_dir: Path, response_dir: Path) -> None:
    request = json.loads((request_dir / "request.json").read_text())
    if request.get("contract") != CONTRACT:
        raise SystemExit(f"error: request.json: contract={request.get('contract')}, this engine speaks {CONTRACT}")
    folder = request_dir / request["model"]["file"]
    check(request, folder)
    tokens = np.load(request_dir / request["tokens"]).astype(np.int64)
    past, chunk = int(request.get("past", 0)), int(request["chunk"])
    wanted = [int(p) for p in request["logits_at"]]
    mode = request.get("tail", {}).get("mode", "none")
    engine = Engine(folder, int(request.get("threads", 1)))
    bench = request.get("bench") or {}
    names = ("past", "chunk") if request["technique"] == "chunk_prefill" else ("chunk", "chunk")
    timed_whole = request["technique"] == "tail"  # the tail's figure is the whole prefill

    def run(timed: bool) -> dict:
        wall, cpu = time.perf_counter(), time.process_time()
        logits = engine.prefill(tokens, past, chunk, mode, wanted, timed and not timed_whole, names)
        if timed and timed_whole:
            engine.calls.append({"name": "prefill", "rows": len(tokens), "wall_s": time.perf_counter() - wall,
                                 "cpu_s": time.process_time() - cpu, "counted": False})
        return logits

    logits = run(not bench)
    missing = [p for p in wanted if p not in logits]
    if missing:
        raise Refused(f"logits_at={missing}: positions outside the prompt's {len(tokens)} tokens")
    np.save(response_dir / "logits.npy", np.stack([logits[p] for p in wanted]).astype(np.float32))
    if request["technique"] == "chunk_prefill":
        (response_dir / "cache").mkdir(exist_ok=True)
        for i in range(engine.layers):
            for part, kv in (("k", engine.cache[2 * i]), ("v", engine.cache[2 * i + 1])):
                np.save(response_dir / "cache" / f"{part}_{i}.npy", np.ascontiguousarray(kv[0], np.float32))
    if request.get("state"):
        with open(response_dir / "state.bin", "wb") as f:
            for kv in engine.cache:
                f.write(np.ascontiguousarray(kv, np.float32).tobytes())
    for r in range(-int(bench.get("warmup", 0)), int(bench.get("reps", 0))):
        engine.clear()
        run(r >= 0)
    write_json(response_dir / "timings.json", {
        "contract": CONTRACT, "calls": engine.calls, "marks": [], "reps": 1,
        "device_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "engine": {"name": "onnxruntime", "version": engine.version, "provider": "CPUExecutionProvider",
                   "exporter": engine.manifest.get("exporter"), "export_versions": engine.manifest.get("versions")}})
    write_json(response_dir / "status.json", {"contract": CONTRACT, "status": "ok"})


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(f"usage: {argv[0]} REQUEST_DIR RESPONSE_DIR (engine contract v1)", file=sys.stderr)
        return 2
    request_dir, response_dir = Path(argv[1]), Path(argv[2])
    os.makedirs(response_dir, exist_ok=True)
    try:
        serve(request_dir, response_dir)
    except Refused as e:
        write_json(response_dir / "status.json", {"contract": CONTRACT, "status": "refused", "reason": str(e)})
        write_json(response_dir / "timings.json", {"contract": CONTRACT, "calls": [], "marks": [], "reps": 1,
                                                    "engine": {"name": "onnxruntime"}})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
