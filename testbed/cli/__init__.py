"""The `testbed` command.

  testbed run EXPERIMENT [key=value ...]          one run, records stored, summary printed
  testbed sweep [experiment=NAME] key=v1,v2 ...   the cartesian product (Hydra sweep syntax), one table
  (run and sweep take Hydra's options: --cfg job [--resolve] [--package KEY] prints the composed config
  and exits, nothing run or stored; --help lists the config groups and, for a named experiment, its
  keys; `run EXPERIMENT -m key=a,b` is `sweep experiment=EXPERIMENT key=a,b`. hydra.* overrides are
  refused: testbed composes with Hydra but stores runs in its results store, not Hydra's folders)
  testbed table EXPERIMENT [--format md|csv|json|jsonl] tables from stored records only (json, jsonl
                                                  and csv are data: machine column names, numbers, raw
                                                  samples, breakevens apart; csv rows alone)
  testbed ingest FILE [--device NAME]             store test-backend-ops output run elsewhere
  testbed records verify | rm ... | export        inspect and repair the results store
  testbed compare A B [--format md|csv|json|jsonl] two commits, nights or stores: each change, beyond noise or not
  testbed ab A B [key=value ...]                  two source trees' programs measured interleaved in one job
  testbed gguf CHECKPOINT [--out FILE]            the GGUF of a Hugging Face folder (Gemma 3, Qwen3.5), as
                                                  llama.cpp's converter writes it, judged by testbed's reader
  testbed engine replay RUN CALL | SHA            an engine's failing call, kept by the run, run again once
  (run and sweep take farm=HEAD:PORT: the jobs run on the lab's hosts that own their devices)

Exit status: 0 at least one oracle was judged and none failed (or the run only measures), 1 an oracle
failed (or no records to show), 2 bad input, 3 a device could not be reached, 4 a device operation
failed, 5 the results store cannot be written, 6 testbed itself broke (compare: never 1, which means a
regression), 7 nothing was judged: every verdict is "not supported" (the engine or device refused) or
"not judged" (testbed.verdicts), 128+N stopped by signal N (SIGINT, SIGTERM, SIGHUP; the run is stored as
broken).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import pandas as pd
from omegaconf import OmegaConf

from testbed import __version__, config, experiments, runner, verdicts
from testbed.cli import devices as device_cli, engine as engine_cli, records as records_cli
from testbed.errors import DeviceError, DeviceUnreachable, StoreError, ToolMissing, UsageError
from testbed.heartbeat import Lasting, ProgressLine, time_left
from testbed.lab import ab, compare, farm, nightly
from testbed.measure import emulation
from testbed.report import build as report, tables


def _summary(outcome: runner.Outcome, module) -> str:
    df = outcome.frame()
    oracles = df[df["kind"] == "oracle"] if len(df) else df
    tally = outcome.tally
    # An experiment may condense its run into several small tables; the full view is `testbed table`.
    shown = module.summary(df) if hasattr(module, "summary") else [module.view(df)]
    full = f"testbed table {outcome.info.experiment} --format md|csv|json"
    lines = [*(tables.for_terminal(t, full) + "\n" for t in shown)] if len(df) else ["(no records)", ""]
    if len(df) and hasattr(module, "breakevens"):
        lines += [tables.breakeven_line(b) for b in module.breakevens(df)]
    lines.append(
        f"{outcome.info.experiment} on {outcome.info.device} ({outcome.info.backend}): "
        f"oracles {tally.phrase()}, {len(df) - len(oracles)} measurements; run {outcome.info.run_id} stored"
    )
    for _, r in oracles[oracles["verdict"] != verdicts.PASS].iterrows() if len(oracles) else []:
        lines.append(tables.printable(f"{verdicts.LABEL.get(r['verdict'], 'ERROR')} {r['case']}: {r['detail']}"))
    if tally.exit_status() == verdicts.NOTHING_JUDGED:
        lines.append(f"NOTHING JUDGED: every verdict is not supported or not judged; nothing passed and nothing "
                     f"failed (exit {verdicts.NOTHING_JUDGED})")
    if outcome.info.emulated and len(df) > len(oracles):
        lines.append(f"NOTE: {outcome.info.device} is emulated: its times are {emulation.REASON}, and no choice "
                     "is drawn from them; its instruction counts are exact, and decide")
    load = outcome.info.host_load
    if load.get("noisy") and len(df) > len(oracles):
        lines.append(f"WARNING: this host was loaded while measuring (1-minute load "
                     f"{max(load['load_1m_before'], load['load_1m_after']):.1f} on {load['cores']} cores): "
                     f"the figures are noisy; the records say so (host_load.noisy)")
    return tables.wrap("\n".join(lines))


def _print_composed(rc: config.RunConfig, args) -> None:
    """`--cfg job`: the composed config as Hydra prints it (YAML; interpolations kept unless --resolve;
    with --package KEY only that part, under Hydra's `# @package KEY` line)."""
    part = rc.cfg
    if args.package and args.package != "_global_":
        part = OmegaConf.select(rc.cfg, args.package, default=None)
        if part is None:
            raise UsageError(f"--package {args.package!r} names no part of {rc.experiment}'s config; accepted: "
                             f"{', '.join(map(str, rc.cfg.keys()))} or a dotted key under one")
        sys.stdout.write(f"# @package {args.package}\n")
    sys.stdout.write(OmegaConf.to_yaml(part, resolve=args.resolve) if OmegaConf.is_config(part) else f"{part}\n")


def _names_experiment(overrides: list[str]) -> bool:
    return any(o.split("=", 1)[0].lstrip("+") == "experiment" for o in overrides)


def cmd_run(args) -> int:
    if args.multirun:  # Hydra's -m: the sweep of the same overrides, the experiment named as run names it
        if not _names_experiment(args.overrides):
            args.overrides = [f"experiment={args.experiment}", *args.overrides]
        return cmd_sweep(args)
    address, overrides = config.split_farm(args.overrides)
    rc = config.load(overrides, experiment=args.experiment)
    if args.cfg:
        _print_composed(rc, args)
        return 0
    if address:  # on the lab's node that owns the device
        runner.check(rc)
        [outcome] = farm.execute(address, [rc], runner.results_store(rc))
    else:
        progress = ProgressLine()
        try:
            outcome = runner.execute(rc, progress=progress)  # checks every parameter before running
        finally:
            progress.close()
    module = experiments.load(rc.experiment)
    print(_summary(outcome, module))
    return outcome.tally.exit_status()


def _sweep_here(jobs: list[config.RunConfig]):
    """The sweep's jobs one after the other in this process: a line per job (with the time left at the
    pace of the jobs done), then the job's own progress (testbed.heartbeat.ProgressLine)."""
    began = time.monotonic()
    for i, rc in enumerate(jobs):
        label = " ".join(o for o in rc.overrides if o.split("=")[0] not in ("experiment",))
        progress = ProgressLine()
        progress(Lasting(f"job {i + 1} of {len(jobs)}: {rc.experiment} {label}"
                         f"{time_left(time.monotonic() - began, i, len(jobs))}"))
        try:
            outcome = runner.execute(rc, progress=progress)
        finally:
            progress.close()
        yield outcome


def cmd_sweep(args) -> int:
    address, overrides = config.split_farm(args.overrides)
    together = experiments.sweep_together(config.swept_experiments(overrides))
    jobs = [config.load(combo) for combo in config.expand_sweep(overrides, together)]
    if args.cfg:  # each job's config, one YAML document each
        for i, rc in enumerate(jobs):
            sys.stdout.write(f"{'---' + chr(10) if i else ''}# job {i + 1}/{len(jobs)}: {' '.join(rc.overrides)}\n")
            _print_composed(rc, args)
        return 0
    modules = [runner.check(rc)[0] for rc in jobs]  # every job is checked before the first one runs
    # with farm=, on the lab's nodes that own the devices, devices side by side
    outcomes = farm.execute(address, jobs, runner.results_store(jobs[0])) if address else _sweep_here(jobs)
    rows, tally, frames = [], verdicts.Tally(), {}
    for rc, module, outcome in zip(jobs, modules, outcomes):
        tally += outcome.tally
        summarise = getattr(module, "sweep_row", lambda df: module.view(df).iloc[0].to_dict())
        frame = outcome.frame()
        frames.setdefault(module, []).append(frame)
        rows.append({"experiment": rc.experiment, **dict(o.split("=", 1) for o in rc.overrides
                                                          if not o.startswith("experiment=")),
                     **summarise(frame)})
    named = " or ".join(f"`testbed table {e} --format md|csv|json`"
                        for e in dict.fromkeys(rc.experiment for rc in jobs))
    settings = ["experiment", *(o.split("=", 1)[0] for rc in jobs for o in rc.overrides)]
    print(tables.for_terminal(pd.DataFrame(rows), named, settings=settings))  # results are never said once
    for module in dict.fromkeys(modules):
        if hasattr(module, "sweep_footer"):
            print(tables.wrap(module.sweep_footer(pd.DataFrame(rows), jobs)))
        more = module.more_tables(pd.concat(frames[module])) if hasattr(module, "more_tables") else {}
        for name, table in more.items():  # e.g. chunk_prefill's engines table
            print(f"\n{name}:\n{tables.for_terminal(table, named)}")
    print(f"{len(jobs)} runs, oracles {tally.phrase()}; records in {runner.results_store(jobs[0]).path}")
    return tally.exit_status()


def cmd_table(args) -> int:
    rc = config.load([], experiment=args.experiment)
    module = experiments.load(rc.experiment)
    store = runner.results_store(rc)
    df = store.frame(rc.experiment)
    if df.empty:
        print(f"no records for {rc.experiment} in {store.path}; run `testbed run {rc.experiment}` first",
              file=sys.stderr)
        return 1
    speed, emulated = emulation.split_frame(df)
    # a conclusion over the rows (a sweep's breakeven, a best chunk size) is its own object, not one more row
    breakevens = module.breakevens(speed) if hasattr(module, "breakevens") else []
    choices = module.table_choices(speed) if hasattr(module, "table_choices") else []
    view = module.view(speed)
    more = module.more_tables(speed) if hasattr(module, "more_tables") else {}  # e.g. chunk_prefill's engines table
    if args.format is None:  # the terminal: what fits 120 columns, the rest named (--format has it all)
        named = f"testbed table {rc.experiment} --format md|csv|json"
        print(tables.wrap("\n".join([
            tables.for_terminal(view, named),
            *("\n" + tables.breakeven_line(b) for b in breakevens), *("\n" + tables.choice_line(c) for c in choices),
            *(f"\n{name}:\n{tables.for_terminal(t, named)}" for name, t in more.items())])))
    else:
        # rows drawn from several records each (a sweep's row per N): the records' samples ride beside them
        behind = tables.record_samples(speed) if "samples" not in view.columns else []
        print(tables.render(view, args.format, breakevens, behind, choices, more))
    if args.format == "csv":  # the CSV holds rows alone
        for line in [*map(tables.breakeven_line, breakevens), *map(tables.choice_line, choices)]:
            print(line, file=sys.stderr)
    if len(emulated):
        print(f"\nleft out: {len(emulated)} figure(s) {emulation.REASON}:", file=sys.stderr)
        print(tables.render(emulation.listing(emulated.to_dict("records")), "md"), file=sys.stderr)
    if "incomplete" in df and df["incomplete"].fillna(False).astype(bool).any():
        runs = sorted(df.loc[df["incomplete"].fillna(False).astype(bool), "run_id"].unique())
        print(f"note: {len(runs)} run(s) did not end complete ({', '.join(runs[:5])}): their rows are shown as "
              "stored, and their verdicts never count as passed (`testbed records verify`)", file=sys.stderr)
    return 0


def cmd_ingest(args) -> int:
    """Store llama.cpp's test-backend-ops output from a run elsewhere (testbed.lab.ingest says what is refused)."""
    from testbed.devices import load_profile
    from testbed.lab import ingest
    from testbed.results import RunInfo

    ingest.check_experiment(args.experiment)
    rc = config.load([f"device={args.device}"], experiment=args.experiment)
    profile = load_profile(rc.device)
    parsed = ingest.parse_file(args.file, ingest.read_regular(args.file), args.cases)
    ingest.check_device(args.file, parsed, rc.device, profile.accelerators.get("backend") or "CPU", args.force)
    store = runner.results_store(rc)
    digest = parsed.digest(rc.device)
    earlier = None if args.force else ingest.already_stored(store.records(rc.experiment), digest)
    if earlier is not None:
        raise UsageError(f"{args.file}: this run is already stored (run {earlier['run_id']}, from "
                         f"{earlier['config'].get('source')}); nothing stored (--force stores it again)")
    tool_backend = ",".join(sorted(parsed.backends)) or "?"
    info = RunInfo(experiment=rc.experiment, device=rc.device, backend=args.backend,
                   config={"source": args.file, "source_digest": digest},
                   fingerprint={"abi": profile.abi, "source": "ingested"})
    rows = [info.stamp(r) for r in ingest.records(rc.experiment, tool_backend, parsed)]
    store.check_writable()
    store.append([info.mark("started"), *rows, info.mark("ended", "complete")])  # one batch: whole or nothing
    for r in rows:
        if r["case"].endswith("/tally"):
            print(tables.printable(f"{r['case']}: {r['metrics']['tally']} ({r['verdict']}) {r['detail']}".rstrip()))
    print(f"{len(rows)} records from {args.file} stored for {rc.experiment} on {rc.device}")
    return verdicts.Tally.of_records(rows).exit_status()


def cmd_nightly(args) -> int:
    address, overrides = config.split_farm(args.overrides)
    suite = nightly.load_suite(overrides)
    store = runner.results_store(config.load([]))
    # farm=HEAD:PORT: the lab's Ray cluster runs the jobs on the hosts that own the devices
    drive = farm.driver(address, suite) if address else None
    status, text = nightly.run_night(suite, store, drive=drive)
    print(text)
    return status


def cmd_gguf(args) -> int:
    """Write (or find, cached by content) the GGUF of a checkpoint folder and print its path; a .gguf file
    is read whole by testbed's reader (as llama.cpp reads it) and its path printed when nothing is wrong."""
    from pathlib import Path

    from testbed.models import gguf_files

    given = Path(args.checkpoint)
    if given.suffix == ".gguf" and given.is_file():
        if args.out:
            raise UsageError(f"--out={args.out}: {given} is a GGUF already; accepted: --out with a Hugging Face folder "
                             "(a .gguf alone is checked, not written)")
        gguf_files.load_gguf(given)  # whole: every weight as the model computes with it
        print(f"testbed: {given}: read by testbed's reader as llama.cpp reads it (every metadata key, every tensor's "
              "shape, type and values); nothing refused", file=sys.stderr)
        print(given)
        return 0
    print(gguf_files.write_gguf(given, args.out) if args.out else gguf_files.gguf_for(given))
    return 0


class ConfigHelp(argparse.Action):
    """Hydra's --help: the command's options, then the config groups with their options and defaults and,
    for an experiment named before --help (`run EXPERIMENT`, `sweep experiment=NAME`), its keys."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        _, overrides = config.split_farm(getattr(namespace, "overrides", None) or [])
        plain = [o.input_line for o in config.parse_overrides(overrides) if not o.is_sweep_override()]
        experiment = getattr(namespace, "experiment", None)
        named = experiment is not None or _names_experiment(plain)
        text = config.describe(config.load(plain, experiment=experiment), keys=named)  # before any output
        parser.print_help()
        print(f"\n{text}")
        for name, why in config.broken_entry_points().items():  # left out of the listing above: say why
            print(f"testbed: warning: experiment {name!r} is left out: {why}", file=sys.stderr)
        parser.exit()


def _hydra_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-h", "--help", action=ConfigHelp, help="this help, the config groups and the experiment's keys")
    p.add_argument("--cfg", choices=["job"], help="print the composed config (YAML) and exit: nothing is run, "
                                                  "checked beyond composing, or stored")
    p.add_argument("--resolve", action="store_true", help="with --cfg: resolve interpolations (${...})")
    p.add_argument("-p", "--package", help="with --cfg: only this part of the config, e.g. device or bench")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="testbed", description="Validate and benchmark on-device LLM prefill.")
    p.add_argument("--version", action="version", version=f"testbed {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="one run of an experiment", add_help=False)
    r.add_argument("experiment", help=f"one of: {', '.join(config.choices('experiment'))}")
    r.add_argument("overrides", nargs="*", help="key=value (Hydra overrides), e.g. device=host chunk=32")
    _hydra_options(r)
    r.add_argument("-m", "--multirun", action="store_true",
                   help="a sweep over the key=a,b lists given: the same as `testbed sweep experiment=EXPERIMENT ...`")
    r.set_defaults(fn=cmd_run)
    s = sub.add_parser("sweep", help="a sweep over key=v1,v2 (cartesian product)", add_help=False)
    s.add_argument("overrides", nargs="*", help="e.g. experiment=gdn chunk=16,32,64")
    _hydra_options(s)
    s.add_argument("-m", "--multirun", action="store_true", help="accepted for Hydra's sake: a sweep always is one")
    s.set_defaults(fn=cmd_sweep)
    t = sub.add_parser("table", help="a table from stored records")
    t.add_argument("experiment")
    t.add_argument("--format", choices=tables.FORMATS, default=None,
                   help="md, csv, json or jsonl: every column (default: what fits the terminal, 120 columns)")
    t.set_defaults(fn=cmd_table)
    i = sub.add_parser("ingest", help="store a tool's output: test-backend-ops console or CSV")
    i.add_argument("file")
    i.add_argument("--experiment", default="gdn", help="gdn or llamacpp")
    i.add_argument("--device", default="host")
    i.add_argument("--backend", default="ggml", help="what produced it (e.g. ggml-htp)")
    i.add_argument("--force", action="store_true",
                   help="store output that names another backend than the device's, or that is stored already")
    i.add_argument("--cases", type=int, metavar="N",
                   help="how many cases the command ran (a CSV of an op testbed has no case list for, or run with -p)")
    i.set_defaults(fn=cmd_ingest)
    n = sub.add_parser("nightly", help="run a suite (experiments/suite/) on its devices, then the report")
    n.add_argument("overrides", nargs="*", help="suite=NAME (default: default), farm=HEAD:PORT (run on the lab's "
                                                "Ray cluster) and key=value for the suite's keys")
    n.set_defaults(fn=cmd_nightly)
    g = sub.add_parser("gguf", help="the GGUF of a Hugging Face folder (Gemma 3, Qwen3.5), judged by testbed's reader")
    g.add_argument("checkpoint", help="a Hugging Face folder: config.json and *.safetensors")
    g.add_argument("--out", help="where to write it (default: .cache/gguf/, once per content)")
    g.set_defaults(fn=cmd_gguf)
    report.register(sub), compare.register(sub), ab.register(sub), device_cli.register(sub)
    records_cli.register(sub), engine_cli.register(sub)
    farm.register(sub)
    return p


# How each kind of error a user can meet is said (subclasses speak as their base; the first that fits:
# a missing tool found inside a run, e.g. valgrind for its counts, is a missing tool, not a device error).
SAYS = {ToolMissing: "missing tool: {}", UsageError: "error: {}", DeviceUnreachable: "device unreachable: {}",
        DeviceError: "device error: {}; the run was recorded as an error", StoreError: "{}"}


def main(argv: list[str] | None = None) -> int:
    runner.stop_on_signals()
    runner.RUNS.clear()  # this command's runs only (main may be called again in one process)
    runner.REACHED.clear()
    try:
        p = parser()  # it lists the config's names, the lab's included
        args, extra = p.parse_known_args(argv)
        # argparse gives a key=value after an option (`run gdn --cfg job chunk=32`) back unparsed: it is one
        # more override, as Hydra takes it
        if extra and hasattr(args, "overrides") and not any(e.startswith("-") for e in extra):
            args.overrides = [*args.overrides, *extra]
        elif extra:
            p.error(f"unrecognized arguments: {' '.join(extra)}")
        return args.fn(args)
    except tuple(SAYS) as e:  # one line each, its own status
        kind = next(k for k in SAYS if isinstance(e, k))
        print(tables.printable(f"testbed: {SAYS[kind].format(e)}"), file=sys.stderr)  # it may quote a device
        return e.exit_status
    except (KeyboardInterrupt, runner.Interrupted) as e:
        signum = e.signum if isinstance(e, runner.Interrupted) else 2
        print(f"testbed: {str(e) or 'interrupted'}; {runner.stored_so_far()}", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:  # `testbed table gdn | head`: the reader had enough; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
