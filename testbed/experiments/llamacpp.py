"""Experiment `llamacpp`: llama.cpp's tools on a device (seed 002's gate and figure).

test   test-backend-ops -o OP -b BACKEND [-p CASES]: one verdict per case and the run's tally ("36/36 OK");
       for GATED_DELTA_NET with tools testbed built, also ggml's op run on the device by tb_ggml_gdn
       and judged by testbed's float64 reference (testbed.backends.llamacpp.ggml_gdn: the oracle
       `-b CPU` lacks, since it compares ggml's CPU backend with itself)
perf   test-backend-ops perf: us/run and GB/s per case (the tool's means; about a second of CPU time
       per case, so an emulated device is given a few with `cases=REGEX`)
bench  llama-bench -p 512: prompt tokens per second (pp512) over its repetitions
logits llama.cpp's logits for a Gemma 3 or Qwen3.5 hybrid GGUF (gguf=, a file on this host, pushed once
       per content; `testbed gguf DIR` writes one from a Hugging Face folder), computed on the device by
       libllama (tb_llama_logits) at every position of a seeded prompt, and judged against refimpl.gemma or
       refimpl.qwen35 on the model read from `checkpoint=DIR`, the Hugging Face folder the GGUF was made
       from (so a field the file lost, a query scale or a layer pattern llama.cpp's converter drops, fails),
       or without one from testbed's own reading of the same file (testbed.models.gguf_files.load_gguf,
       which reads as llama.cpp reads: the file is then judged against itself, and the record says so): a
       third reference beside transformers, which shares neither loader nor graph with testbed. Not part
       of `all`: it builds libllama (minutes, once per source and target).

Where the tools come from (testbed.backends.llamacpp.build): `llamacpp.build=auto` (the default)
uses the profile's `tools` and builds them from source for the device's ABI when it names none;
`true` always builds, `false` never. `llamacpp.source=PATH` builds a llama.cpp tree; empty, the
llama.cpp vendored by the llama-cpp-python sdist (downloaded by pip once).

  testbed run llamacpp device=qemu-aarch64 gguf=model.gguf   # built for aarch64, run under qemu
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pandas as pd
from omegaconf import DictConfig

from testbed.backends.llamacpp import build as builder, ggml_gdn, models, runner as llamacpp
from testbed.config import Choice, Float, Int
from testbed.errors import UsageError
from testbed.oracles.numerical import check_nmse
from testbed.report import tables
from testbed.results import Record
from testbed.verdicts import Tally


@dataclass(frozen=True)
class Regex:
    """A regular expression (test-backend-ops -p matches it against each case's parameters), or empty."""

    def check(self, key: str, value: Any) -> None:
        try:
            re.compile(value)
        except (re.error, TypeError):
            raise UsageError(f"{key}={value!r} is not accepted; accepted: a regular expression over the case "
                             f"parameters (e.g. 'n_seq_tokens=1,'), or empty for every case") from None


@dataclass(frozen=True)
class Source:
    """A llama.cpp tree's path, or empty for the sdist's."""

    def check(self, key: str, value: Any) -> None:
        if value is None or value == "":
            return
        if not isinstance(value, str):
            raise UsageError(f"{key}={value!r} is not accepted; accepted: a llama.cpp tree's path, or empty")
        builder.resolve_source(value)  # raises, naming what a tree must hold


@dataclass(frozen=True)
class Name:
    """An op or backend name as the tool spells it (letters, digits, underscore), or empty."""

    def check(self, key: str, value: Any) -> None:
        if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9_]*", value):
            raise UsageError(f"{key}={value!r} is not accepted; accepted: a name of letters, digits and _")


PARAMS = {
    "mode": Choice(("test", "perf", "bench", "logits", "all")),
    "op": Name(),
    "backend": Name(),
    "cases": Regex(),
    "prompt": Int(1, 1 << 16),
    "threads": Int(0, 256),
    "reps": Int(1, 100),
    "logits.tokens": Int(1, 4096),
    "logits.nmse": Float(0.0, 1.0),
    "llamacpp.build": Choice(llamacpp.BUILD),
    "llamacpp.source": Source(),
}


def needed_tools(cfg: DictConfig) -> list[str]:
    return (["test-backend-ops"] if cfg.mode in ("test", "perf", "all") else []) + \
           (["llama-bench"] if cfg.mode in ("bench", "all") and cfg.gguf else []) + \
           (["tb_llama_logits"] if cfg.mode == "logits" else [])


