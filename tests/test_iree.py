"""IREE artifacts and runners on the GDN graphs: export, compile, cache, contract, runners, Vulkan.

Modules are compiled once per session into the project's content-hash cache (.cache/iree), so a
rerun compiles nothing; tests that need a fresh compile use a temporary cache folder.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess

import numpy as np
import pytest

from refimpl import gdn as ref
from testbed.backends.iree.graphs import gdn as graphs
from testbed.errors import UsageError
from testbed.backends.iree.artifacts import (Artifact, Contract, ContractError, TensorSpec, check_signature,
                                    compile_graph, load_target, target_names)
from testbed.backends.iree.runtime import (IncompatibleModule, ModuleRequirements, RuntimeSession, TargetRunner,
                                 benchmark_tool, run_tool, tool_command)
from testbed.oracles.numerical import check_nmse

CHUNK = 8


@pytest.fixture(scope="session")
def gdn_inputs():
    # mild gates keep the state alive across chunks, so chunk-boundary and state bugs show
    return ref.draw_inputs(1, 20, 2, 16, v_repeat=2, gate="mild", seed=3)


@pytest.fixture(scope="session")
def gdn_reference(gdn_inputs):
    x64 = ref.GDNInputs(*(a.astype(np.float64) for a in gdn_inputs.arrays()))
    return dict(zip(("out", "state"), ref.gdn_serial(*x64.arrays())))


@pytest.fixture(scope="session")
def host_artifacts(gdn_inputs):
    return {form: compile_graph(graphs.graph(form, gdn_inputs, CHUNK), "host") for form in graphs.FORMS}


@pytest.fixture(scope="session")
def lavapipe_artifact(gdn_inputs):
    return compile_graph(graphs.graph("chunkwise", gdn_inputs, CHUNK), "lavapipe")


@pytest.fixture(scope="session")
def mali_artifact(gdn_inputs):
    return compile_graph(graphs.graph("serial", gdn_inputs), "mali")


def outputs(results):
    return dict(zip(("out", "state"), results))


# --- targets ---------------------------------------------------------------------------------------


def test_targets_are_config():
    assert {"host", "arm32", "aarch64", "aarch64-linux", "mali", "lavapipe"} <= set(target_names())
    assert "--iree-vulkan-target=llvmpipe" in load_target("lavapipe").flags
    with pytest.raises(UsageError, match="unknown IREE target 'pixel'; accepted: aarch64, aarch64-linux, arm32"):
        load_target("pixel")


# --- host: both runtimes, both forms ---------------------------------------------------------------


@pytest.mark.parametrize("driver", ["local-sync", "local-task"])
@pytest.mark.parametrize("form", graphs.FORMS)
def test_gdn_on_host_matches_reference(host_artifacts, gdn_inputs, gdn_reference, form, driver):
    got = RuntimeSession(host_artifacts[form], driver)(*gdn_inputs.arrays())
    v = check_nmse(gdn_reference, outputs(got))
    assert v.passed, v.detail


def test_planted_transposed_state_fails_through_iree(host_artifacts, gdn_inputs, gdn_reference):
    """A layout bug on the host side (state handed over as S instead of S^T) is caught by the NMSE
    oracle on the module's outputs."""
    x = gdn_inputs
    wrong = np.ascontiguousarray(np.swapaxes(x.state, -1, -2))
    got = RuntimeSession(host_artifacts["chunkwise"])(x.q, x.k, x.v, x.g, x.beta, wrong)
    v = check_nmse(gdn_reference, outputs(got))
    assert not v.passed and v.margin < 0


def test_command_line_tools_give_the_same_bytes(host_artifacts, gdn_inputs, tmp_path):
    """iree-run-module with .npy files (what a device runs) returns what the Python runtime does."""
    art = host_artifacts["chunkwise"]
    by_tool = run_tool(art, "local-sync", gdn_inputs.arrays(), work_dir=tmp_path)
    in_process = RuntimeSession(art, "local-sync")(*gdn_inputs.arrays())
    for a, b in zip(by_tool, in_process):
        assert a.tobytes() == b.tobytes()
    command = tool_command(art, "local-sync", ["/data/in0.npy"], ["/data/out0.npy"], module="/data/m.vmfb")
    assert command[:4] == ["iree-run-module", "--module=/data/m.vmfb", "--device=local-sync",
                           "--function=gdn_chunkwise"]
    assert command[-2:] == ["--input=@/data/in0.npy", "--output=@/data/out0.npy"]


