"""Experiment `gdn`: Gated DeltaNet chunkwise prefill against the serial recurrence (seed 002).

oracle mode  every case of the shape matrix: the backend's serial and chunkwise outputs and states
             against the float64 serial reference, by NMSE (threshold 1e-7, test-backend-ops); the
             chunkwise ones also against the naive float64 recurrence (refimpl.naive_gdn, which
             shares no code with refimpl.gdn: its own loops and head map), form chunkwise-vs-naive;
             and bit-exact equality for a pure loop restructuring (the serial recurrence run as a
             loop of chunks carrying the state must not change a single bit).
bench mode   serial vs chunkwise at the benchmark shape (16 heads, head size 128 by default) for each
             token count, the forms' repetitions interleaved: time (wall and, for native, CPU),
             tokens/s, GFLOP/s on gdn_flops' serial count, GFLOP/s on the work each form really does
             (gdn_chunkwise_flops), and on the host the fraction of numpy's sgemm rate at the same
             thread count, timed between the kernel's repetitions.

Backends (testbed/backends/NAME/gdn.py; the device's default is the first its profile has):
refimpl (numpy, the host only); native (kernels/bench/tb_gdn_bench built for the device's ABI and run
there, `threads` splitting heads; its records carry the program's sha256, command and device time);
iree (the jax graphs compiled for `target`); llamacpp (llama.cpp's own op on a device with its tools:
test-backend-ops is then the oracle and its perf mode the measurement). The references and the
oracles always run here, on the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import pandas as pd
from omegaconf import DictConfig

from refimpl import gdn as ref
from refimpl.naive_gdn import naive_gdn
from testbed import backends
from testbed.backends.iree.artifacts import target_names
from testbed.config import Choice, Float, Int, IntList
from testbed.errors import UsageError
from testbed.heartbeat import steps
from testbed.measure import blas_reference, decisions
from testbed.oracles.numerical import check_bitexact, check_nmse
from testbed.report import tables
from testbed.results import Figure, Record
from testbed.verdicts import Tally

PARAMS = {
    "backend": Choice(("refimpl", "native", "iree", "llamacpp")),
    "threads": Int(1, 256),
    "target": Choice(tuple(target_names())),  # backend=iree; must fit the device (checked in validate)
    "mode": Choice(("oracle", "bench", "all")),
    "counts": Choice((False, True)),
    "chunk": Int(1, 4096),
    "head_map": Choice(ref.HEAD_MAPS),
    "threshold": Float(0.0, 1.0),
    "matrix": Choice(("tbo", "awkward", "all")),
    "max_tokens": Int(0, 1 << 16),
    "seed": Int(0),
    "bench.heads": Int(1, 256),
    "bench.head_size": Int(1, 1024),
    "bench.tokens": IntList(1, 1 << 16),
    "bench.kda": Choice((False, True)),
    "bench.reps": Int(1, 1000),
    "bench.warmup": Int(0, 100),
}
NAIVE_FORM = "chunkwise-vs-naive"  # the chunkwise result judged by the naive float64 recurrence


# --- the shape matrix ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One GATED_DELTA_NET shape, with test-backend-ops' parameter names."""

    head_count: int
    head_size: int
    n_seq_tokens: int
    n_seqs: int = 1
    v_repeat: int = 1
    permuted: bool = False
    kda: bool = False
    K: int = 1
    gate: str = "tbo"

    @property
    def name(self) -> str:
        return (
            f"H={self.head_count},hs={self.head_size},T={self.n_seq_tokens},seqs={self.n_seqs},"
            f"vr={self.v_repeat},perm={int(self.permuted)},kda={int(self.kda)},K={self.K},gate={self.gate}"
        )

    @property
    def tbo_params(self) -> str:
        """The case as test-backend-ops prints it: GATED_DELTA_NET(THIS)."""
        return (f"type=f32,head_count={self.head_count},head_size={self.head_size},n_seq_tokens={self.n_seq_tokens},"
                f"n_seqs={self.n_seqs},v_repeat={self.v_repeat},permuted={int(self.permuted)},kda={int(self.kda)},"
                f"K={self.K}")

    def inputs(self, seed: int) -> ref.GDNInputs:
        x = ref.draw_inputs(
            self.n_seqs, self.n_seq_tokens, self.head_count, self.head_size,
            v_repeat=self.v_repeat, kda=self.kda, gate=self.gate, seed=seed,
        )
        if self.permuted:
            # test-backend-ops builds q, k, v as [d, T, H, n_seqs] and permutes them: same logical
            # shape, non-contiguous memory. Rebuild ours the same way so strided access is exercised.
            def permuted(a):
                return np.swapaxes(np.ascontiguousarray(np.swapaxes(a, 1, 2)), 1, 2)

            x = ref.GDNInputs(permuted(x.q), permuted(x.k), permuted(x.v), x.g, x.beta, x.state)
        return x


