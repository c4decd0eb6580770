"""`testbed ab A B [key=value ...]`: two source trees' programs measured against each other in one job on
one device, and judged on the pairs: testbed's own kernels/ (backend=native, the default) or llama.cpp
(backend=llamacpp).

A timing compared across nights compares machines as much as code: on a shared host per-run medians
move +-20% while a kernel stands still. Measured in one job, interleaved, the two builds see the same
machine, and their ratio cancels what the machine did. So:

  trees     A and B are git revisions of this checkout (their kernels/ taken with `git archive` into
            .cache/ab/, by tree hash) or folders holding a kernels/ (`.` is the working tree: copied
            into .cache/ab/ by the hash of every byte a build reads, tree_hash). A symbolic link in a
            tree is refused: its bytes would come from outside it. Each tree's programs are built for
            the device (testbed.backends.native.build, cached by the same hash).
            backend=llamacpp: A and B are llama.cpp trees (testbed.backends.llamacpp.trees: sdist, a
            folder, a revision of the checkout --repo names, BASE+PATCH), each built for the device by
            testbed.backends.llamacpp.build (cached by content; ccache shares what did not change).
  oracles   backend=llamacpp: the experiment's llama.cpp oracles (`ab_oracles`) on both trees, before
            any pair; one that does not pass fails the comparison (exit 1, the side and case named),
            whatever the speed: a faster B that changes results is not an improvement.
  calls     the experiment's measured calls (its `ab_calls(cfg)`: program, inputs, arguments), e.g.
            gdn's serial and chunkwise at each bench length. Inputs are staged on the device once.
  order     per repetition every call runs once for A and once for B; the calls are shuffled and each
            pair runs AB or BA, alternating per repetition from a random start (ABBA), all from a
            recorded seed, so a drift during the job falls on both sides alike.
  pairs     each pair gives B/A by the program's own clocks, wall and CPU time of the timed call.
  counts    on a device that counts instructions (capability `counts`), every run's; on this machine
            (and elsewhere with the experiment's counts=true) one run per tree and call under valgrind
            when valgrind is installed, else "not counted: valgrind missing". A count that is due
            and missing (a program that stopped marking its timed call) is an error naming the side
            and the call, never a call judged without it.
  how many  adaptive by default (testbed.measure.sequential): looks at 6, 12, 24, ... pairs up to
            --max-pairs (384), the pairs of the still undecided calls only, until every call is
            decided or the next look would overrun --budget (CPU-seconds of this process and its
            children, default 300; the builds and the valgrind runs are outside it); the record says
            the design, the looks taken and why it stopped ("budget spent: undecided, need about N
            more pairs"). --reps N is a fixed design of N pairs (the nightly's ab_reps).

Judging, per call:
  instructions  exact: any difference is reported with both counts; B is worse when it executes more
                than `--threshold` (default 1%) more instructions per call.
  time          (not on emulated devices: their times say nothing of speed) a Wilcoxon signed-rank
                test on the log ratios of the pairs, two-sided, at each look, its p spent over the looks
                and Holm-corrected over the calls; B is slower on a clock when the corrected p < 0.05
                and the 95% interval of the median ratio lies above 1 + `--min-change` (default 5%);
                a call whose p >= 0.05 and interval lies within +-5% is decided "no change"; one whose
                p < 0.05 and whole interval lies within +-`--min-change` is "below floor" (a real change
                smaller than the job can call, said so, never "need N more pairs"); one the budget left
                open is "undecided", with why (testbed.measure.sequential). CPU time decides (what the
                work cost, whatever else ran); wall time is shown beside it; a CPU time left undecided is
                the call's verdict whatever its instructions did under their threshold. Fewer than 6
                pairs cannot reach p < 0.05: "too few pairs".
Exit status 1 when B is worse on any call by instructions or CPU time, or an oracle did not pass on
either tree; "no change" for the same tree twice. The records (experiment's name, case `ab/CALL`) carry the pairs' ratios as figures
`ab_ratio_cpu` (with the A/B block testbed.measure.history judges: a_commit, b_commit, p uncorrected, pairs,
test, verdict) and `ab_ratio_wall` (shown, not judged), B's instructions as `instructions`, and the
whole judgement (both counts, both sides' median times, every verdict) under metrics `ab`: the
nightly's history keeps per-night A/B ratios, never raw times from different nights.
"""

from __future__ import annotations

import io
import json
import math
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from testbed import PROJECT_ROOT, children, config, experiments, runner
from testbed.backends import EvidenceLog
from testbed.backends.llamacpp import build as llamacpp_build
from testbed.backends.llamacpp import trees as llamacpp_trees
from testbed.backends.native.build import (BuildError, build_programs, target_for_abi, tree_files, tree_hash,
                                          whole_folder)
