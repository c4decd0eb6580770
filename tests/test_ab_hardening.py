"""`testbed ab` and the instruction counts it judges by: nothing passes that was not measured.

Each test here drives a path a planted bug once slipped through: bad option values, trees holding
symbolic links, a tree that does not build, a B whose programs stopped marking their timed calls, a
change confined to the Makefile (the A/B key must cover every byte a build reads), and the two
counters (QEMU's plugin, valgrind's callgrind) on one small program whose marks are right, doubled, or
around regions of different sizes. The verdicts' own paths (threshold, direction) are in test_ab.py."""

import shutil
import subprocess
from pathlib import Path

import pytest

from refimpl import gdn as ref
from testbed import PROJECT_ROOT, cli, runner
from testbed.backends.native import build as kernel_build
from testbed.backends.native.device import NativeJob, run_native
from testbed.devices import connect, load_profile
from testbed.lab import ab
from testbed.measure import counts
from testbed.results import Record
from tests.cli_support import said
from tests.native_support import mutant_kernels

# A small GDN bench (as in test_ab.py), without backend=: `ab` chooses native itself.
SMALL = ["bench.tokens=[48]", "bench.heads=2", "bench.head_size=32"]
CHUNKWISE, SERIAL = "H=2,hs=32,T=48,kda=0/chunkwise", "H=2,hs=32,T=48,kda=0/serial"


def ab_command(capsys, *args) -> tuple[int, str, str]:
    """`testbed ab ARGS` in this process: its exit status, stdout and stderr."""
    status = cli.main(["ab", *args])
    out = capsys.readouterr()
    return status, out.out, out.err


def kernels_copy(folder: Path) -> Path:
    """A plain copy of this checkout's kernels/ in `folder`/kernels (its files only, no build outputs)."""
    for source in kernel_build.tree_files():
        copy = folder / "kernels" / source.relative_to(kernel_build.KERNELS_DIR)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, copy)
    return folder


# --- options and trees: refused in one line, exit 2, nothing built or stored -------------------------


@pytest.mark.quick
@pytest.mark.parametrize("option, value", [("--threshold", "nan"), ("--threshold", "inf"), ("--threshold", "-5"),
                                           ("--min-change", "nan"), ("--min-change", "inf"),
                                           ("--min-change", "-0.02"), ("--reps", "1e12"), ("--reps", "0"),
                                           ("--budget", "nan"), ("--budget", "0"), ("--max-pairs", "5")])
def test_a_bad_option_value_is_refused_in_one_line(option, value, results_dir, capsys):
    status, _, err = ab_command(capsys, "HEAD", "HEAD", "device=qemu-aarch64", option, value)
    assert status == 2
    assert said(err) == [said(err)[0]] and f"{option} {value} is not accepted; accepted: " in err
    assert not results_dir.exists()


@pytest.mark.parametrize("link", ["outside", "loop"])
def test_a_folder_tree_holding_a_symbolic_link_is_refused_and_nothing_is_copied(link, tmp_path, results_dir, capsys,
                                                                                 monkeypatch):
    """A link out of the tree (its bytes would be copied into the A/B cache and built) and a link to the
    tree itself (`loop -> .`, copied without end) are both refused, for `ab DIR` as for the nightly's
    ab_tree=DIR (both resolve the folder by ab.resolve_tree)."""
    root = tmp_path / "project"
    monkeypatch.setattr(ab, "PROJECT_ROOT", root)  # where .cache/ab would receive the copy
    tree = kernels_copy(tmp_path / "tree")
    (tmp_path / "secret.h").write_text("#define SECRET 1\n")
    (tree / "kernels" / "bench" / "secret.h").symlink_to(tmp_path / "secret.h") if link == "outside" else \
        (tree / "kernels" / "loop").symlink_to(".")
    status, _, err = ab_command(capsys, str(tree), str(tree), "device=qemu-aarch64", *SMALL)
    assert status == 2, err
    assert said(err) == [said(err)[0]] and "is a symbolic link; accepted: a kernels/ tree of plain files" in err
    assert not (root / ".cache" / "ab").exists() or not any((root / ".cache" / "ab").iterdir())
    assert not results_dir.exists()


