"""What the tests of the exported runtimes (engines/executorch, engines/litert, engines/mnn) share: a tiny Gemma 3
made and saved by transformers, its export by the engine's own export.py (cached by content under
.cache/engine-exports-tests/, so a second session exports nothing), and requests served by the engine's
adapter.py through testbed's own contract path (testbed.backends.engine.runner.call: the request folder
pushed to the host device, the response pulled and validated strictly before a test reads it).

The references are independent of every runtime: transformers' forward over the whole sequence (eager
attention, float32) and testbed's refimpl reading the same Hugging Face folder.

Until the exporter-based engine kind is merged (yaml `export:`, the export cache, testbed exporting the
checkpoint before the first request), `testbed run ... backend=engine engine=NAME` cannot load these yamls;
the tests that go through it are marked with NEEDS_EXPORT_MECHANISM, which lifts itself once the schema
knows the key.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import yaml

from refimpl import gemma
from testbed.backends.engine import spec as engine_spec
from testbed.backends.engine.runner import Expect, Request, Response, call
from testbed.config import project_path
from testbed.models import checkpoints
from testbed.oracles.numerical import nmse

ENGINES = Path(__file__).resolve().parents[1] / "engines"
EXPORT_CACHE = ".cache/engine-exports-tests"

NEEDS_EXPORT_MECHANISM = pytest.mark.skipif(
    "export" not in engine_spec.schema()["properties"],
    reason="needs the exporter-based engine kind (engines/NAME.yaml `export:`, the export cache): not on this branch")

# test_llamacpp_models' shape: sliding window 8 (every sequence here is longer: the local layers drop keys),
# a local RoPE base of 100 and linear scaling on the global layers, randomised (1 + w) norm weights.
SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=16)
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5_000.0}}
# float32 end to end, but another engine's kernels (XNNPACK's, TFLite's) sum in other orders than torch's
TOLERANCE = 1e-6


@dataclass
class Model:
    """A transformers-made Gemma 3: its folder, transformers' model, and testbed's reading of the folder."""

    folder: Path
    hf: object
    vocab: int
    layers: int
    kv_heads: int
    head_dim: int

    def transformers_logits(self, tokens) -> np.ndarray:
        import torch

        with torch.no_grad():
            return self.hf(torch.tensor(np.asarray(tokens, np.int64))[None]).logits[0, -1].numpy()

    def transformers_cache(self, tokens) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per layer K and V [kv_heads, rows, head_dim] as transformers keeps them (a sliding layer its last
        window - 1 rows)."""
        import torch

        with torch.no_grad():
            out = self.hf(torch.tensor(np.asarray(tokens, np.int64))[None], use_cache=True)
        layers = out.past_key_values.layers
        return [la.keys[0].numpy() for la in layers], [la.values[0].numpy() for la in layers]

    def refimpl_logits(self, tokens, position: int) -> np.ndarray:
        cfg, w = checkpoints.load_checkpoint(self.folder)
        return gemma.redecode(w, cfg, np.asarray(tokens), position)

    def expect(self) -> Expect:
        return Expect(self.vocab, self.layers, self.kv_heads, self.head_dim)


