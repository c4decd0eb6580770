"""A user's prefill_with_past module by seed 000's contract: `testbed run chunk_prefill backend=iree
iree.artifact=DIR model.checkpoint=...` (testbed.backends.iree.user_module, testbed.oracles.module_contract).

testbed's own graph is written out as a user's folder (module.mlir or module.vmfb, parameters.irpa,
manifest.json) beside a checkpoint folder, and judged on the selected device (`pytest --device=D`: the
host by default; lavapipe and qemu-aarch64 run the same tests). Then the contract faults an exporter
makes, planted in the module, each caught and named by its argument or result: two arguments read
swapped, select read one row off, a mask of the wrong type, K/V results in the wrong order, cos and sin
exchanged, the tables of one layer type missing; faults no single argument explains (RoPE one position
late, a window one key wider, a cache write one row late) said so, with the first row, layer and head that
differ, and never blamed on a head reading another head's mask; and folders that are refused before anything runs
(another contract or version, a signature that disagrees, a missing parameter archive, a changed
file, another model), exit 2 with one line and nothing stored.

One small shape in the default run: 2 layers (local, global; window 16 so the masks differ), C = 8
rows against 40 cache rows; each module compiles in seconds once and is then a cache hit. The seed's
FunctionGemma shape (18 layers, 44 arguments, 37 results, P = 800, C = 64, position 851) is opt-in:
`-m slow_build` (a gigabyte of seeded weights, minutes of compile).
"""

import json
import shutil

import numpy as np
import pytest

from refimpl import gemma
from testbed import backends
from testbed.backends.iree.artifacts import Contract, Graph, TensorSpec
from testbed.backends.iree.graphs import gemma as graphs
from testbed.backends.iree.user_module import UserModuleRunner, load, write_user_folder
from testbed.cli import main
from testbed.errors import UsageError
from testbed.models import contract as gemma_contract
from testbed.models.checkpoints import load_checkpoint, save_hf_folder
from testbed.oracles.module_contract import check_module
from testbed.oracles.tokens import Reference, TokenCase

pytestmark = [pytest.mark.requires("iree"),
              pytest.mark.skipif(shutil.which("iree-compile") is None, reason="iree-base-compiler is not installed")]

CHUNK, ROWS = 8, 40
CASE = TokenCase(30, 6, CHUNK)        # 10 empty cache rows, 2 pad rows: every part of the contract in use


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A checkpoint folder of the small shape, read back as a user's run reads it."""
    folder = tmp_path_factory.mktemp("checkpoint")
    cfg = gemma.tiny_config(layers=2, layer_types=("local", "global"), window=16)
    save_hf_folder(folder, cfg, gemma.init_weights(cfg, 0))
    cfg, w = load_checkpoint(folder)
    return folder, cfg, w


@pytest.fixture(scope="module")
def reference(model):
    _, cfg, w = model
    return Reference(w, cfg, np.random.default_rng(0).integers(0, cfg.vocab, ROWS + CHUNK))


def target_of(device) -> str:
    return device.profile.iree["target"]


def runner_for(folder, device, model):
    from omegaconf import OmegaConf

    _, cfg, w = model
    run_cfg = OmegaConf.create({"target": target_of(device), "threads": 1,
                                "iree": {"driver": None, "past_bucket": 128, "weights": "parameters",
                                         "artifact": str(folder)}})
    return backends.load("iree", "gemma").backend(w, cfg, run_cfg, device)


def judge(folder, device, model, reference, case=CASE):
    run = runner_for(folder, device, model)
    assert isinstance(run, UserModuleRunner)
    verdicts = check_module(run.call, reference, case, run.user.past, run.user.contract)
    return {v.oracle: v for v in verdicts}, run


# --- testbed's own module as a user's folder -------------------------------------------------------


@pytest.fixture(scope="module")
def clean(model, tmp_path_factory):
    _, cfg, w = model
    return write_user_folder(tmp_path_factory.mktemp("user") / "clean", graphs.prefill_with_past(cfg, w, CHUNK, ROWS),
                             cfg)


