"""`testbed ab A B [key=value ...]`: two source trees' native programs measured against each other in one
job on one device, and judged on the pairs.

A timing compared across nights compares machines as much as code: on a shared host per-run medians
move +-20% while a kernel stands still. Measured in one job, interleaved, the two builds see the same
machine, and their ratio cancels what the machine did. So:

  trees     A and B are git revisions of this checkout (their kernels/ taken with `git archive` into
            .cache/ab/, by tree hash) or folders holding a kernels/ (`.` is the working tree: copied
            into .cache/ab/ by the hash of every byte a build reads, tree_hash). A symbolic link in a
            tree is refused: its bytes would come from outside it. Each tree's programs are built for
            the device (testbed.backends.native.build, cached by the same hash).
  calls     the experiment's measured calls (its `ab_calls(cfg)`: program, inputs, arguments), e.g.
            gdn's serial and chunkwise at each bench length. Inputs are staged on the device once.
  order     per repetition every call runs once for A and once for B; the calls are shuffled and each
            pair runs AB or BA, alternating per repetition from a random start (ABBA), all from a
            recorded seed, so a drift during the job falls on both sides alike.
  pairs     each pair gives B/A by the program's own clocks, wall and CPU time of the timed call.
  counts    on a device that counts instructions (capability `counts`), every run's; on the host with
            the experiment's counts=true, one run per tree and call under valgrind. A count that is due
            and missing (a program that stopped marking its timed call) is an error naming the side
            and the call, never a call judged without it.

Judging, per call:
  instructions  exact: any difference is reported with both counts; B is worse when it executes more
                than `--threshold` (default 1%) more instructions per call.
  time          (not on emulated devices: their times say nothing of speed) a Wilcoxon signed-rank
                test on the log ratios of the pairs, two-sided, Holm-corrected over the calls; B is
                slower on a clock when the corrected p < 0.05 and the median ratio exceeds 1 +
                `--min-change` (default 2%). CPU time decides (what the work cost, whatever else ran);
                wall time is shown beside it. Fewer than 6 pairs cannot reach p < 0.05: "too few pairs".
Exit status 1 when B is worse on any call by instructions or CPU time; "no change" for the same tree
twice. The records (experiment's name, case `ab/CALL`) carry the pairs' ratios as figures
`ab_ratio_cpu` (with the A/B block testbed.measure.history judges: a_commit, b_commit, p uncorrected, pairs,
test, verdict) and `ab_ratio_wall` (shown, not judged), B's instructions as `instructions`, and the
whole judgement (both counts, both sides' median times, every verdict) under metrics `ab`: the
nightly's history keeps per-night A/B ratios, never raw times from different nights.
"""

from __future__ import annotations

import io
import math
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from testbed import PROJECT_ROOT, config, experiments, runner
from testbed.backends import EvidenceLog
from testbed.backends.native.build import BuildError, build_programs, target_for_abi, tree_files, tree_hash
from testbed.backends.native.device import Call, NativeJob, run_native
from testbed.errors import DeviceError, UsageError
from testbed.measure.counts import CountError
from testbed.measure.history import holm
from testbed.report import tables
from testbed.results import Figure, Record

MIN_PAIRS = 6          # the fewest pairs whose signed-rank test can reach p < 0.05 (two-sided)
ALPHA = 0.05
MAX_REPS = 1000        # pairs per call: at 1000 a small call's job already takes hours on an emulator


# --- the two trees ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tree:
    """One side: what the user named, the commit (or folder) it stands for, and its kernels/."""

    spec: str
    revision: str
    kernels_dir: Path


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(PROJECT_ROOT), *args], capture_output=True, text=True)