def test_a_revision_whose_kernels_hold_a_symbolic_link_is_refused(tmp_path, results_dir, capsys, monkeypatch):
    """A commit whose kernels/ holds a link leaving the tree (once a traceback and exit 1, which reads
    "B is worse"): one line naming the link, exit 2, nothing extracted."""
    repo = tmp_path / "repo"
    (repo / "kernels").mkdir(parents=True)
    for name in ("Makefile", "tb_kernels.h"):
        (repo / "kernels" / name).write_text("")
    (repo / "kernels" / "escape.h").symlink_to("/etc/hostname")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "kernels"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "a link"], check=True)
    monkeypatch.setattr(ab, "PROJECT_ROOT", repo)
    status, _, err = ab_command(capsys, "HEAD", "HEAD", "device=qemu-aarch64")
    assert status == 2, err
    assert said(err) == [said(err)[0]] and "kernels/escape.h is a symbolic link" in err
    assert not (repo / ".cache").exists() and not results_dir.exists()


def test_the_tree_hash_covers_every_byte_a_build_reads(tmp_path):
    """The key of the programs' cache and of the nightly's A/B snapshots: a change confined to
    kernels/bench/ or the Makefile is a different tree (the library's source_hash does not see it), and
    its snapshot is another folder; what a hand-run make leaves (build/, *.o) is not part of it."""
    tree = kernels_copy(tmp_path / "tree") / "kernels"
    base = kernel_build.tree_hash(tree)
    assert base == kernel_build.tree_hash()
    (tree / "build").mkdir()
    (tree / "build" / "x.o").write_bytes(b"\0")
    assert kernel_build.tree_hash(tree) == base
    library = kernel_build.source_hash(tree)
    for name, edit in [("Makefile", lambda t: t.replace("-O3", "-O0")),
                       ("bench/harness.c", lambda t: t + "\n"), ("bench/new.inc", lambda t: "/* new */")]:
        path = tree / name
        before = path.read_text() if path.exists() else ""
        path.write_text(edit(before))
        assert kernel_build.tree_hash(tree) != base and kernel_build.source_hash(tree) == library, name
        changed = ab.snapshot(ab.Tree("changed", "changed", tree))
        assert kernel_build.tree_hash(changed.kernels_dir) == kernel_build.tree_hash(tree)
        path.write_text(before) if before else path.unlink()
    assert kernel_build.tree_hash(tree) == base


# Headers a build reads, at the top of kernels/ (the library's) and in bench/ (the programs'): one edit of any
# is another tree. Planted (issue 44): the tree's files without their headers, or the hash skipping them.
HEADERS = ("tb_model.h", "tb_simd.h", "bench/harness.h", "bench/tb_engine.h")
HEADERLESS = {"tree_files": ("files += [here / n for n in names if not any(",
                             "files += [here / n for n in names if not n.endswith('.h') and not any("),
              "tree_hash": ("for path in tree_files(kernels_dir):",
                            "for path in [f for f in tree_files(kernels_dir) if f.suffix != '.h']:")}


def header_edits_unseen(tree: Path) -> list[str]:
    """The headers of `tree` whose one-line edit leaves kernel_build.tree_hash(tree) unchanged."""
    base, unseen = kernel_build.tree_hash(tree), []
    for name in HEADERS:
        header = tree / name
        before = header.read_text()
        header.write_text(before + "#define TB_PLANTED_EDIT 1\n")
        if kernel_build.tree_hash(tree) == base:
            unseen.append(name)
        header.write_text(before)
    return unseen


@pytest.mark.quick
def test_a_header_edit_is_another_tree(tmp_path):
    assert header_edits_unseen(kernels_copy(tmp_path / "tree") / "kernels") == []