# llama.cpp's 36 GATED_DELTA_NET cases, in its order:
# (head_count, head_size, n_seq_tokens, n_seqs, v_repeat, permuted, kda, K).
# tests/test_gdn.py checks this table against a real `test-backend-ops -o GATED_DELTA_NET` output.
TBO_CASES = [
    Case(*row)
    for row in [
        (32, 128, 1, 1, 1, 0, 0, 1), (32, 16, 1, 1, 1, 0, 0, 1), (32, 16, 1, 1, 1, 1, 1, 1),
        (32, 16, 1, 1, 1, 0, 1, 1), (16, 64, 1, 2, 1, 0, 0, 1), (4, 64, 4, 1, 1, 0, 0, 1),
        (4, 64, 4, 2, 1, 0, 0, 1), (8, 32, 4, 2, 2, 0, 0, 1), (4, 64, 4, 2, 1, 1, 0, 1),
        (4, 64, 4, 1, 1, 1, 0, 1), (4, 64, 1, 1, 1, 0, 1, 1), (4, 64, 1, 2, 1, 0, 1, 1),
        (4, 16, 1, 2, 1, 0, 1, 1), (4, 32, 4, 1, 1, 0, 1, 1), (4, 64, 4, 2, 1, 0, 1, 1),
        (8, 32, 4, 2, 2, 0, 1, 1), (4, 64, 4, 2, 1, 1, 1, 1), (4, 16, 4, 2, 1, 1, 1, 1),
        (4, 64, 64, 1, 1, 0, 0, 1), (4, 64, 127, 1, 1, 0, 0, 1), (4, 64, 256, 1, 1, 0, 0, 1),
        (4, 64, 65, 1, 1, 0, 0, 1), (4, 64, 100, 1, 1, 0, 0, 1), (4, 64, 200, 1, 1, 0, 0, 1),
        (4, 64, 127, 2, 1, 0, 0, 1), (4, 64, 64, 1, 1, 0, 1, 1), (4, 64, 33, 1, 1, 0, 1, 1),
        (4, 64, 100, 1, 1, 0, 1, 1), (4, 16, 2, 1, 1, 0, 0, 2), (4, 32, 4, 1, 1, 0, 0, 4),
        (4, 64, 4, 2, 1, 0, 0, 4), (8, 128, 4, 1, 1, 0, 0, 4), (4, 64, 4, 2, 1, 0, 1, 4),
        (8, 32, 4, 2, 2, 0, 1, 4), (4, 32, 8, 1, 1, 0, 0, 3), (4, 64, 16, 2, 1, 0, 0, 4),
    ]
]

# Lengths around chunk boundaries, with gates that keep the state alive (see refimpl.gdn.GATE_DRAWS),
# grouped value heads and both gate kinds.
AWKWARD_CASES = [
    Case(4, 32, t, n_seqs=1 + (t % 2), v_repeat=2, kda=kda, gate="mild")
    for t in (1, 15, 63, 65, 127, 300)
    for kda in (False, True)
]


def matrix(name: str) -> list[Case]:
    return {"tbo": TBO_CASES, "awkward": AWKWARD_CASES, "all": TBO_CASES + AWKWARD_CASES}[name]


def selected_cases(cfg: DictConfig) -> list[Case]:
    """The matrix's cases of at most max_tokens tokens (0: every case)."""
    return [c for c in matrix(cfg.matrix) if not cfg.max_tokens or c.n_seq_tokens <= cfg.max_tokens]


# --- backends --------------------------------------------------------------------------------------


