"""llama.cpp itself in the loop: its tools built from real source (the llama.cpp the llama-cpp-python
sdist vendors, fetched by pip once) for the host and for aarch64, run on an emulated aarch64 device
(qemu-aarch64, backend CPU: the Hexagon profile's flow without the NPU), their real output parsed
into records; and testbed's float64 reference judging ggml's own GATED_DELTA_NET, which catches a
bug planted in ggml's CPU op that test-backend-ops, comparing the CPU backend with itself, passes.

Builds are shared by the whole session and cached by content under .cache/llamacpp/ (a cold build of
the two ggml-only programs for one target takes minutes on two cores; a cached one, a source hash).
"""

import shutil
from pathlib import Path

import pytest

from testbed import config, runner
from testbed.backends.llamacpp import build
from testbed.devices.transport import sha256_file
from testbed.errors import UsageError
from testbed.results import ResultsStore

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("ninja") is None,
                                reason="cmake and ninja build llama.cpp (scripts/bootstrap.sh --test)")

GGML_PROGRAMS = ("test-backend-ops", "tb_ggml_gdn")
AARCH64 = pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None or shutil.which("qemu-aarch64") is None,
                             reason="g++-aarch64-linux-gnu and qemu-user (scripts/bootstrap.sh --test)")

# The planted bug: ggml's CPU GATED_DELTA_NET decays the state AFTER the delta-rule update instead of
# before it (the decay block moved below the rank-1 update). Every token's output and state change.
DECAY = """            if (kda) {
                // precompute exp(g) into delta scratch (reused below)"""
DECAY_END = """                ggml_vec_scale_f32(S_v * S_v, s_out, expf(g_d[0]));
            }
"""
OUTPUT = "            // attn_out[j] = sum_i S[i][j] * q[i] = dot(row j of M, q)\n"


def plant_decay_after_update(tree: Path) -> None:
    ops = tree / "ggml" / "src" / "ggml-cpu" / "ops.cpp"
    text = ops.read_text()
    assert text.count(DECAY) == 1 and text.count(OUTPUT) == 1, "ggml's CPU GATED_DELTA_NET is not the one this bug is planted in"
    start = text.index(DECAY)
    end = text.index(DECAY_END, start) + len(DECAY_END)
    block, text = text[start:end], text[:start] + text[end:]
    ops.write_text(text.replace(OUTPUT, block + "\n" + OUTPUT))


@pytest.fixture(scope="session")
def upstream_tree():
    return build.sdist_source()


@pytest.fixture(scope="session")
def planted_tree(upstream_tree, tmp_path_factory):
    tree = tmp_path_factory.mktemp("llama.cpp-planted") / "llama.cpp"
    shutil.copytree(upstream_tree, tree, ignore=lambda folder, names: build.NOT_BUILT if Path(folder) == upstream_tree else ())
    plant_decay_after_update(tree)
    return tree


@pytest.fixture(scope="session")
def aarch64_tools():
    return build.build("aarch64", programs=GGML_PROGRAMS)


@pytest.fixture(scope="session")
def host_tools():
    return build.build("host", programs=GGML_PROGRAMS)


def elf_machine(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[18:20], "little")


def run_llamacpp(*overrides):
    outcome = runner.execute(config.load(["experiment=llamacpp", *overrides]))
    return outcome, outcome.frame()


# --- building --------------------------------------------------------------------------------------


def test_the_source_is_llama_cpp_with_its_harness_and_ggmls_gdn(upstream_tree):
    assert (upstream_tree / "tests" / "test-backend-ops.cpp").is_file()
    assert (upstream_tree / "tools" / "llama-bench").is_dir() and (upstream_tree / "convert_hf_to_gguf.py").is_file()
    assert "ggml_gated_delta_net" in (upstream_tree / "ggml" / "include" / "ggml.h").read_text()