@pytest.mark.quick
@pytest.mark.parametrize("planted", list(HEADERLESS))
def test_a_tree_hash_blind_to_headers_is_caught(planted, tmp_path, monkeypatch):
    from tests.mutants import mutant

    tree = kernels_copy(tmp_path / "tree") / "kernels"
    monkeypatch.setattr(kernel_build, planted, mutant(kernel_build, planted, *HEADERLESS[planted]))
    assert header_edits_unseen(tree) != []


# --- a change only the build sees, a tree that does not build, a count that is due and missing ---------


def test_a_change_confined_to_the_makefile_is_measured(tmp_path, results_dir, capsys):
    """A -O3 -> -O0 edit of the Makefile alone: same library sources, other programs. Both folders
    are snapshotted by the hash of every byte a build reads, so B runs the -O0 programs and is slower
    by its instructions (keyed by the library's sources, both sides ran one snapshot: "no change")."""
    plain = kernels_copy(tmp_path / "plain")
    unoptimized = mutant_kernels("Makefile", "-O3 ", "-O0 ").parent
    status, out, err = ab_command(capsys, str(plain), str(unoptimized), "device=qemu-aarch64", *SMALL, "--reps", "1")
    assert status == 1, err
    assert f"SLOWER tb_gdn_chunkwise {CHUNKWISE}: instructions" in out and f"{SERIAL}: instructions" in out


def test_a_tree_that_does_not_build_exits_4_quoting_the_compilers_error(tmp_path, results_dir, capsys):
    broken = kernels_copy(tmp_path / "broken")
    gdn = broken / "kernels" / "gdn.c"
    gdn.write_text(gdn.read_text() + "\nint planted_syntax_error(void) { return }\n")
    status, _, err = ab_command(capsys, "HEAD", str(broken), "device=qemu-aarch64", *SMALL, "--reps", "1")
    assert status == 4 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"testbed: device error: B ({broken}): building the aarch64 programs failed: ")
    assert "gdn.c" in last and "error:" in last
    assert '"verdict": "error"' in (results_dir / "records.jsonl").read_text()  # the run reads as broken


def test_a_b_that_stopped_marking_its_calls_is_an_error_not_no_change(results_dir, capsys):
    """B's harness no longer names its marks: on a counting device its counts would be None, and the
    call was judged "no change". A count that is due and missing is an error naming the side and call."""
    unmarked = mutant_kernels("bench/harness.c", '\\"marks\\": [\\"call\\"], ', "").parent
    status, out, err = ab_command(capsys, "HEAD", str(unmarked), "device=qemu-aarch64", *SMALL, "--reps", "1")
    assert status == 4, err
    last = err.strip().splitlines()[-1]
    assert f"B ({unmarked}) " in last and "marked no timed region" in last and "no change" not in out
    assert "/serial" in last or "/chunkwise" in last


def test_the_readmes_ab_line_runs_on_the_host(results_dir, capsys, monkeypatch):
    """`testbed ab HEAD~1 .` as the README writes it (gdn's default backend on the host is refimpl;
    ab measures native programs and chooses that backend itself). HEAD: HEAD~1 would build twice."""
    monkeypatch.chdir(PROJECT_ROOT)
    status, out, err = ab_command(capsys, "HEAD", ".", *SMALL, "--reps", "1")
    assert status == 0, err
    if shutil.which("valgrind"):  # the host counts by default: the instructions judge, one pair cannot time
        assert out.count("| no change") == 2 and "not judged: " not in out
    else:
        assert out.count("| too few pairs") == 2
        assert "not judged: " in out and "B is not worse than A on any call\n" not in out


# --- the counters, on one small program -----------------------------------------------------------


