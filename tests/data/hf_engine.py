"""An engine under test in Python (engine contract v1, README "Engine under test"): Hugging Face transformers
reading the Hugging Face folder testbed hands it, serving chunk_prefill with transformers' own KV cache.

    python3 hf_engine.py REQUEST_DIR RESPONSE_DIR

A lab's yaml for it (tests/test_hf_engine.py writes one):

    name: hf-transformers
    contract: 1
    build: {prebuilt: {host: hf_engine.py}}    # relative to the yaml's folder
    program: hf_engine.py
    abis: [host]
    supports: {techniques: [chunk_prefill], model_formats: [hf]}
    invoke: [python3, "{program}", "{request}", "{response}"]
    counts: process

The plan is the contract's: tokens[0:past] in calls of at most `chunk` rows, then tokens[past:n_tokens] in
calls of `chunk` rows (the last one as long as it is: tail.mode none), each call continuing transformers'
cache (DynamicCache: a sliding layer keeps what its window needs) at its positions; logits.npy holds the
rows at logits_at; bench={reps, warmup} runs the plan again that many times. The cache is not exposed
(its sliding layers keep a window, not every row), so testbed's cache oracle reads "not supported".
Anything else (another technique, a tail mode, a cache dtype but float32, a sink, a model format but hf)
is refused in its own words. Only the standard library, numpy, torch and transformers.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the folder is all there is


def respond(out: Path, status: dict, calls: list[dict]) -> None:
    """timings.json first, status.json last: a run that dies before the end leaves no "ok" behind."""
    timings = {"contract": 1, "calls": calls, "marks": [], "reps": 1,
               "device_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "engine": {"name": "hf-transformers", "version": _version(), "source_hash": ""}}
    (out / "timings.json").write_text(json.dumps(timings))
    (out / "status.json").write_text(json.dumps({"contract": 1, **status}))


def _version() -> str:
    try:
        import transformers

        return f"transformers {transformers.__version__}"
    except ImportError:
        return "transformers (not installed)"


def refusal(request: dict) -> str | None:
    """Why this engine does not serve the request, or None."""
    if request["technique"] != "chunk_prefill":
        return f"technique={request['technique']}: this engine serves chunk_prefill"
    if request["model"]["format"] != "hf":
        return f"model.format={request['model']['format']}: this engine reads a Hugging Face folder"
    if request["tail"]["mode"] != "none":
        return f"tail.mode={request['tail']['mode']}: this engine runs the last call as it is (none)"
    cache = request["cache"]
    if cache.get("dtype") != "float32" or cache.get("sink", 0):
        return f"cache {cache}: this engine keeps transformers' float32 cache, without sink rows"
    return None


def serve(request_dir: Path, out: Path) -> None:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    request = json.loads((request_dir / "request.json").read_text())
    if request.get("contract") != 1:
        raise SystemExit(f"request.json: contract={request.get('contract')!r}; this engine speaks contract 1")
    if (why := refusal(request)) is not None:
        respond(out, {"status": "refused", "reason": why}, [])
        return
    tokens = np.load(request_dir / request["tokens"])
    past, chunk, at = int(request["past"]), int(request["chunk"]), [int(p) for p in request["logits_at"]]
    torch.set_num_threads(int(request.get("threads", 1)))
    model = AutoModelForCausalLM.from_pretrained(request_dir / request["model"]["file"], dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    logits = np.zeros((len(at), model.config.vocab_size), np.float32)
    calls = []
    bench = request.get("bench") or {}
    for _ in range(1 + int(bench.get("warmup", 0)) + int(bench.get("reps", 0))):  # the judged run, then the bench's
        cache = DynamicCache(config=model.config)
        prefill(model, cache, tokens, past, chunk, at, logits, calls)
    np.save(out / "logits.npy", logits)
    respond(out, {"status": "ok"}, calls)


def prefill(model, cache, tokens, past: int, chunk: int, at: list[int], logits, calls: list[dict]) -> None:
    """The past, then the rest, in calls of `chunk` rows, each continuing `cache`; the rows at `at` into logits."""
    import torch

    with torch.no_grad():
        start = 0
        while start < len(tokens):
            end = min(start + chunk, past if start < past else len(tokens))
            wall, cpu = time.perf_counter(), time.process_time()
            positions = torch.arange(start, end)
            result = model(torch.tensor(tokens[start:end], dtype=torch.long)[None], past_key_values=cache,
                           use_cache=True, cache_position=positions, position_ids=positions[None])
            for i, position in enumerate(at):
                if start <= position < end:
                    logits[i] = result.logits[0, position - start].numpy()
            calls.append({"name": "past" if start < past else "chunk", "rows": end - start,
                          "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu, "counted": False})
            start = end


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(f"usage: {sys.argv[0]} REQUEST_DIR RESPONSE_DIR (engine contract v1)")
    serve(Path(sys.argv[1]), Path(sys.argv[2]))