def test_the_folder_holds_what_a_user_brings(clean, model):
    _, cfg, _ = model
    manifest = json.loads((clean / "manifest.json").read_text())
    assert manifest["contract"]["graph"] == "prefill_with_past" and manifest["contract"]["version"] == 1
    assert {k: v["path"] for k, v in manifest["files"].items()} == {"module": "module.mlir",
                                                                   "parameters": "parameters.irpa"}
    # seed 000's order: tokens; per layer its type's tables on first use, K, V, its mask on first use; select
    names = [a["name"] for a in manifest["contract"]["args"]]
    assert names == ["tokens", "cos_local", "sin_local", "k_0", "v_0", "mask_local",
                     "cos_global", "sin_global", "k_1", "v_1", "mask_global", "select"]
    assert len(manifest["contract"]["results"]) == 1 + 2 * cfg.layers


def test_testbeds_own_module_passes_on_the_device(clean, device, model, reference):
    verdicts, run = judge(clean, device, model, reference)
    assert {name: v.verdict for name, v in verdicts.items()} == dict.fromkeys(
        ["token", "logits", "cache", "mask_heads"], "pass"), {n: v.detail for n, v in verdicts.items()}
    assert verdicts["token"].metrics["position"] == CASE.position and verdicts["token"].metrics["select_row"] == 5
    evidence = run.evidence.take()
    assert evidence and all(e["device"] == device.name and e["sha256"] == run.staged().sha256 for e in evidence)


def test_the_command_line_judges_a_users_folder_and_records_its_digests(clean, model, device, results_dir, capsys):
    checkpoint, _, _ = model
    code = main(["run", "chunk_prefill", "backend=iree", f"device={device.name}", f"iree.artifact={clean}",
                 f"model.checkpoint={checkpoint}", f"chunk={CHUNK}", "cases=[{past:30,tokens:6},{past:40,tokens:8}]",
                 "mode=all", "bench.reps=2", "bench.warmup=0"])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (results_dir / "records.jsonl").read_text().splitlines()]
    oracles = [r for r in rows if r.get("kind") == "oracle"]
    assert len(oracles) == 8 and all(r["verdict"] == "pass" for r in oracles)
    timed = [r for r in rows if r.get("kind") == "measure"]
    assert [r["params"]["form"] for r in timed] == ["chunk_call"] and timed[0]["figures"]["time"]["reps"] == 2
    for r in oracles + timed:
        assert r["artifacts"]["user_module_sha256"] == gemma_contract.sha256_file(clean / "module.mlir")
        assert r["artifacts"]["user_manifest_sha256"] == gemma_contract.sha256_file(clean / "manifest.json")
        assert r["artifacts"]["user_parameters_sha256"] == gemma_contract.sha256_file(clean / "parameters.irpa")


def test_the_parameters_may_be_a_safetensors_file(clean, model, device, reference, tmp_path):
    """The seed's exporter writes gemma-prefill-with-past.safetensors: the checkpoint's own file serves,
    its tensors named as the module's parameters."""
    checkpoint, _, _ = model
    folder = copy_of(clean, tmp_path)
    (folder / "parameters.irpa").unlink()
    shutil.copyfile(checkpoint / "model.safetensors", folder / "gemma-prefill-with-past.safetensors")
    edit_manifest(folder, lambda m: m["files"].update(parameters={"path": "gemma-prefill-with-past.safetensors"}))
    verdicts, run = judge(folder, device, model, reference)
    assert all(v.passed for v in verdicts.values()), {n: v.detail for n, v in verdicts.items()}
    assert run.user.parameters.name == "gemma-prefill-with-past.safetensors"


# --- planted contract faults -----------------------------------------------------------------------