MARKS_PROGRAM = r"""
#include <stdio.h>
#include <string.h>
/* the harness's marks, as kernels/bench/harness.c defines them */
static volatile int count_mark;
static volatile unsigned sink;
__attribute__((noinline, used, aligned(64))) void tb_count_begin(void) { count_mark = 1; }
__attribute__((noinline, used, aligned(64))) void tb_count_end(void) { count_mark = 2; }

int main(int argc, char **argv) {
    const char *how = argc > 1 ? argv[1] : "";
    for (int r = 0; r < 2; r++) {
        tb_count_begin();
        if (!strcmp(how, "doubled-begin")) tb_count_begin();
        for (int i = 0; i < 1000 * (r + 1); i++) sink += (unsigned)i; /* region 2: 1000 turns more */
        tb_count_end();
        if (!strcmp(how, "doubled-end")) tb_count_end();
    }
    FILE *f = fopen("timings.json", "w");
    fprintf(f, "{\"reps\": 2, \"marks\": [\"call\"], \"seconds\": [0, 0]}\n");
    return fclose(f) != 0;
}
"""
COUNTERS = {"host": ("cc", []), "qemu-aarch64": ("aarch64-linux-gnu-gcc", ["-static"])}


@pytest.fixture(scope="module", params=list(COUNTERS))
def counted(request, tmp_path_factory):
    """(the device, the small program built for it): valgrind on the host, the plugin on qemu-aarch64."""
    cc, flags = COUNTERS[request.param]
    if shutil.which(cc) is None or (request.param == "host" and shutil.which("valgrind") is None):
        pytest.skip(f"{cc} or the counter is not installed")
    program = tmp_path_factory.mktemp("marks") / "tb_marks"
    source = program.with_suffix(".c")
    source.write_text(MARKS_PROGRAM)
    subprocess.run([cc, "-O1", *flags, "-o", str(program), str(source)], check=True)
    return connect(load_profile(request.param)), program


def count(device, program, how=""):
    return run_native(device, NativeJob(program, {}, [], [how], measured=False, count=True)).counts


def test_each_region_is_counted_on_its_own(counted):
    """Region 2 runs 1000 loop turns more than region 1: a counter (or its reader) that reports every
    region as the first one's is seen."""
    c = count(*counted)
    assert len(c.regions) == 2 and c.regions[1] - c.regions[0] >= 1000 * 2, c.regions
    assert c.of("call") == list(c.regions)


@pytest.mark.parametrize("how", ["doubled-end", "doubled-begin"])
def test_both_counters_refuse_a_doubled_mark_naming_the_program(counted, how):
    with pytest.raises(counts.CountError, match=r"tb_marks: .*unmatched marks"):
        count(*counted, how)


def test_a_cold_cache_call_counts_only_the_call():
    """cold_mb=1 evicts the caches before each timed call, outside the marks: the call's count is the
    same as without it (a begin mark moved above the eviction would count 1 MiB written and read)."""
    device = connect(load_profile("qemu-aarch64"))
    program = kernel_build.build_programs("aarch64") / "tb_gdn_bench"
    x = dict(zip(("q", "k", "v", "g", "beta", "state"), ref.draw_inputs(1, 32, 2, 32, kda=False, seed=1).arrays()))

    def call(cold_mb):
        args = ["{inputs}", ".", "form=serial", "warmup=0", "reps=1", f"cold_mb={cold_mb}"]
        return run_native(device, NativeJob(program, x, ["out"], args, measured=False)).counts.per_call

    assert call(1) == call(0)


# --- the record's own check ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["qemu-aarch64", "qemu-arm32", "qemu-hexagon"])
def test_the_record_check_alone_refuses_an_x86_64_program_on_an_arm_or_hexagon_device(device):
    """Evidence of an x86-64 ELF (machine 62) filed under an ARM or Hexagon device: refused by the
    record check by itself (check_machine, before the run, is another guard)."""
    record = Record("gdn", "case", "oracle", "nmse", "pass", 1.0, evidence=[
        {"device": device, "ran": "tb_gdn_bench", "sha256": "0" * 64, "command": "x", "detail": {"elf_machine": 62}}])
    with pytest.raises(runner.ComputedElsewhere, match=r"machine 62 \(Advanced Micro Devices X86-64\), not"):
        runner.check_evidence([record], load_profile(device))