from testbed.backends.native.device import Call, NativeJob, run_native
from testbed.devices.transport import elf_machine, sha256_file
from testbed.errors import DeviceError, UsageError
from testbed.heartbeat import ProgressLine, Tick
from testbed.measure import sequential
from testbed.measure.counts import CountError
from testbed.measure.timing import cpu_seconds
from testbed.report import tables
from testbed.results import Figure, Record
from testbed.verdicts import FAILING, LABEL, NOTHING_JUDGED, UNJUDGED, Tally

MAX_REPS = 1000        # pairs per call: at 1000 a small call's job already takes hours on an emulator


# --- the two trees ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tree:
    """One side: what the user named, the commit (or folder) it stands for, and its kernels/."""

    spec: str
    revision: str
    kernels_dir: Path


def _git(*args: str) -> subprocess.CompletedProcess:
    return children.run(["git", "-C", str(PROJECT_ROOT), *args], capture_output=True, text=True)


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
        archive = children.run(["git", "-C", str(PROJECT_ROOT), "archive", "--format=tar", sha, "kernels"],
                               capture_output=True)
        if archive.returncode != 0:
            raise UsageError(f"git archive of {sha[:12]} failed: {archive.stderr.decode(errors='replace').strip()}")
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(tmp, filter="data")  # no links or paths out of tmp

    whole_folder(out, fill)


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

        whole_folder(out, fill)
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


def count_verdict(a: int | None, b: int | None, threshold: float, uncounted: str = "not counted") -> str:
    if a is None or b is None:
        return uncounted
    if b == a:
        return "no change"
    if b > a * (1 + threshold):
        return "slower"
    return "changed" if b > a else "fewer"


@dataclass
class Options:
    reps: int | None = None   # a fixed design of this many pairs; None: the adaptive (group-sequential) design
    seed: int = 0
    threshold: float = 0.01   # instructions: a rise above this fraction is a regression
    min_change: float = sequential.MIN_CHANGE  # time: a median ratio beyond this (and p < 0.05 after Holm) is a change
    budget: float = 300.0     # adaptive: CPU-seconds the repetitions may spend (this process and its children)
    max_pairs: int = sequential.MAX_PAIRS  # adaptive: the last look's pairs per call

    def design(self, emulated: bool) -> sequential.Design:
        """--reps N: N pairs; on an emulated device (times not judged) the one pair its counts need."""
        if self.reps is not None:
            return sequential.fixed(self.reps)
        return sequential.fixed(1) if emulated else sequential.group_sequential(self.max_pairs)