def validate(cfg: DictConfig) -> None:
    """Before any work: llama.cpp's tools must be named by the profile; threads only mean something
    for the native kernels."""
    if cfg.backend == "llamacpp":
        from testbed.backends.llamacpp import build as builder

        if not (cfg.device.get("tools") or {}).get("test-backend-ops"):
            try:  # the tools are built for the device (testbed.backends.llamacpp.build)
                builder.cmake_options(builder.target_for(cfg.device.name, cfg.device.abi, cfg.device.get("capabilities")))
            except builder.BuildError as e:
                raise UsageError(f"backend=llamacpp runs llama.cpp's test-backend-ops on the device; device={cfg.device.name} "
                                 f"names no tools.test-backend-ops in devices/{cfg.device.name}.yaml and they cannot "
                                 f"be built for it: {e}") from None
    elif cfg.backend == "iree":  # a module for another kind of device is refused before anything compiles
        from testbed.backends.iree.device import check_target_fits
        from testbed.devices import load_profile

        check_target_fits(cfg.target, load_profile(cfg.device.name))
    if cfg.counts and cfg.backend != "native":
        raise UsageError(f"counts=true counts the native programs' instructions; backend={cfg.backend} runs none "
                         "(accepted: counts=true with backend=native)")
    if cfg.threads != 1 and cfg.backend == "refimpl":
        raise UsageError(f"threads={cfg.threads} needs backend=native or iree; backend=refimpl runs on one thread")


# --- run -------------------------------------------------------------------------------------------


def oracle_records(cfg: DictConfig, ctx, be) -> Iterator[Record]:
    cases = selected_cases(cfg)
    # the cases' work differs by 300x (1 to 300 tokens, head sizes 32 to 128): weighted progress
    said = steps([f"gdn oracle {i + 1}/{len(cases)} {case.name}" for i, case in enumerate(cases)],
                 [c.n_seqs * c.n_seq_tokens * c.head_count * c.v_repeat * c.head_size ** 2 for c in cases])
    for case, step in zip(cases, said):
        ctx.progress(step)
        x = case.inputs(cfg.seed)
        x64 = ref.GDNInputs(*(a.astype(np.float64) for a in x.arrays()))
        reference = ref.run_forms(lambda y: ref.gdn_serial(*y.arrays(), head_map=cfg.head_map), x64, case.K)
        params = {**case.__dict__, "chunk": cfg.chunk}
        results, evidence = {}, {}
        for form, fn in (("serial", be.serial), ("chunkwise", lambda y: be.chunkwise(y, cfg.chunk))):
            results[form] = ref.run_forms(fn, x, case.K)
            evidence[form] = be.evidence.take()
            v = check_nmse(reference, results[form], cfg.threshold)
            yield Record("gdn", f"{case.name}/{form}", "oracle", "nmse", v.verdict, v.margin,
                         v.metrics, params=params | {"form": form}, artifacts=dict(be.artifacts), detail=v.detail,
                         evidence=evidence[form])
        # The reference above is refimpl.gdn's own serial form: a bug there (a head map, a gate) is
        # shared by the refimpl backend and passes. The naive loops (refimpl.naive_gdn) share no code
        # with refimpl.gdn, so the chunkwise result is also judged against them.
        naive = ref.run_forms(lambda y: naive_gdn(*y.arrays(), head_map=cfg.head_map), x64, case.K)
        v = check_nmse(naive, results["chunkwise"], cfg.threshold)
        yield Record("gdn", f"{case.name}/{NAIVE_FORM}", "oracle", "nmse", v.verdict, v.margin,
                     v.metrics | {"reference": "refimpl.naive_gdn, float64"}, params=params | {"form": NAIVE_FORM},
                     artifacts=dict(be.artifacts), detail=v.detail and f"against the naive float64 recurrence: {v.detail}",
                     evidence=evidence["chunkwise"])
        if case.gate == "mild" or case.n_seq_tokens > cfg.chunk:
            whole = dict(zip(("out", "state"), be.serial(x)))
            looped = dict(zip(("out", "state"), be.serial_chunk_loop(x, cfg.chunk)))
            v = check_bitexact(whole, looped)
            yield Record("gdn", f"{case.name}/serial-chunk-loop", "oracle", "bitexact", v.verdict, v.margin,
                         v.metrics, params=params | {"form": "serial-chunk-loop"}, artifacts=dict(be.artifacts),
                         detail=v.detail, evidence=be.evidence.take())


SGEMM_SIZE = 512  # comparable to the chunk products at head size 128
PROBE_CASE = "machine_probe/sgemm"