def validate(cfg: DictConfig) -> None:
    """Before connecting: the device has the tools this mode runs, or they can be built for it."""
    tools = cfg.device.get("tools") or {}
    build = cfg.llamacpp.build
    if cfg.mode == "logits":
        if not cfg.gguf or not Path(str(cfg.gguf)).is_file():
            raise UsageError(f"gguf={cfg.gguf!r} is not accepted with mode=logits; accepted: a Gemma 3 or Qwen3.5 GGUF file "
                             "on this host (it is pushed to the device)")
        if cfg.get("checkpoint") and not (Path(str(cfg.checkpoint)) / "config.json").is_file():
            raise UsageError(f"checkpoint={cfg.checkpoint!r} is not accepted; accepted: the Hugging Face folder the "
                             "GGUF was made from (config.json and *.safetensors), or empty")
        if build is False:
            raise UsageError("mode=logits runs testbed's own tb_llama_logits, which is only built from source; "
                             "accepted: llamacpp.build=auto or true")
    if not llamacpp.wants_build(build, bool(tools.get("test-backend-ops"))):
        missing = [t for t in needed_tools(cfg) if not tools.get(t)]
        if missing:
            raise UsageError(f"device={cfg.device.name} has no tools.{missing[0]} in devices/{cfg.device.name}.yaml "
                             f"and llamacpp.build={str(build).lower()}; accepted: llamacpp.build=auto or true, or "
                             f"the path in the profile")
        return
    try:
        target = builder.target_for(cfg.device.name, cfg.device.abi, cfg.device.get("capabilities"))
        builder.cmake_options(target)
    except builder.BuildError as e:
        raise UsageError(f"device={cfg.device.name} has no tools.test-backend-ops in devices/{cfg.device.name}.yaml "
                         f"and they cannot be built for it: {e}") from None


def run(cfg: DictConfig, ctx) -> Iterator[Record]:
    device = ctx.device
    backend = cfg.backend or device.profile.accelerators.get("backend") or "CPU"
    reference = cfg.op == "GATED_DELTA_NET" and cfg.mode in ("test", "all")
    programs = tuple(needed_tools(cfg)) + (("tb_ggml_gdn",) if reference else ())
    tools = llamacpp.resolve_tools(device, cfg.llamacpp.build, cfg.llamacpp.source or "", programs, ctx.progress)
    for record in records(cfg, ctx, backend, tools, reference):
        record.artifacts.update(tools.artifacts())  # which llama.cpp: compared forks differ here
        yield record


def records(cfg: DictConfig, ctx, backend: str, tools: llamacpp.Tools, reference: bool) -> Iterator[Record]:
    device = ctx.device
    if cfg.mode in ("test", "all"):
        ctx.progress(f"test-backend-ops -o {cfg.op} -b {backend}")
        report, problems = llamacpp.test_backend_ops(device, cfg.op, backend, tools, cfg.cases)
        yield from llamacpp.test_records("llamacpp", cfg.op, backend, report, problems)
        if reference and tools.built:
            from testbed.experiments.gdn import AWKWARD_CASES, TBO_CASES

            yield from ggml_gdn.oracle_records("llamacpp", device, tools.built.program("tb_ggml_gdn"),
                                               TBO_CASES + AWKWARD_CASES, cfg.seed, progress=ctx.progress)
    if cfg.mode in ("perf", "all"):
        ctx.progress(f"test-backend-ops perf -o {cfg.op} -b {backend}")
        yield from llamacpp.perf_records(device, "llamacpp", cfg.op, backend, tools, cfg.cases)
    if cfg.mode == "logits":
        yield from logits_records(cfg, ctx, tools)
    if cfg.mode in ("bench", "all") and cfg.gguf:
        threads = cfg.threads or max(device.profile.threads)
        ctx.progress(f"llama-bench -p {cfg.prompt} -t {threads}")
        yield from llamacpp.llama_bench_records(device, "llamacpp", cfg.gguf, cfg.prompt, threads, cfg.reps, tools)


def reference_logits(model, weights, tokens, read_by: str) -> tuple[np.ndarray, str]:
    """refimpl's logits at every position for a model (Gemma 3 or the Qwen3.5 hybrid) read by `read_by`, and
    what computed them."""
    from refimpl import gemma, qwen35

    if isinstance(model, qwen35.HybridConfig):
        return qwen35.redecode(weights, model, tokens)[0], f"{read_by} + refimpl.qwen35.redecode (float32, serial GDN)"
    return np.stack([gemma.redecode(weights, model, tokens, p) for p in range(len(tokens))]), \
        f"{read_by} + refimpl.gemma.redecode (float32)"