def measure(cfg, ctx, module, experiment: str, trees: tuple, opts: Options, engine=None):
    """Yields the engine's oracle records for both trees, then one Record per call: the pairs' ratios,
    both sides' counts, the verdicts. `engine` builds the sides, runs the calls and holds the oracles:
    NativeEngine (the default), LlamacppEngine, or ContractEngines (`engine:A engine:B`: two engines
    under test, or two builds of one, serving the calls through engine contract v1)."""
    engine = engine or NativeEngine(bool(cfg.get("fused", False)))  # the build the experiment's fused asks for
    device = ctx.device
    emulated = device.profile.has("emulated")
    # On a device that does not count by itself, valgrind counts: asked for (counts=true: it must be
    # there), or by default on this machine (the local transport) when valgrind is installed.
    valgrind = not device.profile.has("counts") and (bool(cfg.get("counts")) or device.profile.transport == "local")
    count_here = valgrind and (bool(cfg.get("counts")) or shutil.which("valgrind") is not None)
    uncounted = "not counted: valgrind missing" if valgrind and not count_here else "not counted"
    if not engine.valgrind_counts:
        count_here, uncounted = False, engine.uncounted
    # a side whose engine declares it does not serve this (its technique, the device's ABI, the weights dtype)
    # is recorded "not supported" in its yaml's words, and nothing is measured
    refused = list(engine.refusals(cfg, device, experiment, trees)) if hasattr(engine, "refusals") else []
    if refused:
        yield from refused
        return
    builds = {}
    for side, tree in zip("AB", trees):
        ctx.progress(f"building {side} ({tree.spec}) for {engine.target(device)}")
        builds[side] = engine.build(side, tree, device, ctx.progress)
    # Every oracle the engine has runs on both trees, before any pair: a B that changes results fails
    # whatever its speed, and its records say which case it changed.
    for side, tree in zip("AB", trees):
        yield from engine.oracles(cfg, ctx, side, tree, builds[side])
    calls: list[Call] = engine.calls(module, cfg)
    sides = {(c.label, s): Side() for c in calls for s in "AB"}
    evidence = {c.label: EvidenceLog() for c in calls}
    rng = np.random.default_rng(opts.seed)
    first = {c.label: int(rng.integers(2)) for c in calls}  # each call's pair order in repetition 0

    def run(call: Call, side: str, program: Path, count: bool = False):
        result = engine.run(device, side, call, program, count)
        evidence[call.label].add(result.evidence)
        if (count or device.profile.has("counts")) and result.counts is None:
            tree = trees["AB".index(side)]
            raise MissingCount(f"{side} ({tree.spec}) {call.label}: {call.program} was due a count on "
                               f"{device.name} and marked no timed region (its timings.json names no marks); "
                               "a call one side did not count is not judged")
        return result

    ratios = {c.label: {"cpu": [], "wall": []} for c in calls}
    repetition = 0

    def take(open_calls: list[int], pairs: int) -> list[list[float]]:
        """`pairs` more pairs of each open call, interleaved (ABBA); their CPU ratios."""
        nonlocal repetition
        before = {i: len(ratios[calls[i].label]["cpu"]) for i in open_calls}
        taken, look = 0, pairs * len(open_calls)
        for _ in range(pairs):
            for i in rng.permutation(open_calls):
                call = calls[i]
                taken += 1  # inside the look: what the heartbeat says, with the look's time left
                ctx.progress(Tick(f"A/B pairs {taken}/{look} of this look ({len(open_calls)} call(s)): {call.label}"))
                order = "AB" if (first[call.label] + repetition) % 2 == 0 else "BA"
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
                a, b = sides[(call.label, "A")], sides[(call.label, "B")]
                for clock in ("cpu", "wall"):
                    pair = getattr(a, clock)[-1:] + getattr(b, clock)[-1:]
                    if len(pair) == 2 and pair[0] > 0:
                        ratios[call.label][clock].append(pair[1] / pair[0])
                runner.raise_if_stopped()
            repetition += 1
        return [ratios[calls[i].label]["cpu"][before[i]:] for i in open_calls]

    started = cpu_seconds()

    def afford(runs: int) -> bool:
        """Whether `runs` more pairs fit the budget at the CPU a pair has cost so far."""
        spent, done = cpu_seconds() - started, sum(len(r["cpu"]) for r in ratios.values())
        return spent + spent / max(done, 1) * runs <= opts.budget

    design = opts.design(emulated)
    ctx.progress(f"A/B design: {design.describe()}" + ("" if opts.reps else f", CPU budget {opts.budget:g} s"))
    outcome = sequential.drive(design, len(calls), take, afford, opts.min_change, ctx.progress)
    spent = cpu_seconds() - started
    if count_here:  # one run per tree and call under valgrind, with its build that valgrind can run
        for side, tree in zip("AB", trees):
            ctx.progress(f"building {side} ({tree.spec}) for valgrind")
            counted = engine.build(side, tree, device, ctx.progress, for_valgrind=True)
            for k, call in enumerate(calls, 1):  # minutes each at bench sizes: counted, so the time left shows
                ctx.progress(f"counting {side}'s instructions under valgrind {k}/{len(calls)}: {call.label}")
                sides[(call.label, side)].instructions.append(run(call, side, counted, count=True).counts.per_call)

    judged = {"cpu": outcome.judgements,
              "wall": sequential.judge(design, [ratios[c.label]["wall"] for c in calls], opts.min_change)}

    for i, call in enumerate(calls):
        a, b = sides[(call.label, "A")], sides[(call.label, "B")]
        a_count = a.instructions[0] if a.instructions else None
        b_count = b.instructions[0] if b.instructions else None
        verdicts = {"instructions": count_verdict(a_count, b_count, opts.threshold, uncounted)}
        # Figures the nightly's history judges: B's instructions (an exact count) and the CPU ratio (with
        # its A/B block: testbed.measure.history's contract). The wall ratio is shown, not judged; the two sides'
        # times ride in the metrics only, so no raw time is ever compared across nights.
        figures: dict[str, Figure] = {}
        if b.instructions:
            figures["instructions"] = Figure.of(b.instructions, "instructions")
        if not emulated:
            for clock in ("cpu", "wall"):  # the adaptive design's undecided call is not called "no change"
                verdicts[clock] = "undecided" if opts.reps is None and not judged[clock][i].decided \
                    else judged[clock][i].verdict
            if ratios[call.label]["cpu"]:
                figures["ab_ratio_cpu"] = Figure.of(ratios[call.label]["cpu"], "ratio")
                figures["ab_ratio_cpu"].ab = {
                    "a_commit": trees[0].revision, "b_commit": trees[1].revision, "p": judged["cpu"][i].p,
                    "pairs": len(ratios[call.label]["cpu"]), "test": "wilcoxon", "verdict": verdicts["cpu"]}
            if ratios[call.label]["wall"]:
                figures["ab_ratio_wall"] = Figure.of(ratios[call.label]["wall"], "ratio")
        worse = verdicts["instructions"] == "slower" or verdicts.get("cpu") == "slower"
        same_output = (a.outputs is not None and b.outputs is not None and a.outputs.keys() == b.outputs.keys()
                       and all(np.array_equal(a.outputs[k], b.outputs[k]) for k in a.outputs))
        ab = {"a": trees[0].spec, "b": trees[1].spec, "a_commit": trees[0].revision, "b_commit": trees[1].revision,
              "test": "wilcoxon signed-rank on log(B/A), Holm over calls", "pairs": len(ratios[call.label]["cpu"]),
              "p": judged["cpu"][i].p_adjusted, "p_raw": judged["cpu"][i].p, "p_wall": judged["wall"][i].p_adjusted,
              "design": design.describe(), "looks": outcome.looks_taken, "stopped": outcome.stopped,
              "decided": judged["cpu"][i].decided, "need_pairs": judged["cpu"][i].need,
              "cpu_interval": [judged["cpu"][i].low, judged["cpu"][i].high], "undecided_why": judged["cpu"][i].why,
              "budget_cpu_s": None if opts.reps else opts.budget, "spent_cpu_s": round(spent, 1),
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
                     params={"reps": opts.reps, "max_pairs": None if opts.reps else opts.max_pairs},
                     artifacts=engine.artifacts(trees, builds, call),
                     evidence=evidence[call.label].take())


