"""llama.cpp's own harness on the Hexagon ISA: ggml (ggml-base + ggml-cpu, its generic C path: ggml has
no Hexagon code for its CPU backend) with test-backend-ops and testbed's tb_ggml_gdn, built from the
llama-cpp-python sdist by zig's clang and libc++ for hexagon-linux-musl (core v67), pushed to
qemu-hexagon and run there: `testbed run gdn backend=llamacpp device=qemu-hexagon` gives
test-backend-ops' GATED_DELTA_NET verdicts (-b CPU: ggml against itself) and testbed's independent
float64 verdicts on the op computed there, every record under device qemu-hexagon with evidence of a
Hexagon ELF.

Costs (2 cores): zig's libc++ for Hexagon is built once (about 5.5 min cold, unloaded), then ggml and
the two programs (34 build steps); both are cached (.cache/zig/, .cache/llamacpp/), so a warm run costs
a source hash. The cold build is why this file is opt-in (`pytest -m slow_build`); the default run
keeps the Hexagon kernels (tests/test_hexagon_cross.py, the qemu-hexagon device suite).
"""

import shutil

import pytest

from testbed import config, runner
from testbed.backends.llamacpp import build
from testbed.backends.native import build as kernel_build
from testbed.devices import connect, load_profile
from testbed.devices.transport import elf_machine
from testbed.results import ResultsStore
from tests.test_llamacpp_built import GGML_PROGRAMS, plant_decay_after_update


def _missing() -> str | None:
    for tool, package in (("cmake", "cmake"), ("ninja", "ninja-build"), ("qemu-hexagon", "qemu-user")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: {package}; scripts/bootstrap.sh --test)"
    try:
        kernel_build.zig_binary()
    except kernel_build.BuildError as e:
        return str(e)
    return None


pytestmark = [pytest.mark.slow_build, pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]


@pytest.fixture(scope="module")
def hexagon_tools():
    return build.build("hexagon", "", GGML_PROGRAMS, progress=lambda m: None)


def test_the_hexagon_tools_are_hexagon_elf_built_by_zig(hexagon_tools):
    for name in GGML_PROGRAMS:
        assert elf_machine(hexagon_tools.program(name)) == 164  # EM_QDSP6, "QUALCOMM DSP6"
    toolchain = hexagon_tools.info["toolchain"]
    assert toolchain["toolchain"] == "zig" and "hexagon-linux-musl -mcpu=hexagonv67" in toolchain["target"]
    assert any("-DCMAKE_SYSTEM_PROCESSOR=hexagon" == o for o in hexagon_tools.info["options"])


def test_gdn_with_llamacpp_on_qemu_hexagon(hexagon_tools, results_dir):
    """The 36 cases of test-backend-ops (and its tally) and the 48-case matrix judged by refimpl, all
    computed under qemu-hexagon, stored under its name with Hexagon evidence."""
    device = connect(load_profile("qemu-hexagon"))
    try:
        outcome = runner.execute(config.load(["device=qemu-hexagon", "backend=llamacpp", "mode=oracle", "matrix=all"],
                                             experiment="gdn"), device=device)
    finally:
        device.close()
    rows = outcome.rows
    tbo = [r for r in rows if r["oracle"] == "test-backend-ops"]
    ours = [r for r in rows if r["oracle"] == "nmse"]
    assert len(tbo) == 37 and len(ours) == 48 and outcome.failed == 0, \
        [(r["case"], r["detail"]) for r in rows if r.get("verdict") != "pass"][:3]
    (tally,) = [r for r in tbo if r["case"].endswith("/tally")]
    assert tally["metrics"]["tally"] == "36/36 OK" and tally["metrics"]["passed"] == 36
    for r in rows:
        assert r["device"] == "qemu-hexagon" and r["emulated"]
        for ran in r["evidence"]:
            assert ran["detail"]["elf_machine"] == 164 and ran["detail"]["elf_machine_name"] == "QUALCOMM DSP6"
            assert ran["detail"]["toolchain"]["toolchain"] == "zig"
    assert {r["device"] for r in ResultsStore(results_dir).records()} == {"qemu-hexagon"}


def test_a_bug_planted_in_ggml_is_caught_on_hexagon_by_testbeds_reference_only(hexagon_tools, tmp_path_factory):
    """The decay moved after the delta-rule update in ggml's CPU op, built for Hexagon: test-backend-ops
    (-b CPU, ggml against itself) still passes, testbed's float64 reference fails every case."""
    from testbed.backends.llamacpp import ggml_gdn, runner as llamacpp
    from testbed.experiments.gdn import TBO_CASES

    tree = tmp_path_factory.mktemp("llama.cpp-planted-hexagon") / "llama.cpp"
    upstream = build.sdist_source()
    shutil.copytree(upstream, tree, ignore=lambda folder, names: build.NOT_BUILT if folder == str(upstream) else ())
    plant_decay_after_update(tree)
    planted = build.build("hexagon", str(tree), GGML_PROGRAMS, progress=lambda m: None)
    device = connect(load_profile("qemu-hexagon"))
    try:
        tools = llamacpp.Tools(device, {}, planted)
        from testbed.backends.native.device import stage_program

        tools.paths = {n: str(device.transport.path(stage_program(device, planted.program(n)))) for n in GGML_PROGRAMS}
        report, problems = llamacpp.test_backend_ops(device, "GATED_DELTA_NET", "CPU", tools)
        assert problems == [] and report.passed == 36  # blind: the CPU backend compared with itself
        records = list(ggml_gdn.oracle_records("gdn", device, planted.program("tb_ggml_gdn"), TBO_CASES[:6]))
        assert records and all(r.verdict == "fail" for r in records), [(r.case, r.verdict) for r in records]
    finally:
        device.close()