def resolve_tree(spec: str) -> Tree:
    """A folder (with kernels/ inside, or itself a kernels folder) or a git revision of this checkout."""
    folder = Path(spec)
    if folder.is_dir():
        kernels = folder / "kernels" if (folder / "kernels").is_dir() else folder
        if not (kernels / "Makefile").is_file() or not (kernels / "tb_kernels.h").is_file():
            raise UsageError(f"{spec!r} is a folder without testbed's kernels/ (Makefile, tb_kernels.h); accepted: "
                             "a git revision of this checkout or a folder holding kernels/")
        return snapshot(Tree(spec, f"folder:{folder.resolve()}", kernels))
    commit = _git("rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}")
    if commit.returncode != 0:
        raise UsageError(f"{spec!r} is neither a folder nor a git revision of {PROJECT_ROOT}; accepted: a revision "
                         "(HEAD, HEAD~3, a branch, a commit) or a folder holding kernels/")
    sha = commit.stdout.strip()
    tree = _git("rev-parse", "--verify", "--quiet", f"{sha}:kernels")
    if tree.returncode != 0:
        raise UsageError(f"revision {spec!r} ({sha[:12]}) has no kernels/ folder")
    links = [line.split("\t", 1)[1] for line in _git("ls-tree", "-r", "-z", sha, "kernels").stdout.split("\0")
             if line.startswith("120000 ")]  # git's mode of a symbolic link
    if links:
        raise UsageError(f"revision {spec!r} ({sha[:12]}): {links[0]} is a symbolic link; accepted: a kernels/ tree of "
                         "plain files and folders (a link's bytes would come from outside the tree)")
    out = PROJECT_ROOT / ".cache" / "ab" / f"kernels-{tree.stdout.strip()[:16]}"
    if not (out / "kernels" / "Makefile").is_file():
        _extract(sha, out)
    return Tree(spec, sha, out / "kernels")


def _extract(sha: str, out: Path) -> None:
    """kernels/ of commit `sha` into `out`, whole or not at all."""
    def fill(tmp: Path) -> None:
        archive = subprocess.run(["git", "-C", str(PROJECT_ROOT), "archive", "--format=tar", sha, "kernels"],
                                 capture_output=True)
        if archive.returncode != 0:
            raise UsageError(f"git archive of {sha[:12]} failed: {archive.stderr.decode(errors='replace').strip()}")
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(tmp, filter="data")  # no links or paths out of tmp

    _whole(out, fill)