def reference_model(cfg: DictConfig):
    """(config, weights, what read them): the Hugging Face folder given (never the GGUF llama.cpp reads beside
    it), else testbed's reading of the GGUF itself."""
    from testbed.models.gguf_files import family, load_gguf

    if cfg.get("checkpoint"):
        module, _ = family(Path(str(cfg.checkpoint)))
        model, weights = module.load_hf_folder(cfg.checkpoint)
        return model, weights, f"{module.__name__}.load_hf_folder({cfg.checkpoint})"
    model, weights = load_gguf(cfg.gguf)  # gemma3 or qwen35; any other architecture is refused, naming it
    return model, weights, (f"testbed.models.gguf_files.load_gguf({cfg.gguf}): the GGUF judged against itself (a "
                            "field it lost is lost on both sides; checkpoint=DIR reads the folder it was made from)")


def logits_records(cfg: DictConfig, ctx, tools: llamacpp.Tools) -> Iterator[Record]:
    """One oracle record: llama.cpp's logits on the device against refimpl's for the same model."""
    model, weights, read_by = reference_model(cfg)
    tokens = np.random.default_rng(cfg.seed).integers(0, model.vocab, cfg.logits.tokens)
    ctx.progress(f"llama.cpp's logits for {len(tokens)} tokens of {Path(cfg.gguf).name} on {ctx.device.name}")
    theirs, evidence = models.logits(ctx.device, tools.built, Path(cfg.gguf), tokens)
    ctx.progress("refimpl's logits for the same tokens (every position redecoded)")
    ours, reference = reference_logits(model, weights, tokens, read_by)
    v = check_nmse({"logits": ours}, {"logits": theirs}, cfg.logits.nmse)
    agreement = float(np.mean(ours.argmax(-1) == theirs.argmax(-1))) if theirs.shape == ours.shape else 0.0
    yield Record("llamacpp", f"logits/T={len(tokens)}", "oracle", "llama.cpp logits", v.verdict, v.margin,
                 {**v.metrics, "argmax_agreement": agreement},
                 params={"gguf": str(cfg.gguf), "tokens": len(tokens), "reference": reference,
                         **({"checkpoint": str(cfg.checkpoint)} if cfg.get("checkpoint") else {})},
                 detail=v.detail, evidence=[evidence])


def view(df: pd.DataFrame) -> pd.DataFrame:
    """Tallies, llama.cpp's logits verdicts and failing cases, then figures: us/run and GB/s per perf
    case, tokens/s per bench."""
    rows = []
    for _, r in df.iterrows():
        if r["kind"] == "oracle" and r.get("oracle") == "llama.cpp logits":
            error, agree = r.get("metrics.nmse"), r.get("metrics.argmax_agreement")
            rows.append({"device": r["device"], "case": r["case"], "verdict": r["verdict"],
                         "result": (f"NMSE {error:.3g} against refimpl" if pd.notna(error) else r.get("detail"))
                         + (f", argmax agrees at {agree:.0%} of positions" if pd.notna(agree) else "")})
        elif r["kind"] == "oracle" and (r["case"].endswith("/tally") or r["verdict"] != "pass"):
            rows.append({"device": r["device"], "case": r["case"], "verdict": r["verdict"],
                         "result": r["metrics.tally"] if r["case"].endswith("/tally") else r.get("detail")})
        elif r["kind"] == "measure":  # figures as numbers, each in its own column
            rows.append({"device": r["device"], "case": r["case"], "verdict": "",
                         "tokens/s": r.get("figures.tokens_per_s.median"), "us/run": r.get("figures.time.median"),
                         "GB/s": r.get("figures.bandwidth.median"), "samples": tables.samples(r)})
    return pd.DataFrame(rows)


def sweep_row(df: pd.DataFrame) -> dict:
    """One job of a sweep; over sources it compares forks side by side:
    `testbed sweep experiment=llamacpp device=qemu-aarch64 llamacpp.source=UPSTREAM,PATCHED` gives per
    fork the harness' tally, testbed's reference verdicts on ggml's op, and us/run per perf case.
    Whether a change is beyond noise takes several runs a side: `testbed compare llamacpp.source=UPSTREAM
    llamacpp.source=PATCHED` judges every figure over the stored runs of each."""
    row = {}
    oracles = df[df["kind"] == "oracle"]
    tally = oracles[oracles["case"].str.endswith("/tally")]
    if len(tally):
        row["test-backend-ops"] = tally["metrics.tally"].iloc[0]
    ours = oracles[oracles["oracle"] == "nmse"]
    if len(ours):
        row["testbed reference"] = Tally(ours["verdict"]).phrase()
    for _, r in df[df["case"].str.endswith("/perf")].iterrows():
        row[f"us/run {r['params.params']}"] = r["figures.time.median"]
    if "figures.tokens_per_s.median" in df:
        for _, r in df[df["figures.tokens_per_s.median"].notna()].iterrows():
            row[f"{r['case']} tokens/s"] = round(float(r["figures.tokens_per_s.median"]), 1)
    return row
