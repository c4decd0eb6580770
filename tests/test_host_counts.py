"""Every native kernel testbed ships is counted on every counting device the default suite names: the
host (valgrind's callgrind, counts=true) as well as qemu-aarch64, qemu-arm32 and qemu-hexagon (the
plugin). The suite's structure is checked whole; the host's counting is run for real on the engine's
chunk call and decode step (chunk_prefill, a few CPU-seconds under valgrind)."""

import shutil

import pytest
from omegaconf import OmegaConf

from testbed import config, runner

# the experiments whose native programs hold testbed's kernels: GDN; attention, tb_gemm and the sliding
# cache (native_bench); the Gemma engine's chunk call and decode step (chunk_prefill); the tail engine
# (tail); the hybrid engine (hybrid)
KERNEL_EXPERIMENTS = {"gdn", "native_bench", "chunk_prefill", "tail", "hybrid"}


def counted_on(suite) -> dict[str, set[str]]:
    """experiment -> the devices a run of the suite counts it on: a device that counts by itself
    (capability counts) in any native run, the host only with counts=true."""
    from testbed.devices import load_profile

    out: dict[str, set[str]] = {}
    for name, run in suite.runs.items():
        overrides = [str(o) for o in run.get("overrides", [])]
        for device in run.get("devices", suite.devices):
            counting = load_profile(device).has("counts")
            if (counting and "backend=refimpl" not in overrides) or "counts=true" in overrides:
                out.setdefault(run.experiment, set()).add(device)
    return out


def test_the_default_suite_counts_every_kernel_on_every_counting_device():
    suite = OmegaConf.load(config.group_file("suite", "default"))
    counted = counted_on(suite)
    missing = {e: sorted(set(suite.devices) - counted.get(e, set())) for e in KERNEL_EXPERIMENTS}
    assert not {e: d for e, d in missing.items() if d}, f"not counted: {missing}"


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_the_host_counts_the_engines_chunk_call_and_decode_step(results_dir):
    """The suite's host run of chunk_prefill: both measured calls carry their exact instructions, the
    chunk call of 64 rows more than one decode step."""
    suite = OmegaConf.load(config.group_file("suite", "default"))
    (name,) = [n for n, r in suite.runs.items() if r.experiment == "chunk_prefill" and "host" in r.get("devices", [])
               and "counts=true" in [str(o) for o in r.overrides]]
    rc = config.load(["device=host", *[str(o) for o in suite.runs[name].overrides]], experiment="chunk_prefill")
    rows = {r["params"]["form"]: r for r in runner.execute(rc).rows
            if r["kind"] == "measure" and r["params"].get("form") in ("chunk_call", "decode_step")}
    counts = {form: r["figures"]["instructions"] for form, r in rows.items()}
    assert counts["chunk_call"]["unit"] == "instructions" and counts["chunk_call"]["median"] > counts["decode_step"]["median"] > 0
    assert all("valgrind-callgrind" in str(r["evidence"]) for r in rows.values())