def _whole(out: Path, fill) -> None:
    """`fill(tmp)` a fresh folder beside `out`, then rename it to `out`: a concurrent or interrupted
    filling never leaves half a folder under the final name."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        fill(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process filled the same folder first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def snapshot(tree: Tree) -> Tree:
    """A copy of `tree`'s kernels/ under .cache/ab/, named by the hash of every byte a build of the
    programs reads (tree_hash: the library, kernels/bench/, the Makefile): what `ab` builds for a
    folder, and what a later night measures as its A/B baseline, whatever the checkout holds by then (a
    dirty tree included). A tree holding a symbolic link is refused, and nothing is copied."""
    try:
        files = tree_files(tree.kernels_dir)
        digest = tree_hash(tree.kernels_dir)[:16]
    except BuildError as e:
        raise UsageError(f"tree {tree.spec!r}: {e}") from None
    out = _snapshot_folder(digest)
    if tree.kernels_dir.resolve() == (out / "kernels").resolve():
        return tree  # already this snapshot (the nightly snapshots the folder `ab` resolved)
    if not (out / "kernels" / "Makefile").is_file():
        def fill(tmp: Path) -> None:
            for source in files:
                copy = tmp / "kernels" / source.relative_to(tree.kernels_dir)
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, copy, follow_symlinks=False)
            if tree_hash(tmp / "kernels")[:16] != digest:
                raise UsageError(f"tree {tree.spec!r} changed while it was being copied; run again")

        _whole(out, fill)
    return Tree(tree.spec, f"kernels:{digest} ({tree.revision})", out / "kernels")


def _snapshot_folder(digest: str) -> Path:
    return PROJECT_ROOT / ".cache" / "ab" / f"kernels-tree-{digest}"


def snapshotted(digest: str) -> Tree | None:
    """The copy snapshot() made of the kernels with this content hash, if it is still there."""
    path = _snapshot_folder(digest) / "kernels"
    return Tree(f"kernels:{digest}", f"kernels:{digest}", path) if (path / "Makefile").is_file() else None


# --- the measured calls -----------------------------------------------------------------------------


@dataclass
class Side:
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    instructions: list[int] = field(default_factory=list)
    kernel: str = ""
    outputs: dict[str, np.ndarray] | None = None


def signed_rank_p(ratios: list[float]) -> float | None:
    """Two-sided Wilcoxon signed-rank p of log(B/A) around 0; None below MIN_PAIRS pairs."""
    from scipy.stats import wilcoxon

    logs = np.log(np.asarray(ratios, float))
    if len(logs) < MIN_PAIRS:
        return None
    if not np.any(logs):
        return 1.0
    return float(wilcoxon(logs, zero_method="zsplit", alternative="two-sided").pvalue)


def time_verdict(ratios: list[float], p_adjusted: float | None, min_change: float) -> str:
    if p_adjusted is None:
        return "too few pairs"
    median = float(np.median(ratios))
    if p_adjusted < ALPHA and median > 1 + min_change:
        return "slower"
    if p_adjusted < ALPHA and median < 1 / (1 + min_change):
        return "faster"
    return "no change"


def count_verdict(a: int | None, b: int | None, threshold: float) -> str:
    if a is None or b is None:
        return "not counted"
    if b == a:
        return "no change"
    if b > a * (1 + threshold):
        return "slower"
    return "changed" if b > a else "fewer"


@dataclass
class Options:
    reps: int = 10
    seed: int = 0
    threshold: float = 0.01   # instructions: a rise above this fraction is a regression
    min_change: float = 0.02  # time: a median ratio beyond this (and p < 0.05 after Holm) is a change


def measure(cfg, ctx, module, experiment: str, trees: tuple[Tree, Tree], opts: Options):
    """Yields one Record per call: the pairs' ratios, both sides' counts, the verdicts."""
    device = ctx.device
    target = target_for_abi(device.profile.abi)
    emulated = device.profile.has("emulated")
    count_here = bool(cfg.get("counts")) and not device.profile.has("counts")
    builds = {}
    for side, tree in zip("AB", trees):
        ctx.progress(f"building {side} ({tree.spec}) for {target}")
        builds[side] = _build(side, tree, target)
    calls: list[Call] = module.ab_calls(cfg)
    sides = {(c.label, s): Side() for c in calls for s in "AB"}
    evidence = {c.label: EvidenceLog() for c in calls}
    rng = np.random.default_rng(opts.seed)
    first = {c.label: int(rng.integers(2)) for c in calls}  # each call's pair order in repetition 0

    def run(call: Call, side: str, program: Path, count: bool = False):
        result = run_native(device, NativeJob(program / call.program, call.inputs, call.outputs, call.args,
                                              measured=not count, count=count))
        evidence[call.label].add(result.evidence)
        if (count or device.profile.has("counts")) and result.counts is None:
            tree = trees["AB".index(side)]
            raise MissingCount(f"{side} ({tree.spec}) {call.label}: {call.program} was due a count on "
                               f"{device.name} and marked no timed region (its timings.json names no marks); "
                               "a call one side did not count is not judged")
        return result

    total = len(calls) * opts.reps
    for rep in range(opts.reps):
        for n, i in enumerate(rng.permutation(len(calls))):
            call = calls[i]
            ctx.progress(f"A/B {rep * len(calls) + n + 1}/{total}: {call.label}")
            order = "AB" if (first[call.label] + rep) % 2 == 0 else "BA"
            for side in order:
                result = run(call, side, builds[side])
                s = sides[(call.label, side)]
                s.wall += result.timings["seconds"]
                s.cpu += result.timings.get("cpu_seconds") or []
                s.kernel = result.timings.get("kernel", call.program)
                if result.counts:
                    s.instructions.append(result.counts.per_call)
                if s.outputs is None:
                    s.outputs = result.outputs
            runner.raise_if_stopped()
    if count_here:  # one run per tree and call under valgrind, with its build that valgrind can run
        for side, tree in zip("AB", trees):
            ctx.progress(f"counting {side}'s instructions under valgrind")
            counted = _build(side, tree, target, avx512=False)
            for call in calls:
                sides[(call.label, side)].instructions.append(run(call, side, counted, count=True).counts.per_call)

    ratios = {c.label: {clock: [b / a for a, b in zip(getattr(sides[(c.label, "A")], clock),
                                                       getattr(sides[(c.label, "B")], clock)) if a > 0]
                        for clock in ("wall", "cpu")} for c in calls}
    p_raw = {clock: [signed_rank_p(ratios[c.label][clock]) for c in calls] for clock in ("wall", "cpu")}
    p_adj = {}
    for clock, ps in p_raw.items():
        known = [p for p in ps if p is not None]
        adjusted = iter(holm(known))  # the chance of any false call over the calls
        p_adj[clock] = [None if p is None else next(adjusted) for p in ps]

    for i, call in enumerate(calls):
        a, b = sides[(call.label, "A")], sides[(call.label, "B")]
        a_count = a.instructions[0] if a.instructions else None
        b_count = b.instructions[0] if b.instructions else None
        verdicts = {"instructions": count_verdict(a_count, b_count, opts.threshold)}
        # Figures the nightly's history judges: B's instructions (an exact count) and the CPU ratio (with
        # its A/B block: testbed.measure.history's contract). The wall ratio is shown, not judged; the two sides'
        # times ride in the metrics only, so no raw time is ever compared across nights.
        figures: dict[str, Figure] = {}
        if b.instructions:
            figures["instructions"] = Figure.of(b.instructions, "instructions")
        if not emulated:
            for clock in ("cpu", "wall"):
                verdicts[clock] = time_verdict(ratios[call.label][clock], p_adj[clock][i], opts.min_change)
            if ratios[call.label]["cpu"]:
                figures["ab_ratio_cpu"] = Figure.of(ratios[call.label]["cpu"], "ratio")
                figures["ab_ratio_cpu"].ab = {
                    "a_commit": trees[0].revision, "b_commit": trees[1].revision, "p": p_raw["cpu"][i],
                    "pairs": len(ratios[call.label]["cpu"]), "test": "wilcoxon", "verdict": verdicts["cpu"]}
            if ratios[call.label]["wall"]:
                figures["ab_ratio_wall"] = Figure.of(ratios[call.label]["wall"], "ratio")
        worse = verdicts["instructions"] == "slower" or verdicts.get("cpu") == "slower"
        same_output = (a.outputs is not None and b.outputs is not None and a.outputs.keys() == b.outputs.keys()
                       and all(np.array_equal(a.outputs[k], b.outputs[k]) for k in a.outputs))
        ab = {"a": trees[0].spec, "b": trees[1].spec, "a_commit": trees[0].revision, "b_commit": trees[1].revision,
              "test": "wilcoxon signed-rank on log(B/A), Holm over calls", "pairs": len(ratios[call.label]["cpu"]),
              "p": p_adj["cpu"][i], "p_raw": p_raw["cpu"][i], "p_wall": p_adj["wall"][i],
              "verdicts": verdicts, "verdict": "slower" if worse else _overall(verdicts),
              "instructions_a": a_count, "instructions_b": b_count,
              "instructions_change": (b_count / a_count - 1) if a_count and b_count is not None else None,
              "threshold": opts.threshold, "min_change": opts.min_change, "seed": opts.seed,
              "order": "ABBA: calls shuffled per repetition, each pair's order alternating from a random start",
              "same_output": bool(same_output), "kernel": b.kernel, "timed_on_emulator": emulated,
              "a_ms": float(np.median(a.wall)) * 1e3 if a.wall else None,
              "b_ms": float(np.median(b.wall)) * 1e3 if b.wall else None}
        yield Record(experiment, f"ab/{call.label}", "measure", figures=figures, metrics={"ab": ab},
                     work={**call.work, "ab": "B over A, per pair of runs measured back to back in one job"},
                     params={"reps": opts.reps},
                     artifacts={"a_programs": str(builds["A"].name), "b_programs": str(builds["B"].name)},
                     evidence=evidence[call.label].take())


class MissingCount(CountError):
    """A count was due (a counting device, or counts=true on the host) and one side's run has none."""