def sgemm_clocks(threads: int) -> dict[str, float]:
    """One float32 512^3 matmul by numpy's BLAS on `threads` threads (threadpoolctl, user_api blas):
    the reference rate, timed between the kernel's repetitions so both see the same machine (load,
    clock, thermal state); wall and CPU seconds."""
    return _sgemm_timer(threads)()


@functools.lru_cache(maxsize=4)
def _sgemm_timer(threads: int):
    """The reference product loaded once into the reference process, per thread count, and repeated
    per timed call long enough for the CPU clock."""
    products, repeat = _sgemm_products()
    return blas_reference.products_timer(products, threads, repeat)


@functools.lru_cache(maxsize=1)
def _sgemm_products():
    """The product and how many times a timed call repeats it (long enough for the CPU clock)."""
    products = blas_reference.square_products(SGEMM_SIZE)
    return products, blas_reference.repeats_for(products)


def sgemm_between(threads: int, samples: dict[str, list[float]]) -> Callable[[], None]:
    """What runs between the kernel's repetitions: the sgemm on `threads` threads and, for the
    spinning rule, on one thread; seconds appended to samples[wall|cpu|cpu_1thread]."""
    def between() -> None:
        clocks = sgemm_clocks(threads)
        samples.setdefault("wall", []).append(clocks["wall"])
        samples.setdefault("cpu", []).append(clocks["cpu"])
        samples.setdefault("cpu_1thread", []).append(sgemm_clocks(1)["cpu"] if threads > 1 else clocks["cpu"])
    return between


def bench_records(cfg: DictConfig, ctx, be) -> Iterator[Record]:
    b = cfg.bench
    # numpy's sgemm is a reference rate only where the kernels ran: this host, not under emulation
    here = ctx.device.profile.transport == "local" and not ctx.device.profile.has("emulated")
    probe_s: list[float] = []  # every sgemm of the run: the machine probe, stored once (testbed.measure.history)
    for i, t_len in enumerate(b.tokens):
        ctx.progress(f"gdn bench {i + 1}/{len(b.tokens)} H={b.heads} hs={b.head_size} T={t_len}")
        x = ref.draw_inputs(1, t_len, b.heads, b.head_size, kda=b.kda, seed=cfg.seed)
        sgemm_s: dict[str, list[float]] = {}
        times = be.bench(x, cfg.chunk, b.reps, b.warmup,
                         between=sgemm_between(cfg.threads, sgemm_s) if here else None,
                         **({"count": True} if cfg.counts else {}))
        probe_s += sgemm_s.get("wall", [])
        sgemm = Figure.of(sgemm_s["wall"], "s").rate(2.0 * SGEMM_SIZE**3, "FLOP/s") if sgemm_s else None
        sgemm_cpu = Figure.of(sgemm_s["cpu"], "s").rate(2.0 * SGEMM_SIZE**3, "FLOP/s") if sgemm_s else None
        spin = (blas_reference.spinning(float(np.median(sgemm_s["cpu"])), float(np.median(sgemm_s["cpu_1thread"])),
                                        cfg.threads) | blas_reference.kernel_rule(blas_reference.blas_info(cfg.threads))
                if sgemm_s else {})
        refused = blas_reference.refusal(spin, cfg.threads)
        if refused:
            ctx.progress(f"gdn bench T={t_len}: sgemm_fraction {refused}")
        flops = ref.gdn_flops(1, t_len, b.heads, b.head_size, b.kda)
        form_flops = {"serial": flops,
                      "chunkwise": ref.gdn_chunkwise_flops(1, t_len, b.heads, b.head_size, cfg.chunk, b.kda)}
        case = f"H={b.heads},hs={b.head_size},T={t_len},kda={int(b.kda)}"
        evidence = be.evidence.take()
        for form in ("serial", "chunkwise"):
            t = times[form]
            gflops = t.rate(flops / 1e9, "GFLOP/s")
            done = t.rate(form_flops[form] / 1e9, "GFLOP/s")  # on the work this form really does
            figures = {"time": t.scaled(1e3, "ms"), "tokens_per_s": t.rate(t_len, "tokens/s"), "gflops": gflops,
                       "gflops_form": done}
            metrics = {"speedup_vs_serial": times["serial"].median / t.median}
            if f"{form}_cpu" in times:
                figures["cpu_time"] = times[f"{form}_cpu"].scaled(1e3, "ms")
            if f"{form}_instructions" in times:  # exact, per call: judged by their own rule, never as time
                figures["instructions"] = times[f"{form}_instructions"]
            if sgemm is not None:  # the rate itself is stored once, in the run's machine probe record
                metrics["sgemm_gflops"] = sgemm.median * 1e-9
                metrics["sgemm_cpu_gflops"] = sgemm_cpu.median * 1e-9
                # a reference that spins is charged for it: no fraction of it is stored (why is)
                metrics["sgemm_fraction"] = None if refused else done.median / (sgemm.median * 1e-9)
                if f"{form}_cpu" in times:
                    done_cpu = times[f"{form}_cpu"].rate(form_flops[form] / 1e9, "GFLOP/s")
                    metrics["sgemm_fraction_cpu"] = None if refused else done_cpu.median / (sgemm_cpu.median * 1e-9)
                metrics |= spin | ({"sgemm_fraction_refused": refused} if refused else {})
            yield Record(
                "gdn", f"{case}/{form}", "measure",
                figures=figures,
                metrics=metrics,
                work={"flops": flops, "flop_count": "gdn_flops: the serial recurrence's 7 d^2 + 4 d per token "
                                                    "and head; `gflops` uses it for both forms",
                      "flops_form": form_flops[form],
                      "flop_count_form": "the work this form really does (gdn_chunkwise_flops for chunkwise); "
                                         "`gflops_form` and sgemm_fraction use it",
                      "sgemm": f"numpy {SGEMM_SIZE}^3 float32 matmul on {cfg.threads} thread(s), one between each "
                               "pair of kernel repetitions (and one on 1 thread, for the spinning rule)"
                               if sgemm is not None else "not measured off this host",
                      **({"reference": blas_reference.blas_info(cfg.threads)} if sgemm is not None else {}),
                      "tokens": t_len,
                      **({"instructions": "instructions executed per kernel call, between the harness's marks "
                                          "(testbed.measure.counts): the qemu plugin on an emulated device, valgrind's "
                                          "callgrind on the host (its build without AVX-512, which valgrind cannot "
                                          "run); exact, an ISA's and a toolchain's, never a time"}
                         if "instructions" in figures else {})},
                params={"heads": b.heads, "head_size": b.head_size, "tokens": t_len, "kda": b.kda,
                        "chunk": cfg.chunk, "form": form, "threads": cfg.threads},
                artifacts=dict(be.artifacts), evidence=evidence,
            )
    if probe_s:
        yield probe_record(probe_s, cfg.threads)