def test_benchmark_tool_reports_repetitions(host_artifacts, gdn_inputs, tmp_path):
    fig = benchmark_tool(host_artifacts["serial"], "local-sync", gdn_inputs.arrays(), reps=3, work_dir=tmp_path)
    assert fig.reps == 3 and 0 < fig.min <= fig.median <= fig.max and fig.unit == "s"


# --- the artifact folder and its cache -------------------------------------------------------------


def test_artifact_folder_holds_everything_to_rebuild(host_artifacts, tmp_path):
    art = host_artifacts["serial"]
    for name in ("module.vmfb", "graph.mlir", "manifest.json", "compile_command.sh", "compiler_version.txt",
                 "flags.txt"):
        assert (art.folder / name).is_file(), name
    manifest = json.loads((art.folder / "manifest.json").read_text())
    assert manifest["target"]["flags"] == list(load_target("host").flags)
    assert "IREE compiler version" in manifest["compiler_version"]
    # the recorded command, run in a copy of the folder, rebuilds the same module
    copy = tmp_path / "rebuild"
    shutil.copytree(art.folder, copy)
    (copy / "module.vmfb").unlink()
    command = (copy / "compile_command.sh").read_text().splitlines()[-1]
    from testbed.backends.iree.artifacts import compiler_path
    subprocess.run(command.replace("iree-compile", compiler_path(), 1), shell=True, cwd=copy, check=True)
    assert (copy / "module.vmfb").read_bytes() == art.module.read_bytes()


def test_second_compile_is_a_cache_hit(gdn_inputs, host_artifacts):
    again = compile_graph(graphs.graph("serial", gdn_inputs, CHUNK), "host")
    assert not again.compiled and again.folder == host_artifacts["serial"].folder
    other_chunk = graphs.graph("chunkwise", gdn_inputs, CHUNK * 2)
    assert other_chunk.name != graphs.graph("chunkwise", gdn_inputs, CHUNK).name


def test_fresh_compile_reports_progress_and_leaves_no_partial_folder(gdn_inputs, tmp_path):
    messages = []
    art = compile_graph(graphs.graph("serial", gdn_inputs), "host", cache_dir=tmp_path, progress=messages.append)
    assert art.compiled and art.compile_seconds > 0
    assert messages[0].startswith("compiling gdn_serial") and "done in" in messages[-1]
    assert [p.name for p in tmp_path.iterdir()] == [art.folder.name]