class BuildFailed(DeviceError):
    """A tree's programs do not build for the device: exit status 4, with the compiler's first error."""


def _build(side: str, tree: Tree, target: str, avx512: bool = True) -> Path:
    try:
        return build_programs(target, kernels_dir=tree.kernels_dir, avx512=avx512)
    except BuildError as e:
        raise BuildFailed(f"{side} ({tree.spec}): {e}") from None


UNJUDGED = ("not measured", "too few pairs")  # a call's overall verdict when nothing could judge it


def _overall(verdicts: dict) -> str:
    """One word for a call: "no change" only when something was judged and all of it held still."""
    judged = set(verdicts.values()) - {"not counted", "too few pairs"}
    if not judged:
        return "too few pairs" if "too few pairs" in verdicts.values() else "not measured"
    if judged == {"no change"}:
        return "no change"
    if "faster" in judged or "fewer" in judged:
        return "faster"
    return "changed"


# --- the command ------------------------------------------------------------------------------------


def table(rows: list[dict]) -> pd.DataFrame:
    out = []
    for r in rows:
        ab, fig = r["metrics"]["ab"], r["figures"]
        change = ab["instructions_change"]
        out.append({
            "call": r["case"].removeprefix("ab/"), "kernel": ab["kernel"],
            "instructions A": ab["instructions_a"], "instructions B": ab["instructions_b"],
            "instr. change": None if change is None else f"{change:+.3%}",
            "cpu B/A": fig["ab_ratio_cpu"]["median"] if "ab_ratio_cpu" in fig else None,
            "wall B/A": fig["ab_ratio_wall"]["median"] if "ab_ratio_wall" in fig else None,
            "pairs": ab["pairs"], "p (cpu, Holm)": ab["p"],
            "verdict": ab["verdict"] + ("" if ab["same_output"] else " (outputs differ)"),
        })
    return pd.DataFrame(out)