def make_gemma3(folder: Path, seed: int = 1, rope: dict | None = ROPE, **shape) -> Model:
    """A Gemma 3 with random weights, saved by transformers itself (deterministic in `seed`: the same bytes
    every session, so its export is cached); rope=None leaves Gemma 3's default RoPE."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(**{**SHAPE, **shape}, attn_implementation="eager",
                              **({"rope_parameters": json.loads(json.dumps(rope))} if rope else {}))
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)  # a (1 + w) slip must show
    model.save_pretrained(folder)
    return Model(folder, model, config.vocab_size, config.num_hidden_layers, config.num_key_value_heads,
                 config.head_dim)


def prompt(model: Model, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(4, model.vocab, n).astype(np.int32)


def yaml_of(name: str) -> dict:
    return yaml.safe_load((ENGINES / f"{name}.yaml").read_text())


def folder_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(Path(folder).iterdir()):
        if p.is_file():
            h.update(p.name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def export(name: str, folder: Path, options: dict | None = None, timeout: float = 3600) -> Path:
    """engines/NAME/export.py run on `folder` as the yaml's export.command says (with `options` filling its
    request keys, e.g. chunk), once per content: the folder's bytes, export.py's, the command, and the
    versions of the extra's modules."""
    spec = yaml_of(name)["export"]
    source = ENGINES / yaml_of(name)["source"]
    options = {key: str(value) for key, value in (options or {}).items()}  # as the command line spells them
    versions = {m: metadata.version(m) for m in spec["modules"]}
    key = hashlib.sha256(json.dumps([folder_digest(folder), hashlib.sha256((source / "export.py").read_bytes()).hexdigest(),
                                     spec["command"], options, versions], sort_keys=True).encode()).hexdigest()[:20]
    out = project_path(EXPORT_CACHE) / f"{name}-{key}"
    if (out / "manifest.json").is_file():
        return out
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    fill = {"python": sys.executable, "source": str(source), "model": str(folder), "out": str(tmp), **options}
    argv = [part.format(**fill) for part in spec["command"]]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise AssertionError(f"{name} export exited {result.returncode}: {result.stderr.strip().splitlines()[-3:]}")
    try:
        tmp.rename(out)
    except OSError:  # another session exported the same content first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def spec_of(name: str, program: Path | None = None) -> engine_spec.EngineSpec:
    """The yaml as testbed reads it, without the `export:` section (which this branch's schema does not know):
    what runner.call needs to run the adapter."""
    data = yaml_of(name)
    path = ENGINES / f"{name}.yaml"
    supports = data["supports"]
    program = program or (path.parent / data["build"]["prebuilt"]["host"]).resolve()
    return engine_spec.EngineSpec(
        name=data["name"], path=path, yaml_sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
        description=data.get("description", ""), source=(path.parent / data["source"]).resolve(), command=None,
        prebuilt={"host": program}, program=program.name, abis=tuple(data["abis"]),
        techniques=tuple(supports["techniques"]), model_formats=tuple(supports["model_formats"]),
        weights=tuple(supports["weights"]), cache=tuple(supports["cache"]), invoke=tuple(data["invoke"]),
        timeout_s=float(data["timeout_s"]), counts=data["counts"])


def serve(device, spec: engine_spec.EngineSpec, exported: Path, model: Model, tokens, *, technique="chunk_prefill",
          past=0, chunk=1, logits_at=None, tail="none", cache=None, state=False, weights="f32", bench=None,
          program: Path | None = None) -> Response:
    """One request through testbed's contract path: the adapter (or a patched copy, `program`) on `device`."""
    tokens = np.asarray(tokens, np.int32)
    request = Request(technique, tokens, exported, "hf", weights, {}, past, chunk,
                      logits_at if logits_at is not None else [len(tokens) - 1], tail,
                      cache or {"dtype": "float32", "window": 0, "sink": 0}, state, 1, bench)
    return call(device, spec, request, model.expect(), program or spec.prebuilt["host"])


def patched(adapter: Path, folder: Path, old: str, new: str) -> Path:
    """A copy of `adapter` with one line changed (a planted fault): the line must occur exactly once, so a
    change to the adapter that moves it fails here rather than planting nothing."""
    text = adapter.read_text()
    assert text.count(old) == 1, f"{adapter.name} no longer holds {old!r} once: update the planted fault"
    out = folder / adapter.name
    out.write_text(text.replace(old, new))
    out.chmod(0o755)
    return out


def judge_token(theirs: np.ndarray, model: Model, tokens, position: int) -> list[str]:
    """What is wrong with an engine's logits row at `position` (nothing: []): its argmax against transformers',
    and its NMSE against both references, which must agree with each other first."""
    seen = np.asarray(tokens)[:position + 1]
    hf, ref = model.transformers_logits(seen), model.refimpl_logits(seen, position)
    problems = []
    if int(np.argmax(ref)) != int(np.argmax(hf)):
        problems.append(f"the references disagree: refimpl {np.argmax(ref)}, transformers {np.argmax(hf)}")
    if int(np.argmax(theirs)) != int(np.argmax(hf)):
        problems.append(f"token {np.argmax(theirs)} != transformers' {np.argmax(hf)}")
    error = nmse(hf[None], theirs[None])
    if not error < TOLERANCE:
        problems.append(f"NMSE {error:.3g} against transformers (tolerance {TOLERANCE:g})")
    return problems


def transformers_token(model: Model, args: list[str], real: int) -> int:
    """T for `testbed run chunk_prefill ... model.expected_token=T`: transformers' argmax at position real - 1 of
    the prompt the run itself will use (testbed's run_prompt for these arguments)."""
    from testbed import config
    from testbed.experiments.chunk_prefill import run_prompt

    cfg = config.load(["experiment=chunk_prefill", *args]).cfg
    shape, _ = checkpoints.load_checkpoint(model.folder)
    return int(np.argmax(model.transformers_logits(run_prompt(cfg, shape).ids[:real])))