def probe_record(seconds: list[float], threads: int) -> Record:
    """The run's machine probe: every sgemm timed between the kernel's repetitions, as GFLOP/s, in one
    record (`role: machine_probe`): it says how fast the machine was, never how fast the code is."""
    rate = Figure.of(seconds, "s").rate(2.0 * SGEMM_SIZE**3 / 1e9, "GFLOP/s").as_probe()
    return Record("gdn", f"{PROBE_CASE},threads={threads}", "measure", figures={"sgemm": rate},
                  work={"flops": 2.0 * SGEMM_SIZE**3, "sgemm": f"numpy {SGEMM_SIZE}^3 float32 matmul on {threads} "
                                                             "thread(s), one between each pair of kernel repetitions "
                                                             "of every token count of the run"},
                  params={"role": "machine_probe", "size": SGEMM_SIZE, "threads": threads})


AB_BACKENDS = ("native", "llamacpp")  # what `testbed ab` compares: kernels/ trees, or llama.cpp trees
AB_PROGRAMS = ("tb_ggml_gdn",)         # backend=llamacpp: the programs each llama.cpp tree is built into


def ab_calls(cfg: DictConfig) -> list:
    """The bench's measured calls for `testbed ab`, one timed call per program run: with backend=native
    serial and chunkwise at each bench length; with backend=llamacpp ggml's GATED_DELTA_NET (tb_ggml_gdn,
    one graph node, `threads` ggml threads) at each bench length."""
    from testbed.backends.native.device import Call
    from testbed.backends.native.gdn import INPUTS

    b, calls = cfg.bench, []
    for t_len in b.tokens:
        x = ref.draw_inputs(1, t_len, b.heads, b.head_size, kda=b.kda, seed=cfg.seed)
        case = f"H={b.heads},hs={b.head_size},T={t_len},kda={int(b.kda)}"
        work = {"flops": ref.gdn_flops(1, t_len, b.heads, b.head_size, b.kda), "tokens": t_len}
        if cfg.backend == "llamacpp":
            calls.append(Call(f"{case}/ggml", "tb_ggml_gdn", dict(zip(INPUTS, x.arrays())),
                              ["{inputs}", ".", "K=1", f"threads={cfg.threads}", f"warmup={b.warmup}", "reps=1"],
                              ["out", "state"], work))
            continue
        for form, chunk in (("serial", 1), ("chunkwise", cfg.chunk)):
            calls.append(Call(f"{case}/{form}", "tb_gdn_bench", dict(zip(INPUTS, x.arrays())),
                              ["{inputs}", ".", f"form={form}", f"chunk={chunk}", f"head_map={cfg.head_map}",
                               f"threads={cfg.threads}", f"warmup={b.warmup}", "reps=1"], ["out", "state"], work))
    return calls