def planted(cfg, w, fault: str) -> Graph:
    """testbed's graph with one exporter's mistake in the module (the manifest stays the contract's)."""
    import jax.numpy as jnp

    good = graphs.prefill_with_past(cfg, w, CHUNK, ROWS)
    index = {a.name: i for i, a in enumerate(good.contract.args)}

    def swapped(args, a, b):
        args = list(args)
        args[index[a]], args[index[b]] = args[index[b]], args[index[a]]
        return args

    def fn(weights, *args):
        if fault == "kv_args_swapped":            # reads v_1 where k_1 is, and k_1 where v_1 is
            return good.fn(weights, *swapped(args, "k_1", "v_1"))
        if fault == "cos_sin_swapped":
            return good.fn(weights, *swapped(args, "cos_global", "sin_global"))
        if fault == "select_one_late":            # the row after the one-hot's
            return good.fn(weights, *args[:-1], jnp.roll(args[-1], 1))
        if fault == "mask_wrong_type":            # the local layers get the global mask
            args = list(args)
            args[index["mask_local"]] = args[index["mask_global"]]
            return good.fn(weights, *args)
        if fault == "masks_swapped":
            return good.fn(weights, *swapped(args, "mask_local", "mask_global"))
        if fault == "rope_one_position_late":     # the global layers rotate each row as the position after it
            args = list(args)
            for name in ("cos_global", "sin_global"):
                args[index[name]] = jnp.roll(args[index[name]], -1, axis=0)
            return good.fn(weights, *args)
        if fault == "window_one_key_wider":       # the local layers also see the key just outside the window
            args = list(args)
            mask = args[index["mask_local"]]
            seen = mask > -1e29
            older = jnp.roll(seen, -1, axis=-1) & (jnp.arange(ROWS + CHUNK) < ROWS - 1)
            args[index["mask_local"]] = jnp.where(~seen & older, jnp.roll(mask, -1, axis=-1), mask)
            return good.fn(weights, *args)
        out = list(good.fn(weights, *args))
        if fault == "kv_results_swapped":         # returns v_0 before k_0
            out[1], out[2] = out[2], out[1]
        if fault == "v_1_new_rows_off":           # no contract fault: a computation off by 0.01
            out[4] = out[4] + 0.01 * (jnp.arange(ROWS + CHUNK) >= ROWS)[None, :, None]
        if fault == "k_0_new_rows_one_late":      # the cache write lands one row late
            out[1] = jnp.concatenate([out[1][:, :ROWS], jnp.roll(out[1][:, ROWS:], 1, axis=1)], axis=1)
        return tuple(out)

    return Graph(f"{good.name}_fault_{fault}", fn, good.contract, good.weights)


FAULTS = [
    ("kv_args_swapped", "mlir", "cache", "it reads argument 9 (v_1) as k_1, argument 8 (k_1) as v_1"),
    ("cos_sin_swapped", "mlir", "cache",
     "argument 6 (cos_global) and argument 7 (sin_global) are read in each other's place"),
    ("select_one_late", "mlir", "logits", "argument 11 (select) is read one row late"),
    ("mask_wrong_type", "mlir", "cache",
     "local layers attend with argument 10 (mask_global), not argument 5 (mask_local): a mask of the wrong type"),
    ("masks_swapped", "mlir", "cache",
     "argument 5 (mask_local) and argument 10 (mask_global) are read in each other's place: masks of the wrong type"),
    ("kv_results_swapped", "vmfb", "cache",
     "result 1 (k_0_out) holds v_0_out, result 2 (v_0_out) holds k_0_out"),
    ("v_1_new_rows_off", "mlir", "cache",
     "no single argument or result fault explains it; the first result that differs is result 4 (v_1_out), first "
     "at row 40 (chunk row 0, position 30) KV head 0"),
]


@pytest.mark.parametrize("fault, form, fails, named", FAULTS, ids=[f[0] for f in FAULTS])
def test_a_planted_contract_fault_fails_naming_the_argument(fault, form, fails, named, model, reference, device,
                                                             tmp_path):
    _, cfg, w = model
    folder = write_user_folder(tmp_path / fault, planted(cfg, w, fault), cfg, form=form, target=target_of(device))
    verdicts, _ = judge(folder, device, model, reference)
    assert verdicts[fails].verdict == "fail"
    assert named in verdicts[fails].detail, verdicts[fails].detail
    assert all(named in v.detail for v in verdicts.values() if v.oracle != "mask_heads" and not v.passed)


