"""`testbed ab A B backend=llamacpp`: two llama.cpp trees built for a device, ggml's GATED_DELTA_NET
measured interleaved (tb_ggml_gdn, its timed call marked for the counters), and every oracle run on
both trees; seed 002's step P1.1 replayed with the patches in tests/data/llamacpp/:

  gdn-chunk64.patch             ggml's CPU op walks the tokens in chunks of 64 through the same per-token
                                code (P1.1 itself): both trees pass the oracles, instructions within 1%
  gdn-chunk64-drop-beta.patch   the same, but the second chunk forgets beta: B fails, the case named
  gdn-chunk64-extra-work.patch  the same, plus every fifth token's output computed twice (about 5% more
                                work, the same values): B is called slower, both counts shown
  does-not-compile.patch        a name nothing declares in ggml-alloc.c: exit 4 with the compiler's error

Costs, measured on 2 cores shared with other jobs (load 20-25): resolving a patched tree copies the
sdist's built files once (cached by content). Each patched tree is one more llama.cpp build, of which
ccache shares everything but the patched file (ggml-cpu's ops.cpp) and the link. The default run keeps
the bad input (about 30 s together) and one replay on qemu-aarch64, P1.1 and its planted bug (61 s with
every tree built; 326 s cold, the sdist's aarch64 build already made by test_llamacpp_built.py). The
three verdicts on qemu-hexagon are opt-in (`-m slow_build`): about 95 s each with their trees built; a
cold Hexagon build of the sdist took 24 min here (zig's musl and libc++ first), each patched tree then
2 to 4 min. The host's replay (opt-in too) pairs CPU time and counts under valgrind: 181 s with its four
builds made (A and B, native and generic).
"""

import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from testbed import PROJECT_ROOT, cli
from testbed.backends.llamacpp import build, trees
from testbed.backends.native import build as kernel_build
from testbed.devices.transport import sha256_file
from testbed.results import ResultsStore
from tests.cli_support import said

DATA = PROJECT_ROOT / "tests" / "data" / "llamacpp"
CHUNK64, DROP_BETA, EXTRA_WORK = (str(DATA / f"gdn-{n}.patch") for n in ("chunk64", "chunk64-drop-beta",
                                                                        "chunk64-extra-work"))
DOES_NOT_COMPILE = str(DATA / "does-not-compile.patch")

BUILDS = pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("ninja") is None,
                            reason="cmake and ninja build llama.cpp (scripts/bootstrap.sh --test)")
AARCH64 = pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None or shutil.which("qemu-aarch64") is None,
                             reason="g++-aarch64-linux-gnu and qemu-user (scripts/bootstrap.sh --test)")


def ab_command(capsys, *args) -> tuple[int, str, str]:
    """`testbed ab ARGS` in this process: its exit status, stdout and stderr."""
    status = cli.main(["ab", *args])
    out = capsys.readouterr()
    return status, out.out, out.err


def fake_checkout(folder: Path) -> Path:
    """A git repository holding the two files that make a folder a llama.cpp tree, one commit."""
    for name in ("ggml/include/ggml.h", "tests/test-backend-ops.cpp"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(f"// {name}\n")
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for argv in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "one"]):
        subprocess.run(["git", "-C", str(folder), *argv], check=True, env=env, capture_output=True)
    return folder


# --- trees: resolved by content, or refused in one line (exit 2, nothing built or stored) -----------


def test_a_patch_file_is_the_sdist_with_it_applied_in_a_content_hashed_copy():
    sdist = trees.resolve("sdist")
    chunked = trees.resolve(CHUNK64)
    assert chunked.spec == f"sdist+{CHUNK64}" and chunked.revision.startswith("sdist:llama-cpp-python==0.3.36+patch:")
    assert trees.resolve(f"sdist+{CHUNK64}") == trees.LlamaTree(f"sdist+{CHUNK64}", chunked.revision, chunked.source)
    ops = "ggml/src/ggml-cpu/ops.cpp"
    assert "GDN_CHUNK = 64" in (chunked.source / ops).read_text() and "GDN_CHUNK" not in (sdist.source / ops).read_text()
    assert build.source_hash(chunked.source) != build.source_hash(sdist.source)
    # every other file a build reads is the sdist's, byte for byte
    assert sha256_file(chunked.source / "ggml/src/ggml.c") == sha256_file(sdist.source / "ggml/src/ggml.c")