class MissingCount(CountError):
    """A count was due (a counting device, or counts=true on the host) and one side's run has none."""


class BuildFailed(DeviceError):
    """A tree's programs do not build for the device: exit status 4, with the compiler's first error."""


class NativeEngine:
    """backend=native: each tree's kernels/ programs (testbed.backends.native.build), the unfused build or
    (the experiment's fused=true) the FMA one; no oracles (the measured calls' outputs are compared,
    `same_output`)."""

    valgrind_counts = True  # its calls can be counted under valgrind on a host that does not count itself
    uncounted = "not counted"

    def __init__(self, fused: bool = False):
        self.fused = fused

    def calls(self, module, cfg) -> list[Call]:
        return module.ab_calls(cfg)

    def run(self, device, side: str, call: Call, program: Path, count: bool):
        return run_native(device, NativeJob(program / call.program, call.inputs, call.outputs, call.args,
                                            measured=not count, count=count))

    def target(self, device) -> str:
        return target_for_abi(device.profile.abi)

    def build(self, side: str, tree: Tree, device, progress, for_valgrind: bool = False) -> Path:
        try:  # valgrind cannot run AVX-512: its runs use the build without it
            return build_programs(self.target(device), fused=self.fused, kernels_dir=tree.kernels_dir,
                                  avx512=not for_valgrind)
        except BuildError as e:
            raise BuildFailed(f"{side} ({tree.spec}): {e}") from None

    def oracles(self, cfg, ctx, side: str, tree: Tree, programs: Path):
        return iter(())

    def artifacts(self, trees, builds: dict, call: Call) -> dict:
        return {"a_programs": str(builds["A"].name), "b_programs": str(builds["B"].name)}