# faults that are not a head reading another head's mask, yet fail mask_heads too (the module is wrong
# whatever its masks): where the first K/V result differs, and that no head-mask fault is named
NOT_HEAD_MASK_FAULTS = [
    ("rope_one_position_late", "result 3 (k_1_out), first at row 40 (chunk row 0, position 30) KV head 0"),
    ("window_one_key_wider", "result 3 (k_1_out), first at row 40 (chunk row 0, position 30) KV head 0"),
    ("k_0_new_rows_one_late", "result 1 (k_0_out), first at row 40 (chunk row 0, position 30) KV head 0"),
]


@pytest.mark.parametrize("fault, first", NOT_HEAD_MASK_FAULTS, ids=[f[0] for f in NOT_HEAD_MASK_FAULTS])
def test_a_rope_window_or_cache_fault_is_not_called_a_head_mask_fault(fault, first, model, reference, device,
                                                                       tmp_path):
    _, cfg, w = model
    folder = write_user_folder(tmp_path / fault, planted(cfg, w, fault), cfg, target=target_of(device))
    verdicts, _ = judge(folder, device, model, reference)
    assert verdicts["cache"].verdict == "fail" and verdicts["mask_heads"].verdict == "fail"
    assert f"no single argument or result fault explains it; the first result that differs is {first}" in \
        verdicts["cache"].detail, verdicts["cache"].detail
    mask = verdicts["mask_heads"].detail
    assert "a head reads another head's mask" not in mask, mask
    assert "the module fails with the contract's own masks too" in mask and first in mask, mask


def test_a_module_that_reads_one_heads_mask_fails_mask_heads(model, reference, device, tmp_path):
    """The masks the contract passes are the same for every head, so only mask_heads can see this."""
    _, cfg, w = model
    good = graphs.prefill_with_past(cfg, w, CHUNK, ROWS)
    masks = [i for i, a in enumerate(good.contract.args) if a.name.startswith("mask_")]

    def fn(weights, *args):
        args = list(args)
        for i in masks:
            args[i] = args[i][:, :1] + 0 * args[i]  # head 0's mask broadcast to every head
        return good.fn(weights, *args)

    folder = write_user_folder(tmp_path / "one_head", Graph(f"{good.name}_one_head", fn, good.contract, good.weights),
                               cfg)
    verdicts, _ = judge(folder, device, model, reference)
    assert [n for n, v in verdicts.items() if not v.passed] == ["mask_heads"]
    assert "a head reads another head's mask: every head attends with head 0's rows" in verdicts["mask_heads"].detail


# --- folders refused before anything runs ----------------------------------------------------------


def missing_tables(cfg, w) -> tuple[Graph, list]:
    """An exporter that passes the local tables to the global layer: no cos/sin on the global type's first use."""
    good = graphs.prefill_with_past(cfg, w, CHUNK, ROWS)
    kept = [a for a in good.contract.args if a.name not in ("cos_global", "sin_global")]
    at = [a.name for a in good.contract.args].index("cos_global")

    def fn(weights, *args):
        return good.fn(weights, *args[:at], args[1], args[2], *args[at:])

    contract = Contract(good.contract.function, tuple(kept), good.contract.results)
    return Graph(f"{good.name}_no_global_tables", fn, contract, good.weights), kept


def seed_contract(cfg) -> gemma_contract.Contract:
    return gemma_contract.prefill_with_past_contract(cfg, CHUNK, ROWS)


def test_missing_tables_on_first_use_are_named(model, device, tmp_path):
    _, cfg, w = model
    graph, _ = missing_tables(cfg, w)
    honest = write_user_folder(tmp_path / "honest", graph, cfg)  # its manifest says what the module takes
    with pytest.raises(UsageError, match=r"argument 6 is k_1 float32\[2, 40, 16\]; the seed's contract .* says "
                                         r"cos_global float32\[8, 16\]"):
        load(honest, cfg, target_of(device))
    claims = write_user_folder(tmp_path / "claims", graph, cfg, manifest_contract=seed_contract(cfg))
    with pytest.raises(UsageError, match=r"module.mlir disagrees with .*manifest.json: .*argument 6 \(cos_global\) "
                                         r"is tensor<8x16xf32> in the contract but tensor<2x40x16xf32> in the module"):
        load(claims, cfg, target_of(device))


