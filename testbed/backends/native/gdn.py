"""GDN on a device with the native kernels: kernels/bench/tb_gdn_bench, built for the device's ABI,
pushed once per content, run there on .npy inputs (pushed once per content too, so one case's inputs
serve every form), its outputs pulled back for the host's oracles.

The host is a device like any other (local transport): `backend=native` on the host runs the same
program, so a figure never includes Python's call overhead and the kernel's time is the program's own
clock. Each call leaves an Evidence (program sha256, command, device seconds) in `evidence`.
"""

from __future__ import annotations

from pathlib import Path


from testbed.backends import EvidenceLog
from testbed.backends.native.build import build_programs, target_for_abi
from testbed.backends.native.device import NativeJob, run_native
from testbed.devices import Device
from testbed.results import Figure

INPUTS = ("q", "k", "v", "g", "beta", "state")


def auto_chunk(head_size: int) -> int:
    """The chunk tb_gdn_chunkwise takes for chunk=auto (kernels' tb_gdn_auto_chunk: the size measured
    fastest for the head size); tb_gdn_bench records the chunk it used, which callers check."""
    return 16 if head_size <= 64 else 32


class NativeGDN:
    def __init__(self, device: Device, head_map: str = "tiled", threads: int = 1, progress=lambda msg: None):
        target = target_for_abi(device.profile.abi)
        progress(f"building the native programs for {target}")
        self.program: Path = build_programs(target) / "tb_gdn_bench"
        self.target = target
        self.device, self.head_map, self.threads = device, head_map, threads
        self.evidence = EvidenceLog()
        self.artifacts = {"program": self.program.name, "build_target": target}

    def _run(self, x, form: str, chunk: int, warmup: int = 0, reps: int = 1, measured: bool = False,
             count: bool = False):
        args = ["{inputs}", ".", f"form={form}", f"chunk={chunk}", f"head_map={self.head_map}",
                f"threads={self.threads}", f"warmup={warmup}", f"reps={reps}"]
        program = self.program
        if count and self.target == "host":  # valgrind's build: the same sources without AVX-512
            program = build_programs("host", avx512=False) / self.program.name
        result = run_native(self.device, NativeJob(program, dict(zip(INPUTS, x.arrays())), ["out", "state"],
                                                   args, measured=measured, count=count,
                                                   shapes={"out": x.v.shape, "state": x.state.shape}))
        self.evidence.add(result.evidence)
        self.artifacts["program_sha256"] = result.evidence.sha256
        self.artifacts["vector_path"] = result.timings.get("vector_path")
        self.artifacts["gemm_isa"] = result.timings.get("gemm_isa")
        self.artifacts["kernels_source_hash"] = result.timings.get("source_hash")
        return result

    def _arrays(self, x, form, chunk):
        r = self._run(x, form, chunk)
        return r.outputs["out"], r.outputs["state"]

    def serial(self, x):
        return self._arrays(x, "serial", 1)

    def chunkwise(self, x, chunk: int):
        return self._arrays(x, "chunkwise", chunk)

    def serial_chunk_loop(self, x, chunk: int):
        return self._arrays(x, "serial-chunk-loop", chunk)

    def bench(self, x, chunk: int, reps: int, warmup: int, between=None, count: bool = False) -> dict:
        """Serial and chunkwise, alternating one program run per repetition (each with its own
        warm-up), timed by the program's clock on the device: wall and CPU seconds per call.
        `between()` runs after each pair (a reference timed in the same conditions). Instructions per
        call (`FORM_instructions`) come from every run on a device that counts; elsewhere, with
        `count`, from one more run per form under valgrind, apart from the timed ones."""
        seconds: dict[str, list[float]] = {"serial": [], "chunkwise": []}
        cpu: dict[str, list[float]] = {"serial": [], "chunkwise": []}
        instructions: dict[str, list[int]] = {"serial": [], "chunkwise": []}
        for _ in range(reps):
            for form in seconds:
                result = self._run(x, form, chunk, warmup=warmup, reps=1, measured=True)
                seconds[form] += result.timings["seconds"]
                cpu[form] += result.timings.get("cpu_seconds") or []
                if result.counts:
                    instructions[form].append(result.counts.per_call)
            if between is not None:
                between()
        if count and not self.device.profile.has("counts"):
            for form in instructions:
                instructions[form].append(self._run(x, form, chunk, warmup=warmup, reps=1, count=True).counts.per_call)
        return {form: Figure.of(s, "s") for form, s in seconds.items()} | {
            f"{form}_cpu": Figure.of(c, "s") for form, c in cpu.items() if c} | {
            f"{form}_instructions": Figure.of(n, "instructions") for form, n in instructions.items() if n}


def runner(cfg, device: Device, progress=lambda msg: None) -> NativeGDN:
    return NativeGDN(device, cfg.head_map, cfg.threads, progress)