class LlamacppEngine(NativeEngine):
    """backend=llamacpp: each side is a llama.cpp tree (testbed.backends.llamacpp.trees) whose programs
    are built for the device by testbed.backends.llamacpp.build (cached by content; ccache shares what
    did not change between the two), the experiment's llama.cpp calls measured (its `ab_calls` with
    backend=llamacpp: ggml's op in tb_ggml_gdn, which marks its timed call for the counters), and the
    experiment's llama.cpp oracles (`ab_oracles`) run on both trees. test-backend-ops' perf cases are
    not among the calls: its timed loop has no marks a counter can find, and its own clock on an
    emulator says nothing of speed."""

    def __init__(self, module, programs: tuple[str, ...]):
        self.module, self.programs = module, programs

    def target(self, device, for_valgrind: bool = False) -> str:
        p = device.profile
        target = llamacpp_build.target_for(p.name, p.abi, p.capabilities)
        # valgrind cannot run this CPU's AVX-512 (GGML_NATIVE): the host's counted runs use the generic build
        return "host-generic" if for_valgrind and target == "host" else target

    def build(self, side: str, tree, device, progress, for_valgrind: bool = False) -> Path:
        try:
            return llamacpp_build.build(self.target(device, for_valgrind), str(tree.source), self.programs,
                                        progress).folder
        except llamacpp_build.BuildError as e:
            raise BuildFailed(f"{side} ({tree.spec}): {e}") from None

    def oracles(self, cfg, ctx, side: str, tree, programs: Path):
        built = json.loads((programs / "build.json").read_text())
        for record in self.module.ab_oracles(cfg, ctx, programs):
            record.case = f"ab/{side}/{record.case}"
            record.params |= {"ab_side": side, "tree": tree.spec}
            record.artifacts |= {"llamacpp_source_sha256": built["source_sha256"], "tree": tree.revision,
                                 **{f"{name}_sha256": sha256_file(programs / name) for name in self.programs}}
            if record.verdict == "fail":
                ctx.progress(f"{side} ({tree.spec}) fails {record.case}: {record.detail}")
            yield record

    def artifacts(self, trees, builds: dict, call: Call) -> dict:
        out = {}
        for side, tree in zip("ab", trees):
            folder = builds[side.upper()]
            built = json.loads((folder / "build.json").read_text())
            out |= {f"{side}_source_sha256": built["source_sha256"], f"{side}_tree": tree.revision,
                    f"{side}_program_sha256": sha256_file(folder / call.program),
                    f"{side}_elf_machine": str(elf_machine(folder / call.program)),
                    f"{side}_build_target": built["target"]}
        return out


class ContractEngines:
    """`engine:A engine:B`: two engines under test (or two builds of one: a lab's second yaml naming another
    source), each side's program built as its yaml says and serving the experiment's engine calls
    (`ab_engine_calls`) through engine contract v1. Its oracles are the experiment's own
    (`testbed run EXPERIMENT backend=engine engine=NAME`); here the outputs of the measured calls are
    compared, `same_output`. Counted on devices that count (per marked call, or per process and labelled
    so); not under valgrind on this host, whose engine builds may hold AVX-512."""

    valgrind_counts = False
    uncounted = "not counted (engines are counted on devices that count)"

    def __init__(self, specs):
        self.specs = specs

    def calls(self, module, cfg) -> list[Call]:
        return module.ab_engine_calls(cfg)

    def refusals(self, cfg, device, experiment: str, trees):
        """A "not supported" record for each side whose yaml does not serve the experiment's calls here."""
        from testbed.backends.engine import refusals

        for side, spec, tree in zip("AB", self.specs, trees):
            why = refusals.why_not(spec, device, experiment, weights=cfg.get("native", {}).get("weights"))
            if why is not None:
                yield from refusals.records(experiment, [(f"ab/{side}/engine", "engine")], why,
                                            {"ab_side": side, "tree": tree.spec})

    def run(self, device, side: str, call: Call, program: Path, count: bool):
        from testbed.backends.engine.gemma import ab_run

        return ab_run(device, self.specs["AB".index(side)], call, program)

    def target(self, device) -> str:
        return target_for_abi(device.profile.abi)

    def build(self, side: str, tree: Tree, device, progress, for_valgrind: bool = False) -> Path:
        from testbed.backends.engine import build

        return build.program_for(self.specs["AB".index(side)], self.target(device))

    def oracles(self, cfg, ctx, side: str, tree: Tree, programs: Path):
        return iter(())

    def artifacts(self, trees, builds: dict, call: Call) -> dict:
        return {"a_programs": str(builds["A"].name), "b_programs": str(builds["B"].name),
                **{f"{side}_engine_yaml_sha256": spec.yaml_sha256 for side, spec in zip("ab", self.specs)}}


def engine_sides(a: str, b: str):
    """`engine:NAME` on both sides: the two engines (or two builds of one: a lab's second yaml naming
    another source) as Trees for the records, and their specs; None when neither side is an engine."""
    if not (a.startswith("engine:") or b.startswith("engine:")):
        return None
    if not (a.startswith("engine:") and b.startswith("engine:")):
        raise UsageError(f"ab {a} {b}: one side is an engine, the other not; accepted: two source trees, or "
                         "engine:NAME engine:NAME")
    from testbed.backends.engine import build, spec as engine_spec

    specs = [engine_spec.load(x.removeprefix("engine:")) for x in (a, b)]
    trees = tuple(Tree(x, f"{s.name}@{s.yaml_sha256[:12]}" + (f"+{build.tree_hash(s.source)[:12]}" if s.source else ""),
                       s.source or s.path.parent) for x, s in zip((a, b), specs))
    return trees, specs


CALL_UNJUDGED = ("not measured", "too few pairs", "undecided")  # a call's overall verdict when nothing judged it