def edit_manifest(folder, change):
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def copy_of(folder, tmp_path):
    return shutil.copytree(folder, tmp_path / "copy")


def _other_graph(m):
    m["contract"]["graph"] = "decode_with_past"


def _other_version(m):
    m["contract"]["version"] = 2


def _drop_result(m):
    m["contract"]["results"].pop()


def _wrong_dtype(m):
    m["contract"]["args"][3]["dtype"] = "float16"


def _other_model(m):
    m["model"]["window"] = 512


def _files_as(value):
    def change(m):
        m["files"] = value
    return change


def _version_true(m):
    m["contract"]["version"] = True


def _module_vmfb(m):  # the module a .vmfb the next column writes
    m["files"]["module"] = {"path": "module.vmfb"}


REFUSED = [
    ("another contract", _other_graph, None, "contract graph='decode_with_past' version=1 is not accepted; "
                                             "accepted: graph='prefill_with_past' version=1"),
    ("another version", _other_version, None, "version=2 is not accepted"),
    ("a result fewer", _drop_result, None, "result 4 is nothing; the seed's contract for this model (2 layers, 5 "
                                           "results, the manifest has 4) says v_1_out float32[2, 48, 16]"),
    ("a wrong dtype", _wrong_dtype, None, "argument 3 is k_0 float16[2, 40, 16]; the seed's contract"),
    ("another model", _other_model, None, "model.window=512, the run's model has 16"),
    ("no parameter archive", None, "parameters.irpa", "files.parameters='parameters.irpa': "),
    ("a changed module", None, "module.mlir", "files.module='module.mlir' has sha256"),
    ("a module that does not compile", None, "module.mlir", "module.mlir does not compile for target="),
    # what issue 44 measured as tracebacks
    ("files as a list", _files_as(["module.mlir"]), None, "files=['module.mlir'] is not accepted; accepted: files: "
                                                          "{module: {path: NAME, sha256: ...}}"),
    ("files as a string", _files_as("module.mlir"), None, "files='module.mlir' is not accepted"),
    ("a path out of the folder", _files_as({"module": {"path": "../module.mlir"}}), None,
     "files.module={'path': '../module.mlir'} is not accepted"),
    ("version true", _version_true, None, "version=True is not accepted"),
    ("a random module", _module_vmfb, ("module.vmfb", bytes(range(256)) * 16),
     "module.vmfb: not a module IREE's runtime loads (INVALID_ARGUMENT"),
    ("an empty module", _module_vmfb, ("module.vmfb", b""), "module.vmfb: the module is empty"),
    ("an ELF as the module", _module_vmfb, ("module.vmfb", b"\x7fELF\x02\x01\x01" + bytes(4089)),
     "module.vmfb: not a module IREE's runtime loads"),
]