def test_a_patch_that_does_not_apply_is_refused_quoting_patch(results_dir, capsys, tmp_path):
    stale = tmp_path / "stale.patch"
    stale.write_text(Path(CHUNK64).read_text().replace("-        for (int64_t t = 0; t < n_tokens; t++) {",
                                                       "-        for (int64_t t = 0; t < n_tokens; ++t) {"))
    before = sorted(trees.AB_CACHE.iterdir()) if trees.AB_CACHE.is_dir() else []
    status, out, err = ab_command(capsys, "sdist", str(stale), "backend=llamacpp", "device=qemu-aarch64")
    assert status == 2 and out == ""
    (line,) = said(err)
    assert f"patch {str(stale)!r} does not apply to sdist: " in line and "FAILED" in line
    assert sorted(trees.AB_CACHE.iterdir()) == before and not results_dir.exists()  # nothing half-made


@pytest.mark.parametrize("spec, says", [
    ("{tmp}", "is a folder but not a llama.cpp tree"),
    ("no-such-revision", "is neither sdist, a folder nor a patch file, and no llama.cpp checkout is named"),
    ("sdist+{tmp}/missing.patch", "the patch '{tmp}/missing.patch' is not a file"),
])
def test_a_side_that_names_no_llamacpp_tree_is_refused_in_one_line(spec, says, results_dir, capsys, tmp_path):
    spec, says = spec.format(tmp=tmp_path), says.format(tmp=tmp_path)
    status, out, err = ab_command(capsys, "sdist", spec, "backend=llamacpp", "device=qemu-aarch64")
    assert status == 2 and out == ""
    (line,) = said(err)
    assert says in line and "accepted: sdist, a llama.cpp folder" in line
    assert not results_dir.exists()


def test_a_revision_that_does_not_exist_in_the_checkout_is_refused(results_dir, capsys, tmp_path):
    repo = fake_checkout(tmp_path / "llama.cpp")
    status, out, err = ab_command(capsys, "HEAD", "v9.9.9", "backend=llamacpp", "device=qemu-aarch64", "--repo",
                                  str(repo))
    assert status == 2 and out == ""
    (line,) = said(err)
    assert f"'v9.9.9' is not a revision of {repo}" in line and "accepted: a revision that exists there" in line
    assert not results_dir.exists()


LINK_PATCH = """\
diff --git a/ggml/src/evil.c b/ggml/src/evil.c
new file mode 120000
index 0000000..1111111
--- /dev/null
+++ b/ggml/src/evil.c
@@ -0,0 +1 @@
+{outside}
\\ No newline at end of file
"""


@pytest.mark.parametrize("kind", ["folder", "patch", "revision", "llamacpp.source"])
def test_a_symbolic_link_in_a_tree_is_refused_and_nothing_is_copied(kind, results_dir, capsys, tmp_path):
    """Issue 44, item 3: a folder, a patch (git diffs make links) or a --repo revision holding a link among
    the files a build reads is refused as a kernels/ tree is: exit 2, one line, nothing stored, and the
    outside file's bytes copied nowhere (no patched or revision copy is kept)."""
    outside = tmp_path / "outside.txt"
    outside.write_text("bytes from outside the tree\n")
    clean = fake_checkout(tmp_path / "clean")
    kept = []  # the copies a resolution would keep, none of which may appear
    if kind == "patch":
        patch = tmp_path / "link.patch"
        patch.write_text(LINK_PATCH.format(outside=outside))
        digest = hashlib.sha256(build.source_hash(clean).encode() + b"\0" + patch.read_bytes()).hexdigest()[:16]
        kept, args = [f"patched-{digest}"], [str(clean), f"{clean}+{patch}"]
    elif kind == "revision":
        repo = tmp_path / "llama.cpp"
        repo.mkdir()
        (repo / "ggml" / "src").mkdir(parents=True)
        (repo / "ggml" / "src" / "evil.c").symlink_to(outside)
        fake_checkout(repo)
        tree = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD^{tree}"], capture_output=True,
                              text=True).stdout.strip()
        kept, args = [f"rev-{tree[:16]}"], [str(clean), "HEAD", "--repo", str(repo)]
    else:
        linked = fake_checkout(tmp_path / "linked")
        (linked / "ggml" / "src").mkdir()
        (linked / "ggml" / "src" / "evil.c").symlink_to(outside)
        args = [str(clean), str(linked)]
    if kind == "llamacpp.source":
        status = cli.main(["run", "llamacpp", f"llamacpp.source={linked}"])
        out, err = capsys.readouterr()
    else:
        status, out, err = ab_command(capsys, *args, "backend=llamacpp", "device=qemu-aarch64")
    assert status == 2 and out == ""
    (line,) = said(err)
    assert "ggml/src/evil.c is a symbolic link; accepted: a llama.cpp tree of plain files and folders" in line, line
    assert not results_dir.exists()
    made = [p.name for p in trees.AB_CACHE.glob("*")] if trees.AB_CACHE.is_dir() else []
    assert not [name for name in made if any(name.startswith(k) for k in kept)], made