def _overall(verdicts: dict) -> str:
    """One word for a call (B worse is "slower", decided before this): "no change" only when something
    was judged and all of it held still. A CPU time left undecided is said as such, whatever the
    instructions did under their threshold: a sub-1% "changed" never stands for a verdict on time."""
    known = {v for v in verdicts.values() if not v.startswith("not counted")} - {"too few pairs"}
    if "faster" in known or "fewer" in known:
        return "faster"
    if verdicts.get("cpu") == "undecided":
        return "undecided"
    if verdicts.get("cpu") == sequential.BELOW_FLOOR:
        return sequential.BELOW_FLOOR
    if known - {"no change"}:
        return "changed"
    if known:
        return "no change"
    return "too few pairs" if "too few pairs" in verdicts.values() else "not measured"


# --- the command ------------------------------------------------------------------------------------


def table(rows: list[dict]) -> pd.DataFrame:
    out = []
    for r in rows:
        ab, fig = r["metrics"]["ab"], r["figures"]
        change = ab["instructions_change"]
        out.append({  # the verdict beside the call: the first columns are what a narrow terminal keeps
            "call": r["case"].removeprefix("ab/"),
            "verdict": ab["verdict"] + ("" if ab["same_output"] else " (outputs differ)"), "kernel": ab["kernel"],
            "instructions A": ab["instructions_a"], "instructions B": ab["instructions_b"],
            "instr. change": ab["verdicts"]["instructions"] if change is None else f"{change:+.3%}",
            "cpu B/A": fig["ab_ratio_cpu"]["median"] if "ab_ratio_cpu" in fig else None,
            "wall B/A": fig["ab_ratio_wall"]["median"] if "ab_ratio_wall" in fig else None,
            "pairs": ab["pairs"], "p (cpu, Holm)": ab["p"],
        })
    return pd.DataFrame(out)


def options(args) -> Options:
    """The command's options, checked: a bad value is refused in one line before anything is built."""
    reps = None if args.reps is None else \
        _integer("--reps", args.reps, 1, f"(>= {sequential.MIN_PAIRS} to judge time)")
    fraction = (lambda v: 0 <= v <= 1, "a finite fraction from 0 to 1 (0.01 is 1%)")
    return Options(reps, args.seed, _real("--threshold", args.threshold, *fraction),
                   _real("--min-change", args.min_change, *fraction),
                   _real("--budget", args.budget, lambda v: v > 0, "a finite number of CPU-seconds > 0"),
                   _integer("--max-pairs", args.max_pairs, sequential.MIN_PAIRS, "(the first look's pairs)"))