@pytest.mark.parametrize("what, change, touch, message", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_bad_folder_is_one_line_exit_2_and_nothing_stored(what, change, touch, message, clean, model, device,
                                                             results_dir, tmp_path, capsys):
    folder = copy_of(clean, tmp_path)
    if isinstance(touch, tuple):  # a file written as given
        (folder / touch[0]).write_bytes(touch[1])
    if change:
        edit_manifest(folder, change)
    elif what == "no parameter archive":
        (folder / touch).unlink()
    elif what == "a module that does not compile":
        (folder / touch).write_text("func.func @prefill_with_past(%a: tensor<8xi32>) -> tensor<8xf32> {\n"
                                    "  return %a : tensor<8xf32>\n}\n")
        edit_manifest(folder, lambda m: m["files"]["module"].pop("sha256"))
    else:
        (folder / touch).write_text((folder / touch).read_text() + "\n// edited\n")
    checkpoint, _, _ = model
    code = main(["run", "chunk_prefill", "backend=iree", f"device={device.name}", f"iree.artifact={folder}",
                 f"model.checkpoint={checkpoint}", f"chunk={CHUNK}", "cases=[{past:30,tokens:6}]", "mode=oracle"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert str(folder / "manifest.json") in err[0] or str(folder) in err[0]
    assert not results_dir.exists() or not any(results_dir.rglob("*.*"))


def test_cases_that_do_not_fit_the_module_are_refused(clean, model, device, results_dir, capsys):
    checkpoint, _, _ = model
    common = ["run", "chunk_prefill", "backend=iree", f"device={device.name}", f"iree.artifact={clean}",
              f"model.checkpoint={checkpoint}", "mode=oracle"]
    assert main([*common, "chunk=64", "cases=[{past:30,tokens:6}]"]) == 2
    assert "takes C=8 rows; accepted: chunk=8" in capsys.readouterr().err
    assert main([*common, f"chunk={CHUNK}", "cases=[{past:41,tokens:6}]"]) == 2
    assert "accepted: past <= 40, tokens <= 8" in capsys.readouterr().err


def test_a_module_that_fails_on_the_device_is_exit_4_and_never_a_pass(clean, model, device, results_dir, tmp_path,
                                                                       capsys):
    """A manifest that forgets the parameter archive: the module cannot load its weights there."""
    folder = copy_of(clean, tmp_path)
    edit_manifest(folder, lambda m: m["files"].pop("parameters"))
    checkpoint, _, _ = model
    code = main(["run", "chunk_prefill", "backend=iree", f"device={device.name}", f"iree.artifact={folder}",
                 f"model.checkpoint={checkpoint}", f"chunk={CHUNK}", "cases=[{past:30,tokens:6}]", "mode=oracle"])
    assert code == 4, capsys.readouterr().err
    rows = [json.loads(line) for line in (results_dir / "records.jsonl").read_text().splitlines()]
    assert [r["verdict"] for r in rows if r.get("kind") == "oracle"] == ["error"]


def test_the_export_command_writes_a_users_folder(tmp_path, capsys):
    from testbed.backends.iree.user_module import main as export

    assert export([str(tmp_path / "out"), "--preset", "tiny", "--chunk", "8", "--past", "40"]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    want = gemma_contract.prefill_with_past_contract(gemma.tiny_config(), 8, 40)
    assert manifest["contract"] == json.loads(json.dumps(want.to_dict()))
    assert manifest["files"]["module"]["sha256"] == gemma_contract.sha256_file(tmp_path / "out" / "module.mlir")
    assert "C=8 against 40 cache rows, 6 layers" in capsys.readouterr().out


# --- the seed's shape (opt-in) ---------------------------------------------------------------------


@pytest.mark.slow_build
def test_the_seeds_functiongemma_shape_passes_at_position_851(device, tmp_path):
    """FunctionGemma's shape with seeded weights: 44 arguments, 37 results; P = 800 cached positions and a
    52-token chunk padded to 64, select on row 51, the token at position 851."""
    from omegaconf import OmegaConf

    cfg = gemma.functiongemma_config()
    w = gemma.init_weights(cfg, 0)
    folder = write_user_folder(tmp_path / "functiongemma", graphs.prefill_with_past(cfg, w, 64, 800), cfg)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert (len(manifest["contract"]["args"]), len(manifest["contract"]["results"])) == (44, 37)
    run_cfg = OmegaConf.create({"target": target_of(device), "threads": 1,
                                "iree": {"driver": None, "past_bucket": 128, "weights": "parameters",
                                         "artifact": str(folder)}})
    run = backends.load("iree", "gemma").backend(w, cfg, run_cfg, device)
    ref = Reference(w, cfg, np.random.default_rng(0).integers(0, cfg.vocab, 852))
    verdicts = {v.oracle: v for v in check_module(run.call, ref, TokenCase(800, 52, 64), run.user.past,
                                                  run.user.contract)}
    assert verdicts["token"].metrics["position"] == 851 and verdicts["token"].metrics["select_row"] == 51
    assert all(v.passed for v in verdicts.values()), {n: v.detail for n, v in verdicts.items()}