def test_a_revision_is_its_commits_files_whatever_the_checkout_holds(tmp_path):
    repo = fake_checkout(tmp_path / "llama.cpp")
    (repo / "ggml" / "include" / "ggml.h").write_text("// changed, not committed\n")
    tree = trees.resolve("HEAD", str(repo))
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert tree.revision == f"git:{sha}" and tree.source.parent == trees.AB_CACHE
    assert (tree.source / "ggml" / "include" / "ggml.h").read_text() == "// ggml/include/ggml.h\n"


def test_ab_offers_only_the_backends_it_builds(results_dir, capsys):
    status, _, err = ab_command(capsys, "sdist", "sdist", "backend=iree", "device=qemu-aarch64")
    assert status == 2 and "backend=iree is not accepted (accepted: backend=native or backend=llamacpp" in said(err)[0]
    assert not results_dir.exists()


# --- on qemu-aarch64: the default run's replay of P1.1 -------------------------------------------


def _instructions(out: str, call: str) -> tuple[int, int]:
    """Both counts of `call` from ab's table (its columns instructions A and instructions B)."""
    lines = out.splitlines()
    header = [c.strip() for c in next(line for line in lines if line.startswith("| call ")).strip("|").split("|")]
    row = next(line for line in lines if line.startswith(f"| {call}"))
    cells = dict(zip(header, (c.strip() for c in row.strip("|").split("|"))))
    return int(cells["instructions A"].replace(",", "")), int(cells["instructions B"].replace(",", ""))


def replay(capsys, device: str, patch: str, *extra: str) -> tuple[int, str, str]:
    return ab_command(capsys, "sdist", patch, "backend=llamacpp", f"device={device}", "experiment=gdn", *extra)


@BUILDS
@AARCH64
def test_p11_on_qemu_aarch64_the_chunk_loop_is_neutral_and_dropping_beta_is_caught(results_dir, capsys):
    """Seed 002's P1.1 on an emulated aarch64 device, ggml's op judged over the awkward lengths (1 to 300
    tokens, both gates): the chunk loop passes on both trees with the same outputs and instructions
    within 1%; the planted bug fails on B only, naming a case that reaches the second chunk."""
    call = "H=4,hs=64,T=128,kda=0/ggml"
    status, out, err = replay(capsys, "qemu-aarch64", CHUNK64, "matrix=awkward")
    assert status == 0, err
    assert "oracles on A (sdist): 12 pass" in out and f"oracles on B (sdist+{CHUNK64}): 12 pass" in out
    a, b = _instructions(out, call)
    assert a > 1_000_000 and abs(b / a - 1) < 0.01, (a, b)
    assert "(outputs differ)" not in out  # the same per-token code: the same bits
    records = ResultsStore(results_dir).records("gdn")
    (measured,) = [r for r in records if r["kind"] == "measure"]
    artifacts = measured["artifacts"]
    assert artifacts["a_source_sha256"] == build.source_hash(trees.resolve("sdist").source)
    assert artifacts["b_source_sha256"] == build.source_hash(trees.resolve(CHUNK64).source)
    assert artifacts["a_program_sha256"] != artifacts["b_program_sha256"]
    assert artifacts["a_elf_machine"] == artifacts["b_elf_machine"] == "183"  # EM_AARCH64
    for ran in measured["evidence"]:
        assert ran["detail"]["elf_machine"] == 183 and ran["sha256"] in (artifacts["a_program_sha256"],
                                                                       artifacts["b_program_sha256"])
    assert {r["params"]["ab_side"] for r in records if r["kind"] == "oracle"} == {"A", "B"}

    status, out, err = replay(capsys, "qemu-aarch64", DROP_BETA, "matrix=awkward")
    assert status == 1, err
    assert "oracles on A (sdist): 12 pass" in out
    failed = re.findall(rf"^FAILED B \(sdist\+{re.escape(DROP_BETA)}\) (\S+): fail: .*NMSE", out, re.M)
    # the lengths that reach a second chunk of 64 (65, 127, 300 tokens, each gate), and only those
    assert failed and all(int(re.search(r"T=(\d+)", case).group(1)) > 64 for case in failed), out
    assert len(failed) == 6 and "(outputs differ)" in out
    assert f"FAILED: 6 oracle record(s) failed on B (sdist+{DROP_BETA}): results changed" in out
    assert "B is not worse than A" not in out