@AARCH64
def test_aarch64_programs_are_static_arm64_binaries_cached_by_content(aarch64_tools, upstream_tree):
    for name in GGML_PROGRAMS:
        program = aarch64_tools.program(name)
        assert elf_machine(program) == 183  # EM_AARCH64
        assert b"/lib/ld-linux-aarch64.so" not in program.read_bytes()[:4096]  # no interpreter: static
    builds = len(aarch64_tools.info["builds"])
    again = build.build("aarch64", programs=GGML_PROGRAMS)  # the same sources and options: nothing is compiled
    assert again.folder == aarch64_tools.folder and len(again.info["builds"]) == builds
    assert aarch64_tools.source_hash == build.source_hash(upstream_tree)


def test_a_changed_source_is_a_different_build(upstream_tree, planted_tree):
    assert build.source_hash(planted_tree) != build.source_hash(upstream_tree)
    options = build.cmake_options("host")
    assert build.build_key("host", build.source_hash(planted_tree), options) != \
        build.build_key("host", build.source_hash(upstream_tree), options)


# --- on the emulated aarch64 device ----------------------------------------------------------------


@AARCH64
def test_qemu_aarch64_runs_the_real_harness_and_ggmls_op_passes_testbeds_reference(aarch64_tools, results_dir):
    outcome, df = run_llamacpp("device=qemu-aarch64", "mode=test")
    tally = df[df["case"] == "GATED_DELTA_NET/CPU/tally"].iloc[0]
    assert (tally["verdict"], tally["metrics.tally"]) == ("pass", "36/36 OK")  # the real tool's own output
    ran = tally["evidence"][0]
    assert ran["sha256"] == sha256_file(aarch64_tools.program("test-backend-ops"))  # the binary built here ran
    ours = df[df["oracle"] == "nmse"]
    assert len(ours) == 48 and (ours["verdict"] == "pass").all(), ours[ours["verdict"] != "pass"]["detail"].tolist()
    assert (ours["params.reference"] == "refimpl.gdn.gdn_serial in float64").all()
    assert {e[0]["sha256"] for e in ours["evidence"]} == {sha256_file(aarch64_tools.program("tb_ggml_gdn"))}
    assert (ours["artifacts.llamacpp_source_sha256"] == aarch64_tools.source_hash).all()
    assert outcome.failed == 0 and len(ResultsStore(results_dir).records("llamacpp")) == len(df)


@AARCH64
def test_gdn_with_backend_llamacpp_on_qemu_aarch64_judges_ggmls_op_by_the_reference(aarch64_tools, results_dir):
    said = []
    # mode=all (the default): on an emulated device the oracles only, perf mode (minutes there) left out
    outcome = runner.execute(config.load(["experiment=gdn", "device=qemu-aarch64", "backend=llamacpp",
                                          "matrix=awkward"]), progress=said.append)
    df = outcome.frame()
    assert not df["case"].str.endswith("/perf").any() and (df["kind"] != "measure").all()
    assert any("perf left out on qemu-aarch64" in line for line in said)
    assert df[df["case"] == "GATED_DELTA_NET/CPU/tally"].iloc[0]["metrics.tally"] == "36/36 OK"
    ours = df[df["oracle"] == "nmse"]
    assert len(ours) == 12 and (ours["verdict"] == "pass").all() and outcome.failed == 0
    assert (ours["case"].str.endswith("/ggml-CPU")).all() and (ours["params.gate"] == "mild").all()


@AARCH64
def test_perf_mode_measures_on_qemu_aarch64_and_marks_the_figure_emulated(aarch64_tools, results_dir):
    # perf runs each case for about a second of a real CPU's time (a minute under qemu): one case
    outcome, df = run_llamacpp("device=qemu-aarch64", "mode=perf", "cases='head_count=16,head_size=64,n_seq_tokens=1,'")
    assert df["case"].tolist() == ["GATED_DELTA_NET(type=f32,head_count=16,head_size=64,n_seq_tokens=1,n_seqs=1,"
                                   "v_repeat=1,permuted=0,kda=0,K=1)/CPU/perf"]
    perf = df.iloc[0]
    assert perf["figures.time.median"] > 0 and perf["work.runs"] > 0 and perf["emulated"]
    assert perf["evidence"][0]["sha256"] == sha256_file(aarch64_tools.program("test-backend-ops"))