def ab_oracles(cfg: DictConfig, ctx, programs) -> Iterator[Record]:
    """`testbed ab ... backend=llamacpp`: the oracles of one tree, ggml's op built from it (tb_ggml_gdn in
    the folder `programs`) against the float64 reference over the matrix's selected cases."""
    from testbed.backends.llamacpp import ggml_gdn

    yield from ggml_gdn.oracle_records("gdn", ctx.device, programs / "tb_ggml_gdn", selected_cases(cfg), cfg.seed,
                                       cfg.threshold, ctx.progress)


def llamacpp_records(cfg: DictConfig, ctx) -> Iterator[Record]:
    """ggml's GATED_DELTA_NET on the device (seed 002's phones): llama.cpp's own harness is the oracle
    (one verdict per case and the "36/36 OK" tally), its perf mode the measurement. Where testbed built
    the tools (the profile names none), ggml's op is also judged by the float64 reference over the
    matrix (testbed.backends.llamacpp.ggml_gdn): test-backend-ops -b CPU compares ggml with itself."""
    from testbed.backends.llamacpp import ggml_gdn, runner as llamacpp

    backend = ctx.device.profile.accelerators.get("backend") or "CPU"
    tools = llamacpp.resolve_tools(ctx.device, "auto", "", ("test-backend-ops", "tb_ggml_gdn"), ctx.progress)
    if cfg.mode in ("oracle", "all"):
        ctx.progress(f"test-backend-ops -o GATED_DELTA_NET -b {backend}")
        report, problems = llamacpp.test_backend_ops(ctx.device, "GATED_DELTA_NET", backend, tools)
        yield from llamacpp.test_records("gdn", "GATED_DELTA_NET", backend, report, problems)
        if tools.built:
            yield from ggml_gdn.oracle_records("gdn", ctx.device, tools.built.program("tb_ggml_gdn"), selected_cases(cfg),
                                               cfg.seed, cfg.threshold, ctx.progress, tools.artifacts())
    if cfg.mode == "all" and ctx.device.profile.has("emulated"):
        # perf mode times each case for about a second of a real CPU (minutes under emulation), and an
        # emulated device's times are never judged: mode=all keeps the device's bound; mode=bench asks for it
        ctx.progress(f"test-backend-ops perf left out on {ctx.device.name} (emulated: its times are not speed; "
                     "mode=bench runs it)")
    elif cfg.mode in ("bench", "all"):
        ctx.progress(f"test-backend-ops perf -o GATED_DELTA_NET -b {backend}")
        yield from llamacpp.perf_records(ctx.device, "gdn", "GATED_DELTA_NET", backend, tools)


def run(cfg: DictConfig, ctx) -> Iterator[Record]:
    if cfg.backend == "llamacpp":
        yield from llamacpp_records(cfg, ctx)
        return
    be = backends.load(cfg.backend, "gdn").runner(cfg, ctx.device, ctx.progress)
    if cfg.mode in ("oracle", "all"):
        yield from oracle_records(cfg, ctx, be)
    if cfg.mode in ("bench", "all"):
        yield from bench_records(cfg, ctx, be)


# --- tables ----------------------------------------------------------------------------------------