def _integer(option: str, text: str, least: int, note: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not least <= value <= MAX_REPS:
        raise UsageError(f"{option} {text} is not accepted; accepted: an integer from {least} to {MAX_REPS} {note}")
    return value


def _real(option: str, text: str, within, accepted: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and within(value)):
        raise UsageError(f"{option} {text} is not accepted; accepted: {accepted}")
    return value


BACKENDS = ("native", "llamacpp")
MAX_NAMED = 10  # failing oracle records named on the terminal (all of them are stored)


def command(args) -> int:
    opts = options(args)
    rc = config.load(args.overrides, experiment="gdn")  # experiment= among the overrides, else gdn
    module = experiments.load(rc.experiment)
    sides = engine_sides(args.a, args.b)
    if sides:  # two engines under test through the contract: backend=engine, the experiment's engine calls
        if not hasattr(module, "ab_engine_calls"):
            raise UsageError(f"experiment {rc.experiment!r} has no A/B calls for engines; accepted: chunk_prefill")
        if args.repo is not None:
            raise UsageError("--repo names a llama.cpp checkout for backend=llamacpp; engine:NAME sides are built "
                             "as their yaml says")
        rc = config.load([*args.overrides, "backend=engine", f"engine={sides[1][1].name}"], experiment="gdn")
        from testbed.backends.engine import build as engine_build
        from testbed.devices import load_profile

        for spec in sides[1]:  # A's too: both are refused before the run starts
            engine_build.check_device(spec, load_profile(rc.device))
        return _report(args, rc, module, opts, sides[0], ContractEngines(sides[1]))
    named = next((o.lstrip("+").split("=", 1)[1] for o in args.overrides if o.lstrip("+").startswith("backend=")), None)
    if named is not None and named not in BACKENDS:
        raise UsageError(f"testbed ab measures native programs or llama.cpp trees; backend={named} is not accepted "
                         f"(accepted: {' or '.join('backend=' + b for b in BACKENDS)}; backend=native when none is named; or "
                         "engine:NAME engine:NAME for two engines)")
    backend = named or "native"
    if not hasattr(module, "ab_calls") or backend not in getattr(module, "AB_BACKENDS", ("native",)):
        offered = [n for n in config.choices("experiment") if hasattr(experiments.load(n), "ab_calls")
                   and backend in getattr(experiments.load(n), "AB_BACKENDS", ("native",))]
        raise UsageError(f"experiment {rc.experiment!r} has no A/B calls for backend={backend}; accepted: "
                         f"{', '.join(offered)}")
    if rc.cfg.get("backend") != backend:  # the device's default backend, unless one was named
        rc = config.load([*args.overrides, f"backend={backend}"], experiment="gdn")
    if backend == "llamacpp":
        say = (lambda msg: print(msg, file=sys.stderr, flush=True))
        trees = tuple(llamacpp_trees.resolve(spec, args.repo, say) for spec in (args.a, args.b))
        engine = LlamacppEngine(module, module.AB_PROGRAMS)
    else:
        if args.repo is not None:
            raise UsageError("--repo names a llama.cpp checkout for backend=llamacpp; backend=native takes "
                             "revisions of this checkout")
        trees, engine = (resolve_tree(args.a), resolve_tree(args.b)), None  # measure's NativeEngine
    return _report(args, rc, module, opts, trees, engine)


def _report(args, rc, module, opts, trees, engine) -> int:
    """Run the comparison as one job, print its table and say the outcome: exit 1 when B is worse or an
    oracle fails on either tree."""
    progress = ProgressLine()  # a line per step, a heartbeat through the silent ones (builds, valgrind)
    try:
        outcome = runner.execute(rc, progress=progress,
                                 produce=lambda cfg, ctx: measure(cfg, ctx, module, rc.experiment, trees, opts, engine))
    finally:
        progress.close()
    rows = outcome.rows
    df = table([r for r in rows if r["kind"] == "measure"])
    # the terminal's table fits it; every column: the format options, or the records (`testbed table`)
    print(tables.for_terminal(df.dropna(axis=1, how="all"), f"--format csv|json, or `testbed table {rc.experiment} "
                                                           "--format md`", settings=())
          if args.format == "md" else tables.render(df, args.format))
    worse = [r for r in rows if r["kind"] == "measure" and r["metrics"]["ab"]["verdict"] == "slower"]
    # an oracle that did not pass on either tree fails the comparison, whatever the speed
    wrong = [r for r in rows if r["kind"] == "oracle" and r["verdict"] in FAILING]
    for side, tree in zip("AB", trees):
        side_rows = [r for r in rows if r["kind"] == "oracle" and r["params"].get("ab_side") == side]
        if side_rows:
            print(f"oracles on {side} ({tree.spec}): {Tally.of_records(side_rows).phrase()}")
            for r in side_rows:  # a refusal is said, never counted against the tree
                if r["verdict"] in UNJUDGED:
                    print(tables.printable(f"{LABEL[r['verdict']]} {side} ({tree.spec}) "
                                           f"{r['case'].removeprefix(f'ab/{side}/')}: {r['detail']}"))
    for r in wrong[:MAX_NAMED]:  # a run's own error record (no side) is named by its case alone
        side, tree = r["params"].get("ab_side"), r["params"].get("tree")
        where = f"{side} ({tree}) {r['case'].removeprefix(f'ab/{side}/')}" if side else r["case"]
        print(tables.printable(f"FAILED {where}: {r['verdict']}: {r['detail']}"))
    if len(wrong) > MAX_NAMED:
        print(f"... and {len(wrong) - MAX_NAMED} more oracle records that failed (testbed records)")
    if args.format == "md":
        where = f"{rc.device}" + (" (emulated: instructions only, times not judged)" if outcome.info.emulated else "")
        print(f"\nA = {trees[0].spec} ({_short(trees[0].revision)}), B = {trees[1].spec} ({_short(trees[1].revision)}) "
              f"on {where}, seed {opts.seed}; run {outcome.info.run_id} stored")
        if measured := [r["metrics"]["ab"] for r in rows if r["kind"] == "measure"]:
            print(f"design {measured[0]['design']}; {measured[0]['looks']} look(s), {measured[0]['spent_cpu_s']} "
                  f"CPU-s; stopped: {measured[0]['stopped']}")
        for r in worse:
            ab = r["metrics"]["ab"]
            what = []
            if ab["verdicts"]["instructions"] == "slower":
                what.append(f"instructions {ab['instructions_a']} -> {ab['instructions_b']} "
                            f"({ab['instructions_change']:+.2%})")
            if ab["verdicts"].get("cpu") == "slower":
                what.append(f"CPU time x{r['figures']['ab_ratio_cpu']['median']:.3f} (p={ab['p']:.2g})")
            print(f"SLOWER {ab['kernel']} {r['case'].removeprefix('ab/')}: {'; '.join(what)}")
        measured = [r for r in rows if r["kind"] == "measure"]
        for r in measured:  # an open CPU verdict or a change under the floor, said per call in full
            ab = r["metrics"]["ab"]
            cpu = ab["verdicts"].get("cpu")
            if cpu == "undecided":
                why = ab.get("undecided_why") or ab["stopped"]
                print(tables.wrap(f"UNDECIDED {r['case'].removeprefix('ab/')}: CPU time {why}"))
            elif cpu == sequential.BELOW_FLOOR:
                low, high = ab.get("cpu_interval") or (None, None)
                print(tables.wrap(f"BELOW FLOOR {r['case'].removeprefix('ab/')}: CPU time B/A "
                                  f"{r['figures']['ab_ratio_cpu']['median']:.3f} (95%: {low:.3f} to {high:.3f}): a "
                                  f"change below {sequential.floor_words(ab['min_change'])}"))
        unjudged = [r["case"].removeprefix("ab/") + f" ({r['metrics']['ab']['verdict']})" for r in measured
                    if r["metrics"]["ab"]["verdict"] in CALL_UNJUDGED]
        if wrong:
            on = " and ".join(f"{side} ({tree.spec})" for side, tree in zip("AB", trees)
                              if any(r["params"].get("ab_side") == side for r in wrong))
            print(f"FAILED: {len(wrong)} oracle record(s) failed on {on}: results changed, whatever the speed")
        elif declined(rows):
            print("nothing measured: an engine declines these calls (NOT SUPPORTED above)")
        elif not worse and unjudged:
            judged = len(measured) - len(unjudged)
            print(tables.wrap(f"B is not shown worse than A: {judged} call(s) judged not worse; not judged: "
                              f"{', '.join(unjudged)}"))
        elif not worse:
            print("B is not worse than A on any call")
    if declined(rows):
        return NOTHING_JUDGED
    return 1 if worse or wrong else 0


def declined(rows: list[dict]) -> bool:
    """Nothing measured and nothing judged: a side's engine declined the calls (ContractEngines.refusals)."""
    oracles = [r for r in rows if r["kind"] == "oracle"]
    return bool(oracles) and not any(r["kind"] == "measure" for r in rows) and Tally.of_records(oracles).judged == 0


def _short(revision: str) -> str:
    """A commit by its first 12 hex digits; any other revision (a folder, a patched sdist) whole."""
    return revision[:12] if len(revision) == 40 and all(c in "0123456789abcdef" for c in revision) else revision


def register(commands) -> None:
    c = commands.add_parser("ab", help="two source trees' programs (testbed's kernels/ or llama.cpp's) measured "
                                       "interleaved in one job; exit 1 when B is worse or an oracle fails")
    c.add_argument("a", help="backend=native (the default): a git revision of this checkout (HEAD, HEAD~1, a branch) "
                             "or a folder holding kernels/ ('.' is the working tree); backend=llamacpp: sdist, a "
                             "llama.cpp folder, a revision of the --repo checkout, BASE+PATCH or a patch file (on "
                             "the sdist)")
    c.add_argument("b", help="the same kinds as A; B is judged against A")
    c.add_argument("--repo", default=None, help="backend=llamacpp: the llama.cpp git checkout whose revisions A and B "
                                                "may name")
    c.add_argument("overrides", nargs="*", help="the experiment's key=value, e.g. experiment=gdn device=qemu-aarch64 "
                                                "'bench.tokens=[512]'")
    # the numbers are checked by options(), which says in one line what is accepted
    c.add_argument("--reps", default=None, help=f"a fixed design: pairs per call, 1 to {MAX_REPS} (>= "
                                                f"{sequential.MIN_PAIRS} to judge time); default: adaptive")
    c.add_argument("--budget", default=str(Options.budget),
                   help=f"adaptive: CPU-seconds the pairs may spend (default {Options.budget:g})")
    c.add_argument("--max-pairs", default=str(Options.max_pairs),
                   help=f"adaptive: pairs per call at the last look, {sequential.MIN_PAIRS} to {MAX_REPS} "
                        f"(default {Options.max_pairs})")
    c.add_argument("--seed", type=int, default=0, help="the order's seed (recorded)")
    c.add_argument("--threshold", default="0.01", help="instructions: the rise that is a regression, a fraction "
                                                       "from 0 to 1 (default 0.01 = 1%%)")
    c.add_argument("--min-change", default=str(Options.min_change),
                   help=f"time: the least median change judged, a fraction from 0 to 1 (default {Options.min_change:g})")
    c.add_argument("--format", choices=tables.FORMATS, default="md")
    c.set_defaults(fn=command)