@AARCH64
def test_a_gdn_bug_planted_in_ggml_passes_test_backend_ops_and_is_caught_by_testbed(planted_tree, results_dir):
    outcome, df = run_llamacpp("device=qemu-aarch64", "mode=test", f"llamacpp.source={planted_tree}")
    tally = df[df["case"] == "GATED_DELTA_NET/CPU/tally"].iloc[0]
    assert (tally["oracle"], tally["verdict"], tally["metrics.tally"]) == ("test-backend-ops", "pass", "36/36 OK")
    ours = df[df["oracle"] == "nmse"]
    caught = ours[ours["verdict"] == "fail"]
    assert len(caught) == len(ours) == 48  # every case: the decay order changes every output
    # not by a hair: even one token under a mild gate (exp(g) ~ 0.95) is 1000x over the threshold
    assert (caught["metrics.nmse"] > 1e3 * 1e-7).all() and caught["detail"].str.contains("NMSE").all()
    assert outcome.failed == 48


@AARCH64
def test_a_sweep_over_sources_compares_upstream_and_the_patched_fork(upstream_tree, planted_tree, results_dir, capsys):
    from testbed.cli import main

    code = main(["sweep", "experiment=llamacpp", "device=qemu-aarch64", "mode=test",
                 f"llamacpp.source={upstream_tree},{planted_tree}"])
    table = capsys.readouterr().out
    # a row per source, in the sweep's order (their paths may be cut to the terminal's width)
    upstream, planted = (line for line in table.splitlines() if line.startswith("| ") and "36/36 OK" in line)
    assert "36/36 OK" in upstream and "48 pass" in upstream
    assert "36/36 OK" in planted and "48 fail" in planted  # the harness agrees; testbed's reference does not
    assert code == 1


# --- on the host -----------------------------------------------------------------------------------


def test_on_the_host_ggmls_op_passes_testbeds_reference(host_tools, results_dir):
    # built for this machine: the same ELF machine as the shell it runs
    assert elf_machine(host_tools.program("tb_ggml_gdn")) == elf_machine(Path(shutil.which("sh")).resolve())
    outcome, df = run_llamacpp("device=host", "mode=test")
    assert df[df["case"] == "GATED_DELTA_NET/CPU/tally"].iloc[0]["metrics.tally"] == "36/36 OK"
    assert outcome.failed == 0 and (df["oracle"] == "nmse").sum() == 48


# --- refused before anything runs ------------------------------------------------------------------


@pytest.mark.parametrize("override, says", [
    ("llamacpp.source=/nonexistent/llama.cpp", "llamacpp.source='/nonexistent/llama.cpp' is not a llama.cpp tree"),
    ("llamacpp.build=sometimes", "llamacpp.build='sometimes' is not accepted; accepted: auto, True, False"),
])
def test_bad_build_options_are_refused_with_one_line(override, says):
    with pytest.raises(UsageError, match="^" + says.replace("(", r"\(").replace(")", r"\)")):
        runner.check(config.load(["experiment=llamacpp", "device=qemu-aarch64", override]))


def test_a_device_no_build_serves_is_refused_before_connecting():
    with pytest.raises(UsageError, match="device=qemu-arm32 has no tools.test-backend-ops .* cannot be built for it: "
                                         "device=qemu-arm32 has ABI 'armeabi-v7a'"):
        runner.check(config.load(["experiment=llamacpp", "device=qemu-arm32"]))


def test_the_hexagon_build_needs_the_sdks(monkeypatch):
    monkeypatch.delenv("HEXAGON_SDK_ROOT", raising=False)
    with pytest.raises(UsageError, match="needs the Android NDK and Qualcomm's Hexagon SDK"):
        runner.check(config.load(["experiment=llamacpp", "device=hexagon", "llamacpp.build=true"]))
