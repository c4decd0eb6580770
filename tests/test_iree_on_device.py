"""Chunk prefill with past through IREE ON the device `pytest --device=NAME` selects (host, lavapipe,
qemu-aarch64, adb-loopback-arm64, a phone): every graph call an iree-run-module there, K/V kept there
between calls, the token oracle on the host against refimpl. Each verdict is checked against the
run's evidence (the modules that ran are the ones staged on that device, compiled for its target),
so a computation anywhere else cannot pass. The tiny model preset; the seed's two cases, a two-call
case, a planted wrong mask, a refused target, a failing tool, and the device's own timings."""

import dataclasses
import shutil

import numpy as np
import pytest
from omegaconf import OmegaConf

from refimpl import gemma
from testbed import backends, config, runner
from testbed.backends.iree.device import IreeRunFailed
from testbed.cli import main
from testbed.devices.transport import sha256_file
from testbed.errors import UsageError
from testbed.oracles.tokens import Reference, TokenCase, check_token_at_position

pytestmark = [pytest.mark.requires("iree"),
              pytest.mark.skipif(shutil.which("iree-compile") is None, reason="iree-base-compiler is not installed")]

SEED_CASES = [TokenCase(800, 52, 64), TokenCase(820, 32, 32)]
# The same cache capacity (896 rows) as the seed's first case, so its modules serve these too.
SHORT = TokenCase(800, 8, 64)
TWO_CALLS = TokenCase(800, 36, 32)


@pytest.fixture(scope="session")
def tiny():
    cfg = gemma.tiny_config()
    return cfg, gemma.init_weights(cfg, 0)


@pytest.fixture(scope="session")
def reference(tiny):
    cfg, w = tiny
    return Reference(w, cfg, np.random.default_rng(0).integers(0, cfg.vocab, 852))


@pytest.fixture(scope="session")
def on_device(device, tiny):
    """The IREE backend on the session's device, compiled for its profile's target (shared by the tests,
    so each module compiles and is pushed once)."""
    cfg, w = tiny
    run_cfg = OmegaConf.create({"target": device.profile.iree["target"], "threads": 1,
                                "iree": {"driver": None, "past_bucket": 128, "weights": "parameters"}})
    return backends.load("iree", "gemma").backend(w, cfg, run_cfg, device)


def check_evidence(device, backend, evidence: list[dict]) -> dict[str, int]:
    """Every run happened on this device, ran a module staged there (the bytes on the device are the
    module compiled for the device's target), with the profile's HAL device; returns runs per function."""
    staged = {m.sha256: (name, m) for name, m in backend.staged.items()}
    runs: dict[str, int] = {}
    for e in evidence:
        assert e["device"] == device.name and e["device_seconds"] > 0, e
        assert e["sha256"] in staged, f"{e['ran']} {e['sha256'][:12]} was not staged on {device.name}"
        name, module = staged[e["sha256"]]
        assert f"--device={device.profile.iree['hal_device']}" in e["command"].split()
        runs[module.function] = runs.get(module.function, 0) + 1
    for name, module in backend.staged.items():
        artifact = backend.artifacts[name]
        assert artifact.target["name"] == device.profile.iree["target"]
        assert sha256_file(artifact.module) == module.sha256
        assert device.transport.remote_digest(module.module) == (artifact.module.stat().st_size, module.sha256)
    return runs


def failures(verdicts) -> dict[str, str]:
    return {v.oracle: v.detail for v in verdicts if not v.passed}


@pytest.mark.parametrize("case", SEED_CASES + [TWO_CALLS], ids=lambda c: c.name)
def test_a_case_passes_the_token_oracle_on_the_device(device, on_device, reference, case):
    on_device.evidence.take()
    verdicts = check_token_at_position(on_device, reference, case)
    assert not failures(verdicts), failures(verdicts)
    runs = check_evidence(device, on_device, on_device.evidence.take())
    assert runs == {"prefill_at": 1, "prefill_with_past": case.calls, "decode_in_cache": case.tokens}


def test_a_wrong_mask_pushed_to_the_device_fails_the_oracle(device, on_device, reference, tiny):
    """A host mask builder that forgets the local layers' sliding window: the correct modules on the
    device get the wrong masks (at 800 cached positions the window of 512 matters), and the oracle fails."""
    cfg, _ = tiny
    no_window = dataclasses.replace(cfg, window=10**6)

    def wrong_masks(model_cfg, *args, **kwargs):
        inp = gemma.chunk_inputs(model_cfg, *args, **kwargs)
        return dataclasses.replace(inp, masks=gemma.chunk_inputs(no_window, *args, **kwargs).masks)

    assert not failures(check_token_at_position(on_device, reference, SHORT))  # the case itself passes
    assert {"logits", "cache"} <= set(failures(check_token_at_position(on_device, reference, SHORT,
                                                                       build=wrong_masks)))