def test_failed_compile_leaves_nothing(gdn_inputs, tmp_path):
    graph = graphs.graph("serial", gdn_inputs)
    broken = load_target("host").__class__(**{**load_target("host").__dict__,
                                             "flags": ("--iree-hal-target-device=no-such-device",)})
    with pytest.raises(RuntimeError, match="iree-compile failed"):
        compile_graph(graph, broken, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


# --- the contract ----------------------------------------------------------------------------------


def test_signature_check_names_the_first_differing_argument():
    contract = Contract("f", (TensorSpec("tokens", (4,), "int32"), TensorSpec("k_0", (1, 8, 16), "float32")),
                        (TensorSpec("logits", (10,), "float32"),))
    good = "sync func @f(%input0: tensor<4xi32>, %input1: tensor<1x8x16xf32>) -> (%output0: tensor<10xf32>)"
    check_signature(contract, good)
    with pytest.raises(ContractError, match=r"argument 1 \(k_0\) is tensor<1x8x16xf32> in the contract but "
                                            r"tensor<1x9x16xf32>"):
        check_signature(contract, good.replace("1x8x16", "1x9x16"))
    with pytest.raises(ContractError, match=r"argument 1 \(k_0\) .* but nothing"):
        check_signature(contract, "sync func @f(%input0: tensor<4xi32>) -> (%output0: tensor<10xf32>)")
    with pytest.raises(ContractError, match=r"result 1 tensor<2xf32>"):
        check_signature(contract, good.replace("(%output0: tensor<10xf32>)",
                                               "(%output0: tensor<10xf32>, %output1: tensor<2xf32>)"))


def test_manifest_that_disagrees_with_the_module_is_refused(host_artifacts, tmp_path):
    art = host_artifacts["serial"]
    manifest = copy.deepcopy(art.manifest)
    manifest["args"][2]["shape"][-1] += 1
    user = tmp_path / "user"
    user.mkdir()
    shutil.copy(art.module, user / "module.vmfb")
    (user / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ContractError, match=r"argument 2 \(v\)"):
        RuntimeSession(Artifact.load(user))


def test_inputs_are_checked_against_the_contract(host_artifacts, gdn_inputs):
    arrays = list(gdn_inputs.arrays())
    arrays[4] = arrays[4].astype(np.float64)
    with pytest.raises(ContractError, match=r"argument 4 \(beta\) is tensor<1x20x4xf64>.*tensor<1x20x4xf32>"):
        RuntimeSession(host_artifacts["serial"])(*arrays)


# --- users' own artifacts --------------------------------------------------------------------------


def test_user_artifact_runs_through_the_same_runners(host_artifacts, gdn_inputs, gdn_reference, tmp_path):
    """A folder from someone else's exporter: a module, a manifest with only the contract."""
    art = host_artifacts["chunkwise"]
    user = tmp_path / "theirs"
    user.mkdir()
    shutil.copy(art.module, user / "gdn.vmfb")
    (user / "manifest.json").write_text(json.dumps({**art.contract.to_json(), "module": "gdn.vmfb"}))
    theirs = Artifact.load(user)
    for got in (RuntimeSession(theirs)(*gdn_inputs.arrays()), run_tool(theirs, "local-task", gdn_inputs.arrays())):
        assert check_nmse(gdn_reference, outputs(got)).passed
    with pytest.raises(UsageError, match="has no manifest.json"):
        Artifact.load(tmp_path)


# --- Vulkan on lavapipe, and modules for other devices ---------------------------------------------


def test_gdn_on_lavapipe_matches_reference(lavapipe_artifact, gdn_inputs, gdn_reference):
    got = RuntimeSession(lavapipe_artifact, "vulkan")(*gdn_inputs.arrays())
    v = check_nmse(gdn_reference, outputs(got))
    assert v.passed, v.detail


def test_a_vulkan_session_leaves_no_device_threads_behind(lavapipe_artifact, gdn_inputs):
    """A Vulkan device on lavapipe keeps threads polling (about a core each) while it lives. Cached for
    the process by iree.runtime's get_device, it did so for the rest of a test session, and every build
    and timing after it ran against that load (a cold CI run took 75 min instead of 45, llama.cpp's
    builds 13x slower). A session's device must go with it."""
    import gc
    import os
    import time

    threads = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731
    gc.collect()
    before = threads()
    session = RuntimeSession(lavapipe_artifact, "vulkan")
    session(*gdn_inputs.arrays())
    assert threads() > before  # the device's own threads (lavapipe's queue and IREE's), so the count sees them
    del session
    gc.collect()
    deadline = time.monotonic() + 60  # threads that were told to end may take a moment to be gone
    while threads() > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert threads() == before


def test_modules_for_other_devices_are_refused_before_running(host_artifacts, lavapipe_artifact, mali_artifact):
    with pytest.raises(IncompatibleModule, match="not Vulkan: compile for target=lavapipe"):
        RuntimeSession(host_artifacts["serial"], "vulkan")
    with pytest.raises(IncompatibleModule, match="compiled for lavapipe .*compile for target=host"):
        RuntimeSession(lavapipe_artifact, "local-sync")
    # a valhall4 module would load on lavapipe and return wrong numbers: refused by its architecture
    with pytest.raises(IncompatibleModule, match="Vulkan target valhall4 .*llvmpipe"):
        RuntimeSession(mali_artifact, "vulkan")


def test_on_a_mali_device_the_mali_module_is_accepted(monkeypatch, mali_artifact, lavapipe_artifact):
    """The same check on a phone's Vulkan device name (the check reads only the name)."""
    from testbed.backends.iree import runtime as iree_runner

    monkeypatch.setattr(iree_runner, "vulkan_device_name", lambda: "Mali-G78 MC24")
    iree_runner.check_runs_on(mali_artifact, "vulkan")
    with pytest.raises(IncompatibleModule, match="Vulkan target llvmpipe .*Mali-G78"):
        iree_runner.check_runs_on(lavapipe_artifact, "vulkan")


def test_target_runner_uses_the_targets_driver(gdn_inputs, gdn_reference):
    runner = TargetRunner("lavapipe")
    assert runner.driver == "vulkan"
    got = runner(graphs.graph("chunkwise", gdn_inputs, CHUNK), *gdn_inputs.arrays())
    assert check_nmse(gdn_reference, outputs(got)).passed
    with pytest.raises(ContractError, match="accepted: vulkan"):
        TargetRunner("lavapipe", "local-task")


@pytest.mark.parametrize("target, fmt, arch", [("arm32", "embedded-elf-arm_32", None),
                                               ("aarch64", "embedded-elf-arm_64", None),
                                               ("mali", "vulkan-spirv-fb", "valhall4")])
def test_device_targets_compile(gdn_inputs, target, fmt, arch, mali_artifact):
    art = mali_artifact if target == "mali" else compile_graph(graphs.graph("serial", gdn_inputs), target)
    need = ModuleRequirements.of(art.module)
    assert need.formats == (fmt,)
    assert (arch in need.gpu_archs) if arch else not need.gpu_archs
    if target != "mali":
        with pytest.raises(IncompatibleModule, match=f"compiled for {target}"):
            RuntimeSession(art, "local-sync")


# --- the gdn experiment's iree backend -------------------------------------------------------------


@pytest.mark.parametrize("target", ["host", "lavapipe"])
def test_gdn_experiment_backend_iree(target):
    """`gdn backend=iree`: both forms of an awkward case (T = 65 over chunks of 64, two sequences,
    grouped value heads) through the experiment's own backend. (The KDA cases compile for longer;
    `testbed run gdn backend=iree` runs them all.)"""
    from testbed.experiments import gdn

    case = next(c for c in gdn.AWKWARD_CASES if c.n_seq_tokens == 65 and not c.kda)
    x = case.inputs(0)
    x64 = ref.GDNInputs(*(a.astype(np.float64) for a in x.arrays()))
    reference = dict(zip(("out", "state"), ref.gdn_serial(*x64.arrays())))
    from testbed import config
    from testbed.backends.iree import gdn as iree_gdn
    from testbed.devices import connect, load_profile

    device = connect(load_profile(target))  # the host, or the lavapipe profile (the host's software GPU)
    be = iree_gdn.runner(config.load([f"device={target}", "backend=iree"], experiment="gdn").cfg, device)
    for got in (be.serial(x), be.chunkwise(x, 64)):
        v = check_nmse(reference, outputs(got))
        assert v.passed, v.detail


@pytest.mark.parametrize("experiment, override, message", [
    ("gdn", "target=arm32", "target=arm32 builds embedded-elf-arm_32 code; device=host (host) runs embedded-elf-x86_64"),
    ("chunk_prefill", "target=mali", "target=mali builds vulkan modules; device=host runs local ones"),
    ("chunk_prefill", "iree.weights=fp16", "iree.weights='fp16' is not accepted; accepted: parameters, constants"),
    ("iree_chunk_bench", "timer=stopwatch", "timer='stopwatch' is not accepted; accepted: tool, python, both"),
])
def test_bad_iree_options_are_one_line_usage_errors(experiment, override, message):
    from testbed import config, runner

    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        runner.check(config.load(["backend=iree", override], experiment=experiment))


# --- the iree_artifact experiment: a user's folder from the command line ---------------------------


def _user_folder(tmp_path, art, inputs, expected):
    user = tmp_path / "export"
    for sub in ("inputs", "expected"):
        (user / sub).mkdir(parents=True)
    shutil.copy(art.module, user / "module.vmfb")
    (user / "manifest.json").write_text(json.dumps(art.contract.to_json()))
    for i, a in enumerate(inputs):
        np.save(user / "inputs" / f"input{i}.npy", a)
    for i, a in enumerate(expected):
        np.save(user / "expected" / f"output{i}.npy", a)
    return user


@pytest.mark.parametrize("runner_kind", ["python", "tool"])
def test_iree_artifact_experiment_checks_a_users_folder(results_dir, tmp_path, host_artifacts, gdn_inputs,
                                                        gdn_reference, runner_kind):
    from testbed import config, runner

    x = gdn_inputs
    # planted: the reference computed with the other grouped-head mapping (Hugging Face's
    # interleaved instead of llama.cpp's tiled) must fail the oracle
    x64 = [a.astype(np.float64) for a in x.arrays()]
    wrong = ref.gdn_serial(*x64, head_map="interleaved")
    for expected, verdict in (((gdn_reference["out"], gdn_reference["state"]), "pass"), (wrong, "fail")):
        user = _user_folder(tmp_path / verdict, host_artifacts["serial"], x.arrays(), expected)
        rc = config.load([f"artifact={user}", f"inputs={user / 'inputs'}", f"expected={user / 'expected'}",
                          f"runner={runner_kind}"], experiment="iree_artifact")
        (record,) = runner.execute(rc).rows
        assert record["verdict"] == verdict, record["detail"]


def test_iree_artifact_experiment_bad_folder(tmp_path):
    from testbed import config, runner

    with pytest.raises(UsageError, match="artifact=.* is not a folder"):
        runner.check(config.load([f"artifact={tmp_path / 'nope'}"], experiment="iree_artifact"))
    with pytest.raises(UsageError, match="artifact is not set"):
        runner.check(config.load([], experiment="iree_artifact"))