@BUILDS
@AARCH64
def test_a_tree_that_does_not_build_is_exit_4_with_the_compilers_first_error(results_dir, capsys):
    status, out, err = ab_command(capsys, "sdist", DOES_NOT_COMPILE, "backend=llamacpp", "device=qemu-aarch64")
    assert status == 4 and out == ""
    line = err.strip().splitlines()[-1]  # after the build's progress lines, one line says why
    assert f"B (sdist+{DOES_NOT_COMPILE}): building tb_ggml_gdn for aarch64 failed" in line
    assert re.search(r"ggml-alloc\.c:\d+:\d+: error: .testbed_undeclared_name. undeclared", line), line
    assert not [r for r in ResultsStore(results_dir).records() if r.get("verdict") == "pass"]


# --- on qemu-hexagon: the three verdicts (opt-in) --------------------------------------------------


def _hexagon_missing() -> str | None:
    if shutil.which("qemu-hexagon") is None:
        return "qemu-hexagon is not installed (Debian: qemu-user)"
    try:
        kernel_build.zig_binary()
    except kernel_build.BuildError as e:
        return str(e)
    return None


HEXAGON_CALL = "H=4,hs=64,T=128,kda=0/ggml"  # the qemu-hexagon profile's bench shape: two chunks of 64


@pytest.mark.parametrize("patch", [CHUNK64, DROP_BETA, EXTRA_WORK], ids=["chunk64", "drop-beta", "extra-work"])
@pytest.mark.slow_build
@BUILDS
@pytest.mark.skipif(_hexagon_missing() is not None, reason=str(_hexagon_missing()))
def test_p11_replayed_on_qemu_hexagon(patch, results_dir, capsys):
    """`testbed ab sdist PATCH backend=llamacpp device=qemu-hexagon experiment=gdn`, as the issue writes it:
    the profile's oracle cases (the awkward lengths up to 65 tokens, both gates) on both trees, ggml's
    op counted under qemu-hexagon's plugin at the profile's bench shape."""
    status, out, err = replay(capsys, "qemu-hexagon", patch)
    a, b = _instructions(out, HEXAGON_CALL)
    assert "oracles on A (sdist): 8 pass" in out
    if patch == CHUNK64:
        assert status == 0 and f"oracles on B (sdist+{patch}): 8 pass" in out, err
        assert abs(b / a - 1) < 0.01 and "(outputs differ)" not in out
    elif patch == DROP_BETA:
        assert status == 1
        failed = re.findall(rf"^FAILED B \(sdist\+{re.escape(patch)}\) (\S+): fail: .*NMSE", out, re.M)
        assert sorted(failed) == sorted(f"H=4,hs=32,T=65,seqs=2,vr=2,perm=0,kda={k},K=1,gate=mild/ggml-CPU"
                                        for k in (0, 1)), out
        assert "FAILED: 2 oracle record(s) failed on B (" in out and "B is not worse than A" not in out
    else:
        assert status == 1 and f"oracles on B (sdist+{patch}): 8 pass" in out
        assert b / a - 1 > 0.03
        (slower,) = [line for line in out.splitlines() if line.startswith("SLOWER ")]
        assert f"{HEXAGON_CALL}: instructions {a} -> {b} (+" in slower
    for r in ResultsStore(results_dir).records("gdn"):
        assert r["device"] == "qemu-hexagon"
        for ran in r["evidence"]:
            assert ran["detail"]["elf_machine"] == 164


# --- on the host: CPU time paired, instructions under valgrind (opt-in) ------------------------------


@pytest.mark.slow_build
@BUILDS
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind counts the host's instructions (Debian: valgrind)")
def test_extra_work_on_the_host_is_counted_under_valgrind_beside_paired_cpu_time(results_dir, capsys):
    """The host pairs CPU time (the adaptive design, its verdict whatever the load makes of a few
    milliseconds) and counts instructions under valgrind with the build without GGML_NATIVE (this CPU's
    AVX-512 is beyond valgrind): the planted 5% is slower by instructions, both counts shown. Four
    builds: A and B, each native and generic (ccache shares all but ops.cpp between A and B)."""
    call = "H=8,hs=64,T=256,kda=0/ggml"
    status, out, err = replay(capsys, "host", EXTRA_WORK, "matrix=awkward", "bench.tokens=[256]", "bench.heads=8",
                              "bench.head_size=64", "--budget", "60")
    assert status == 1, err
    a, b = _instructions(out, call)
    assert b / a - 1 > 0.03
    assert f"SLOWER ggml_gated_delta_net (ggml CPU backend) {call}: instructions {a} -> {b} (+" in out
    (measured,) = [r for r in ResultsStore(results_dir).records("gdn") if r["kind"] == "measure"]
    assert measured["figures"]["ab_ratio_cpu"]["reps"] >= 6 and measured["device"] == "host"
    assert measured["artifacts"]["a_build_target"] == "host"  # timed: the native build; counted: the generic one
    assert {ran["detail"]["instructions"]["counter"] for ran in measured["evidence"]
            if "instructions" in ran["detail"]} == {"valgrind-callgrind"}