def test_a_tool_that_fails_on_the_device_is_an_error_never_a_pass(device, on_device, reference, tiny):
    """The decode module's copy on the device cut short: the real iree-run-module fails there, and the
    case raises with the tool's own stderr instead of returning verdicts."""
    from testbed.backends.iree.graphs import gemma as graphs

    cfg, w = tiny
    graph = graphs.decode_in_cache(cfg, w, on_device.capacity(SHORT.past + SHORT.tokens))
    module, artifact = on_device.module(graph), on_device.artifacts[graph.name]
    cut = artifact.folder.parent / f".cut-{module.sha256[:16]}.vmfb"
    cut.write_bytes(artifact.module.read_bytes()[:2048])
    try:
        device.push(cut, module.module)
        with pytest.raises(IreeRunFailed, match=r"iree-run-module exited .*decode_in_cache.*\S"):
            check_token_at_position(on_device, reference, SHORT)
    finally:
        device.push(artifact.module, module.module)
        cut.unlink()


def test_the_device_times_chunk_call_and_decode_step_with_its_own_timer(device, on_device, reference):
    on_device.evidence.take()
    times = on_device.bench(reference.prompt, 800, 64, reps=2, warmup=1)
    assert {f: (t.reps, t.unit) for f, t in times.items()} == {"chunk_call": (2, "s"), "decode_step": (2, "s")}
    assert all(0 < t.min <= t.median <= t.max for t in times.values())
    evidence = on_device.evidence.take()
    timed = [e for e in evidence if "iree-benchmark-module" in e["command"]]
    assert all("real_time" in e["detail"]["timer"] for e in timed)
    staged = {m.sha256: m.function for m in on_device.staged.values()}
    # alternating, one repetition each: warm-up pair, then the two measured pairs
    assert [staged[e["sha256"]] for e in timed] == ["prefill_with_past", "decode_in_cache"] * 3
    check_evidence(device, on_device, evidence)


def test_a_target_for_another_kind_of_device_is_refused_before_anything_runs(device, results_dir, capsys):
    wrong = "host" if device.profile.iree["hal_device"] == "vulkan" else "lavapipe"
    overrides = ["backend=iree", f"device={device.name}", f"target={wrong}", "mode=oracle"]
    with pytest.raises(UsageError, match=f"target={wrong} builds"):
        runner.check(config.load(overrides, experiment="chunk_prefill"))
    assert main(["run", "chunk_prefill", *overrides]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not results_dir.exists() or not any(results_dir.rglob("*.*"))  # nothing ran, nothing stored


# --- Gated DeltaNet through IREE on the device ------------------------------------------------------


@pytest.fixture(scope="session")
def gdn_on_device(device):
    from testbed.backends.iree import gdn

    return gdn.runner(OmegaConf.create({"target": device.profile.iree["target"], "threads": 1, "head_map": "tiled"}),
                      device)


def test_gdn_forms_run_on_the_device_against_the_float64_recurrence(device, gdn_on_device):
    """Serial, chunkwise (T = 24 over chunks of 16: a partial last chunk) and the serial recurrence
    looped over chunks of 8 with the state kept on the device, each against refimpl's serial
    recurrence in float64 by NMSE; the same inputs with q and k swapped must fail it."""
    from refimpl import gdn as ref
    from testbed.oracles.numerical import check_nmse

    x = ref.draw_inputs(1, 24, 2, 16, v_repeat=2, gate="mild", seed=3)
    out, state = ref.gdn_serial(*(a.astype(np.float64) for a in x.arrays()))
    want = {"out": out, "state": state}
    gdn_on_device.evidence.take()
    for got in (gdn_on_device.serial(x), gdn_on_device.chunkwise(x, 16), gdn_on_device.serial_chunk_loop(x, 8)):
        verdict = check_nmse(want, dict(zip(("out", "state"), got)))
        assert verdict.passed, verdict.detail
    swapped = ref.GDNInputs(x.k, x.q, x.v, x.g, x.beta, x.state)
    assert not check_nmse(want, dict(zip(("out", "state"), gdn_on_device.serial(swapped)))).passed
    evidence = gdn_on_device.evidence.take()
    staged = {m.sha256: m for m in gdn_on_device.staged.values()}
    assert all(e["device"] == device.name and e["sha256"] in staged for e in evidence)
    assert [staged[e["sha256"]].function for e in evidence] == ["gdn_serial", "gdn_chunkwise"] + ["gdn_serial"] * 4
    # the loop's second and third calls read the state the previous call left on the device
    assert [e["command"].split()[-3] for e in evidence[3:5]] == ["--input=@c0_state.npy", "--input=@c1_state.npy"]