def view(df: pd.DataFrame) -> pd.DataFrame:
    """Oracle rows: verdict and NMSE per case and form. Measure rows: time and rates per T and form."""
    rows = []
    for _, r in df.iterrows():
        if r["kind"] == "oracle":
            rows.append({"device": r["device"], "backend": r["backend"], "chunk": r.get("params.chunk"),
                         "case": r["case"], "oracle": r["oracle"], "verdict": r["verdict"],
                         "margin": r["margin"], "nmse": r.get("metrics.nmse")})
        elif str(r["case"]).startswith("ab/"):  # testbed ab / the nightly's A/B job: B against A, paired
            rows.append({"device": r["device"], "backend": r["backend"], "case": r["case"],
                         "instructions": r.get("figures.instructions.median"),
                         "instructions A": r.get("figures.instructions_a.median"),
                         "B/A cpu": r.get("figures.ab_ratio_cpu.median"),
                         "B/A wall": r.get("figures.ab_ratio_wall.median"),
                         "A/B verdict": r.get("metrics.ab.verdict"), "samples": tables.samples(r)})
        else:
            rows.append({"device": r["device"], "backend": r["backend"], "chunk": r.get("params.chunk"),
                         "threads": r.get("params.threads", 1), "case": r["case"],
                         "ms": r.get("figures.time.median"),
                         "tokens/s": r.get("figures.tokens_per_s.median"),
                         # the machine probe's row: numpy sgemm's rate (the machine, not the code)
                         "GFLOP/s": r.get("figures.gflops.median") if pd.notna(r.get("figures.gflops.median"))
                         else r.get("figures.sgemm.median"),
                         "x serial": r.get("metrics.speedup_vs_serial"),
                         # no "of sgemm" column: sgemm_fraction divides medians of a probe timed between the
                         # repetitions by the wall clock, not the interleaved CPU-time ratio native_bench judges
                         # exact counts, per call: a column of their own, never mixed with the times
                         "instructions": r.get("figures.instructions.median"), "samples": tables.samples(r)})
    frame = pd.DataFrame(rows)
    return frame.dropna(axis=1, how="all") if len(frame) else frame


def worst_nmse(oracles: pd.DataFrame) -> float | None:
    """The worst NMSE of NMSE verdicts; inf where one was stored as null (not finite: NaN or inf in an
    output), None where none has one (ggml's own verdicts)."""
    nm = pd.to_numeric(oracles["metrics.nmse"], errors="coerce") if "metrics.nmse" in oracles else None
    if nm is None or nm.isna().all():
        return None
    return float("inf") if nm.isna().any() else float(nm.max())


def summary(df: pd.DataFrame) -> list[pd.DataFrame]:
    """What `testbed run gdn` prints: the oracle tally per form, and the benchmark rows."""
    rows = []
    oracles = df[df["kind"] == "oracle"]
    if len(oracles):
        # testbed's own records name their form; ggml's (test-backend-ops) end in /BACKEND or /tally
        form = oracles["case"].str.rsplit("/", n=1).str[-1]
        if "params.form" in oracles:
            form = oracles["params.form"].fillna(form)
        for (oracle, form), grp in oracles.groupby([oracles["oracle"], form], sort=False):
            rows.append({"what": f"{oracle} {form}", "cases": len(grp),
                         "pass": int((grp["verdict"] == "pass").sum()),
                         "worst NMSE": worst_nmse(grp) if oracle == "nmse" else None,
                         "min margin": float(pd.to_numeric(grp["margin"], errors="coerce").min())})
    bench = view(df[df["kind"] == "measure"])
    bench = bench.drop(columns=["device", "backend"]) if len(bench) else bench
    return [t for t in (pd.DataFrame(rows), bench) if len(t)]


def sweep_row(df: pd.DataFrame) -> dict:
    """Per sweep job: chunk, oracle tally and worst NMSE, chunkwise tokens/s and its speed-up over serial
    per T; on an emulated device, whose times are never speed, the chunkwise call's exact instructions
    instead."""
    oracles = df[df["kind"] == "oracle"]
    row = {"chunk": df["params.chunk"].iloc[0] if "params.chunk" in df else None}
    if len(oracles):
        row["oracles"] = Tally(oracles["verdict"]).phrase()
        row["worst NMSE"] = worst_nmse(oracles[oracles["oracle"] == "nmse"])
    emulated = "emulated" in df and bool(df["emulated"].fillna(False).astype(bool).any())
    repetitions = {}  # the chunkwise calls' repetitions per T, for the best chunk's confidence (programs only)
    for _, r in df[(df["kind"] == "measure") & (df["params.form"] == "chunkwise")].iterrows():
        t = int(r["params.tokens"])
        if emulated:
            if pd.notna(r.get("figures.instructions.median")):
                row[f"T={t} instructions"] = int(r["figures.instructions.median"])
        else:
            row[f"T={t} tok/s"] = round(float(r["figures.tokens_per_s.median"]), 1)
            row[f"T={t} x serial"] = round(float(r["metrics.speedup_vs_serial"]), 2)
        repetitions |= {f"T={t} {figure}": values for figure, values in tables.samples(r).items()
                        if figure in ("time", "instructions")}
    if repetitions:
        row["samples"] = repetitions
    if emulated:
        row["emulated"] = True  # its times are never a decision (testbed.measure.emulation)
    return row