def options(args) -> Options:
    """The command's options, checked: a bad value is refused in one line before anything is built."""
    try:
        reps = int(args.reps)
    except ValueError:
        reps = 0
    if not 1 <= reps <= MAX_REPS:
        raise UsageError(f"--reps {args.reps} is not accepted; accepted: an integer from 1 to {MAX_REPS} "
                         f"(>= {MIN_PAIRS} to judge time)")
    return Options(reps, args.seed, _fraction("--threshold", args.threshold), _fraction("--min-change", args.min_change))


def _fraction(option: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value <= 1):
        raise UsageError(f"{option} {text} is not accepted; accepted: a finite fraction from 0 to 1 (0.01 is 1%)")
    return value


def command(args) -> int:
    opts = options(args)
    rc = config.load(args.overrides, experiment="gdn")  # experiment= among the overrides, else gdn
    module = experiments.load(rc.experiment)
    if not hasattr(module, "ab_calls"):
        offered = [n for n in config.choices("experiment") if hasattr(experiments.load(n), "ab_calls")]
        raise UsageError(f"experiment {rc.experiment!r} has no A/B calls; accepted: {', '.join(offered)}")
    if rc.cfg.get("backend") != "native":  # ab measures native programs: its backend, unless one was named
        if any(o.lstrip("+").startswith("backend=") for o in args.overrides):
            raise UsageError(f"testbed ab measures native programs; backend={rc.cfg.get('backend')} is not accepted "
                             "(accepted: backend=native, the one ab chooses when none is named)")
        rc = config.load([*args.overrides, "backend=native"], experiment="gdn")
    trees = (resolve_tree(args.a), resolve_tree(args.b))
    progress = (lambda msg: print(msg, file=sys.stderr, flush=True)) if not sys.stderr.isatty() else \
        (lambda msg: (sys.stderr.write("\r\033[K" + msg[:120]), sys.stderr.flush()))
    outcome = runner.execute(rc, progress=progress,
                             produce=lambda cfg, ctx: measure(cfg, ctx, module, rc.experiment, trees, opts))
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K")
    rows = outcome.rows
    df = table([r for r in rows if r["kind"] == "measure"])
    print(tables.render(df, args.format))
    worse = [r for r in rows if r["kind"] == "measure" and r["metrics"]["ab"]["verdict"] == "slower"]
    if args.format == "md":
        where = f"{rc.device}" + (" (emulated: instructions only, times not judged)" if outcome.info.emulated else "")
        print(f"\nA = {trees[0].spec} ({trees[0].revision[:20]}), B = {trees[1].spec} ({trees[1].revision[:20]}) "
              f"on {where}, {opts.reps} pairs per call, seed {opts.seed}; run {outcome.info.run_id} stored")
        for r in worse:
            ab = r["metrics"]["ab"]
            what = []
            if ab["verdicts"]["instructions"] == "slower":
                what.append(f"instructions {ab['instructions_a']} -> {ab['instructions_b']} "
                            f"({ab['instructions_change']:+.2%})")
            if ab["verdicts"].get("cpu") == "slower":
                what.append(f"CPU time x{r['figures']['ab_ratio_cpu']['median']:.3f} (p={ab['p']:.2g})")
            print(f"SLOWER {ab['kernel']} {r['case'].removeprefix('ab/')}: {'; '.join(what)}")
        unjudged = [r["case"].removeprefix("ab/") + f" ({r['metrics']['ab']['verdict']})" for r in rows
                    if r["kind"] == "measure" and r["metrics"]["ab"]["verdict"] in UNJUDGED]
        if not worse:
            print("B is not worse than A on any call" + (f" judged; not judged: {', '.join(unjudged)}" if unjudged else ""))
    return 1 if worse else 0


def register(commands) -> None:
    c = commands.add_parser("ab", help="two source trees' native programs measured interleaved in one job; "
                                       "exit 1 when B is worse")
    c.add_argument("a", help="a git revision of this checkout (HEAD, HEAD~1, a branch) or a folder holding kernels/ "
                             "('.' is the working tree)")
    c.add_argument("b", help="the same kinds as A; B is judged against A")
    c.add_argument("overrides", nargs="*", help="the experiment's key=value, e.g. experiment=gdn device=qemu-aarch64 "
                                                "'bench.tokens=[512]'")
    # the numbers are checked by options(), which says in one line what is accepted
    c.add_argument("--reps", default="10", help=f"pairs per call, 1 to {MAX_REPS} (>= 6 to judge time; default 10)")
    c.add_argument("--seed", type=int, default=0, help="the order's seed (recorded)")
    c.add_argument("--threshold", default="0.01", help="instructions: the rise that is a regression, a fraction "
                                                       "from 0 to 1 (default 0.01 = 1%%)")
    c.add_argument("--min-change", default="0.02", help="time: the least median change judged, a fraction from 0 "
                                                        "to 1 (default 0.02)")
    c.add_argument("--format", choices=tables.FORMATS, default="md")
    c.set_defaults(fn=command)