def best_chunks(measured: dict[int, dict[str, list[float]]], emulated: bool) -> list[dict]:
    """The best chunk of the chunkwise form at one length, from each chunk's repetitions by figure
    ("time", "instructions"), with the chunks not distinguishable from it (decisions.best_of; the
    chunks ran as separate jobs: unpaired): by time (never on an emulated device) and by instructions
    where every chunk counted them; a tie of exact counts names every tied chunk."""
    found = []
    for figure in ("time", "instructions"):
        samples = {c: measured[c].get(figure) for c in sorted(measured)}
        if len(samples) < 2 or not all(samples.values()) or (figure == "time" and emulated):
            continue
        found.append({"decision": "best chunk, chunkwise", "by": figure, **decisions.best_of(samples, by=figure)})
    return found


def sweep_footer(rows: pd.DataFrame, jobs) -> str:
    """A sweep over chunk: per device and T, the best chunk (best_chunks); an emulated device's times
    decide nothing."""
    groups: dict[tuple, list] = {}
    for (_, row), rc in zip(rows.iterrows(), jobs):
        if isinstance(row.get("samples"), dict) and pd.notna(row.get("chunk")):
            groups.setdefault((rc.cfg.backend, rc.device), []).append(row)
    lines = []
    for (backend, device), measured in groups.items():
        if len({int(r["chunk"]) for r in measured}) < 2:
            continue
        emulated = any(r.get("emulated") is True for r in measured)
        tokens = sorted({key.split(" ")[0] for r in measured for key in r["samples"]}, key=lambda k: int(k[2:]))
        for t in tokens:
            by_chunk = {int(r["chunk"]): {figure: r["samples"].get(f"{t} {figure}")
                                          for figure in ("time", "instructions")} for r in measured}
            lines += [f"best chunk, chunkwise, {t} on {backend} / {device}, by {d['by']}: {d['says']}"
                      for d in best_chunks(by_chunk, emulated)]
        if emulated:
            lines.append(f"no best chunk by time on {backend} / {device}: the device is emulated "
                         "(its times are never speed)")
    return "\n".join(lines)


def table_choices(df: pd.DataFrame) -> list[dict]:
    """`testbed table gdn`'s choices from stored records: per device, backend, model (heads x head
    size), threads and T, the best chunk of the chunkwise form over the latest record of each chunk
    (best_chunks), as data beside the rows (tables.render)."""
    if df.empty or not {"params.form", "params.tokens", "params.chunk"} <= set(df.columns):
        return []
    m = df[(df["kind"] == "measure") & (df["params.form"] == "chunkwise") & df["params.tokens"].notna()
           & df["params.chunk"].notna()]
    if "time" in m:
        m = m.sort_values("time", kind="stable")
    groups: dict[tuple, dict[int, pd.Series]] = {}
    for _, r in m.iterrows():
        def whole(column: str, default=None):
            value = r.get(column)
            return int(value) if pd.notna(value) else default

        key = (r["device"], r["backend"], whole("config.bench.heads"), whole("config.bench.head_size"),
               whole("params.threads", 1), int(r["params.tokens"]))
        groups.setdefault(key, {})[int(r["params.chunk"])] = r  # the latest record of each chunk
    out = []
    for (device, backend, heads, size, threads, t), by_chunk in groups.items():
        measured = {c: tables.samples(r) for c, r in by_chunk.items()}
        emulated = any(pd.notna(r.get("emulated")) and bool(r.get("emulated")) for r in by_chunk.values())
        source = f"{device} / {backend}, H={heads} hs={size}, {threads} thread(s), T={t}"
        out += [decisions.as_choice(d, source) for d in best_chunks(measured, emulated)]
    return out
