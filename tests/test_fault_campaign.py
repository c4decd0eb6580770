"""The fault campaign: real `testbed run` and `testbed sweep` processes on the host, hit by the faults
the store must survive, and after each the same three questions (issue 13, "done means"):

  lost          a record that was stored (seen by a reader while the run went on, or reported stored
                by the command's summary) and is not there afterwards: must be 0
  false passes  a record that counts as passed (testbed.results.passed) although its run did not end
                complete: must be 0
  still works   `testbed report` and `testbed table` build from the store afterwards

Faults: kill -9 at random points of runs and sweeps, a disk that fills mid-run and one full before
it, runs writing the same store at once, hostile names and field values, and a store torn in the
ways crashes tear files. Random points come from a seeded generator (SEED), so a failure can be
replayed. Every loop is bounded in count and time; no check depends on a short timer (a kill that
lands after the run ended is still a valid case: that run must then read as complete and passed).

The campaign's counts are printed by its last test (pytest -s to see them).
"""

from __future__ import annotations

import errno
import os
import random
import re
import signal
import subprocess
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import pytest

from testbed import PROJECT_ROOT
from testbed.cli import main
from testbed.results import ResultsStore, passed
from tests.cli_support import said
from tests.mounts import tmpfs

SEED = 20261130
RNG = random.Random(SEED)
COUNTS = Counter(faults=0, lost=0, false_passes=0, stored_seen=0)

ORACLE_RUN = ["run", "gdn", "mode=oracle", "matrix=awkward"]  # 48 verdicts in about a second
LONG_ORACLE_RUN = ["run", "gdn", "mode=oracle", "matrix=all"]  # 116 verdicts
SWEEP = ["sweep", "experiment=gdn", "mode=oracle", "matrix=awkward", "chunk=16,32,48,64"]
DEADLINE_S = 180  # the longest any one process of the campaign may take before the test gives up
# "oracles 46 pass, 2 not supported, 3 measurements; run ID stored" (testbed.verdicts.Tally.phrase)
SUMMARY = re.compile(r"oracles ((?:\d+ [a-z ]+, )*\d+ [a-z ]+|no verdicts), (\d+) measurements; run (\w+) stored")


def start(argv: list[str], results: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "testbed", *argv], cwd=PROJECT_ROOT,
                            env={**os.environ, "TESTBED_RESULTS": str(results), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read(store: ResultsStore) -> list[dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the damage is the point here; `records verify` names it
        return store.records()


def stored_ids(store: ResultsStore) -> set[str]:
    """Ids of the records the store holds (not the error records the reader adds for unfinished runs)."""
    return {r["record_id"] for r in read(store) if not r["record_id"].endswith("-unfinished")}


def watch(proc: subprocess.Popen, store: ResultsStore, kill_after_s: float | None) -> set[str]:
    """Read the store while `proc` runs (a reader alongside the writer), kill -9 it after kill_after_s;
    returns every record id a reader saw stored."""
    seen: set[str] = set()
    t0 = time.monotonic()
    while proc.poll() is None:
        seen |= stored_ids(store)
        elapsed = time.monotonic() - t0
        if kill_after_s is not None and elapsed >= kill_after_s:
            proc.send_signal(signal.SIGKILL)
            break
        assert elapsed < DEADLINE_S, "the process ran past the campaign's deadline"
        time.sleep(0.02)
    proc.wait(timeout=DEADLINE_S)
    return seen


def reported(stdout: str) -> dict[str, tuple[int, int]]:
    """run id -> (passed, oracles), from the summaries of runs the command says it stored."""
    def counts(phrase: str) -> tuple[int, int]:
        said = {state: int(n) for n, state in re.findall(r"(\d+) ([a-z ]+?)(?:, |$)", phrase)}
        return said.get("pass", 0), sum(said.values())

    return {m.group(3): counts(m.group(1)) for m in SUMMARY.finditer(stdout)}


def audit(store: ResultsStore, seen: set[str], said: dict[str, tuple[int, int]] = {}) -> None:
    """Count what was lost and what passes falsely; both must be 0."""
    records = read(store)
    ids = {r["record_id"] for r in records}
    lost = len(seen - ids)
    for run, (n_pass, n_oracles) in said.items():
        mine = [r for r in records if r["run_id"] == run and r["kind"] == "oracle"]
        lost += max(0, n_oracles - len(mine))
        assert sum(passed(r) for r in mine) == n_pass, f"run {run}: the summary said {n_pass} passed"
    complete = {r["run_id"] for r in store.scan().rows
                if r.get("run_mark") == "ended" and r.get("outcome") == "complete" and isinstance(r.get("run_id"), str)}
    false_passes = [r["record_id"] for r in records if passed(r) and r["run_id"] not in complete]
    COUNTS["stored_seen"] += len(seen)
    COUNTS["lost"] += lost
    COUNTS["false_passes"] += len(false_passes)
    assert lost == 0, f"{lost} stored records are gone"
    assert not false_passes, f"records of unfinished runs count as passed: {false_passes[:3]}"
    for run in {r["run_id"] for r in records} - complete:  # every run that did not end complete says so
        assert any(r["run_id"] == run and r["verdict"] == "error" for r in records), f"run {run} reads as fine"


def still_works(results: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("TESTBED_RESULTS", str(results))
    assert main(["report", "--out", str(tmp_path / "report")]) in (0, 1)
    assert main(["table", "gdn"]) in (0, 1)
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    if read(ResultsStore(results)):  # (a run killed before it stored anything leaves nothing to show)
        assert (tmp_path / "report" / "report.html").is_file() and "\n|" in out.out
    else:
        assert "no records" in out.err


# --- kill -9 -------------------------------------------------------------------------------------


@pytest.mark.parametrize("round_", range(6))
def test_kill_9_at_a_random_point_of_a_run(round_, tmp_path, monkeypatch, capsys):
    results = tmp_path / "results"
    store = ResultsStore(results)
    if round_ % 2:  # half the rounds kill a run that follows a finished one in the same store
        first = start(ORACLE_RUN, results)
        out, _ = first.communicate(timeout=DEADLINE_S)
        said = reported(out)
    else:
        said = {}
    proc = start(LONG_ORACLE_RUN, results)
    seen = watch(proc, store, kill_after_s=RNG.uniform(0.0, 4.0))
    COUNTS["faults"] += 1
    out = proc.stdout.read()
    audit(store, seen, {**said, **reported(out)})
    still_works(results, tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("round_", range(3))
def test_kill_9_at_a_random_point_of_a_sweep(round_, tmp_path, monkeypatch, capsys):
    results = tmp_path / "results"
    store = ResultsStore(results)
    proc = start(SWEEP, results)
    seen = watch(proc, store, kill_after_s=RNG.uniform(1.0, 6.0))
    COUNTS["faults"] += 1
    audit(store, seen)
    ended = {r["run_id"] for r in store.scan().rows if r.get("run_mark") == "ended"}
    for run in ended:  # each run of the sweep that ended before the kill is whole
        assert sum(r["run_id"] == run and r["kind"] == "oracle" for r in read(store)) == 48
    still_works(results, tmp_path, monkeypatch, capsys)


# --- records rm on a live run ----------------------------------------------------------------------


def test_records_rm_on_a_live_run_then_kill_9(tmp_path, monkeypatch, capsys):
    """`records rm --run` of a run still going is refused (--force too, while its process lives); and if
    its start mark goes anyway (the old `rm` took it), the run killed after reads incomplete, not passed."""
    results = tmp_path / "results"
    store = ResultsStore(results)
    monkeypatch.setenv("TESTBED_RESULTS", str(results))
    proc = start(LONG_ORACLE_RUN, results)
    seen: set[str] = set()
    deadline = time.monotonic() + DEADLINE_S
    while len(seen) < 3 and proc.poll() is None and time.monotonic() < deadline:
        seen |= stored_ids(store)
        time.sleep(0.01)
    (run,) = {r["run_id"] for r in store.scan().rows if r.get("run_mark") == "started"}
    refused = [main(["records", "rm", "--run", run, *force]) for force in ([], ["--force"])]
    alive = proc.poll() is None
    store.rewrite(lambda row: row.get("run_mark") != "started")  # the old `rm`: the start mark gone, the run going on
    seen |= watch(proc, store, kill_after_s=RNG.uniform(0.0, 1.0))
    COUNTS["faults"] += 1
    if alive:
        assert refused == [2, 2] and "is still running" in capsys.readouterr().err
    audit(store, seen)
    if run not in {r["run_id"] for r in store.scan().rows if r.get("run_mark") == "ended"}:
        assert main(["records", "rm", "--run", run, "--force"]) == 0  # its process is gone now
        assert run not in {r["run_id"] for r in read(store)}
    still_works(results, tmp_path, monkeypatch, capsys)


# --- inputs staged on a device, changed there --------------------------------------------------------

NATIVE_ORACLE_RUN = ["run", "gdn", "backend=native", "mode=oracle", "matrix=awkward"]


def test_staged_inputs_corrupted_on_the_device(tmp_path, monkeypatch, capsys):
    """The host's work folder holds each case's inputs, staged once per content; bytes changed or cut
    there must be pushed again, not run (and blamed on the kernel)."""
    results = tmp_path / "results"
    store = ResultsStore(results)
    said = {}
    for round_ in range(2):
        proc = start(NATIVE_ORACLE_RUN, results)  # the host's work folder: the store's .work/host
        out, err = proc.communicate(timeout=DEADLINE_S)
        assert proc.returncode == 0, err
        said.update(reported(out))
        staged = sorted(results.glob(".work/host/inputs/*/*.npy"))
        assert staged
        for path in staged:  # every staged input: bytes flipped past the header, or the file cut
            data = bytearray(path.read_bytes())
            if RNG.random() < 0.5:
                at = RNG.randrange(128, len(data))
                data[at] ^= 0xFF
            else:
                del data[RNG.randrange(128, len(data)):]
            path.write_bytes(bytes(data))
        COUNTS["faults"] += 1
    assert all(counts == (48, 48) for counts in said.values()) and len(said) == 2
    audit(store, set(), said)
    still_works(results, tmp_path, monkeypatch, capsys)


# --- a full disk ---------------------------------------------------------------------------------


def fill(folder: Path) -> Path:
    """Take every free byte of the filesystem holding `folder` (bounded by its size)."""
    filler = folder / "filler"
    block = b"\0" * 65536
    with open(filler, "wb", buffering=0) as f:
        for _ in range(10_000):  # 640 MB at most; the tmpfs here is a few MB
            try:
                f.write(block)
            except OSError as e:
                assert e.errno == errno.ENOSPC
                break
    for size in (4096, 512, 1):  # the last partial block
        try:
            with open(filler, "ab", buffering=0) as f:
                for _ in range(64):
                    f.write(b"\0" * size)
        except OSError:
            continue
    return filler


def test_a_disk_that_fills_mid_run(tmp_path, monkeypatch, capsys):
    hits = 0
    for attempt in range(4):  # the fill must land while the run writes; a run that finished first is retried
        with tmpfs(tmp_path / f"disk{attempt}", "3m") as disk:
            results = disk / "results"
            store = ResultsStore(results)
            proc = start(LONG_ORACLE_RUN, results)
            seen: set[str] = set()
            deadline = time.monotonic() + DEADLINE_S
            while len(seen) < 5 and proc.poll() is None and time.monotonic() < deadline:
                seen |= stored_ids(store)
                time.sleep(0.01)
            filler = fill(disk)
            COUNTS["faults"] += 1
            out, err = proc.communicate(timeout=DEADLINE_S)
            if proc.returncode == 5:
                hits += 1
                assert len(said(err)) == 1 and "No space left on device" in err, err
            else:
                assert proc.returncode == 0, err
            found = store.scan()
            assert found.problems == [] and found.uncommitted == {}  # a failed batch was taken back whole
            audit(store, seen, reported(out))
            filler.unlink()
            still_works(results, tmp_path / f"out{attempt}", monkeypatch, capsys)
        if hits:
            break
    assert hits, "the disk never filled while a run was writing (4 attempts)"


def test_a_full_disk_is_found_before_the_run(tmp_path):
    with tmpfs(tmp_path / "disk", "2m") as disk:
        results = disk / "results"
        ResultsStore(results).check_writable()
        fill(disk)
        COUNTS["faults"] += 1
        proc = start(ORACLE_RUN, results)
        out, err = proc.communicate(timeout=DEADLINE_S)
        assert proc.returncode == 5 and err.count("\n") == 1 and "bytes free" in err, err
        assert (results / "records.jsonl").stat().st_size == 0  # nothing half-written


# --- runs at once --------------------------------------------------------------------------------


def test_concurrent_runs_into_one_store(tmp_path, monkeypatch, capsys):
    results = tmp_path / "results"
    store = ResultsStore(results)
    procs = [start([*ORACLE_RUN, f"chunk={c}"], results) for c in (16, 32, 64)]
    outs = [p.communicate(timeout=DEADLINE_S) for p in procs]
    COUNTS["faults"] += len(procs)
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in outs]
    said = {run: counts for out, _ in outs for run, counts in reported(out).items()}
    assert len(said) == 3 and all(counts == (48, 48) for counts in said.values())
    audit(store, set(), said)
    assert store.scan().problems == [] and main_verify(results, monkeypatch) == 0
    still_works(results, tmp_path, monkeypatch, capsys)


def main_verify(results: Path, monkeypatch) -> int:
    monkeypatch.setenv("TESTBED_RESULTS", str(results))
    return main(["records", "verify"])


# --- hostile names and values --------------------------------------------------------------------

HOSTILE = ['<script>alert(1)</script>', '"><img src=x onerror=alert(1)>', "$(touch pwned)", "new\nline",
           "back\\slash", "-rf", "| table | break |", "\u202eevil", "' OR 1=1 --"]


def test_hostile_field_values_through_ingest_report_and_table(tmp_path, seed_fixtures, monkeypatch, capsys):
    results = tmp_path / "results"
    monkeypatch.setenv("TESTBED_RESULTS", str(results))
    text = (seed_fixtures / "test-backend-ops" / "test_mode_b_CPU.stdout").read_text()
    for i, value in enumerate(v for v in HOSTILE if "\n" not in v):
        hostile = text.replace("GATED_DELTA_NET(type=f32,head_count=32,head_size=128,",
                               f"GATED_DELTA_NET(type=f32,{value},n={i},", 1)
        (tmp_path / f"h{i}.stdout").write_text(hostile)
        assert main(["ingest", str(tmp_path / f"h{i}.stdout"), f"--backend={value}"]) == 0
        COUNTS["faults"] += 1
    capsys.readouterr()
    still_works(results, tmp_path, monkeypatch, capsys)
    page = (tmp_path / "report" / "report.html").read_text()
    assert "<script>alert" not in page and "<img src=x" not in page
    assert not (PROJECT_ROOT / "pwned").exists()
    audit(ResultsStore(results), stored_ids(ResultsStore(results)))


def hostile_rows(record: dict, unfinished: str) -> list[dict]:
    """Rows of a store written by something else than testbed (or damaged): each field of a record in
    a type testbed never writes (in a run with no marks), marks with ids that are not strings, and a
    passing record that claims it is complete (incomplete: false) in a run that never ended."""
    rows = [{**record, "run_id": "hostile", "record_id": f"hostile-{key}-{i}", key: value}
            for i, (key, value) in enumerate([
                ("run_id", ["x"]), ("run_id", {"x": 1}), ("run_id", 7), ("record_id", 12), ("experiment", 5),
                ("case", None), ("kind", ["oracle"]), ("kind", "verdict"), ("verdict", {"pass": True}),
                ("figures", "fast"), ("metrics", [1, 2]), ("config", "chunk=64"), ("params", 3),
                ("margin", "big"), ("detail", ["x"]), ("evidence", {"ran": 1}), ("device", {"d": 1}),
                ("started", 5), ("fingerprint", "f"), ("schema", "2"), ("incomplete", "no"),
                ("emulated", "true")])]
    rows += [{"run_mark": "started", "run_id": {"x": 1}, "pid": "abc", "host": 5},
             {"run_mark": "ended", "run_id": ["y"], "outcome": "complete"},
             {"run_mark": "ended", "run_id": 9, "outcome": ["complete"]},
             {**record, "record_id": "claims-complete", "run_id": unfinished, "verdict": "pass", "incomplete": False}]
    return rows


def test_hostile_store_field_types(tmp_path, monkeypatch, capsys):
    """Issue 24: fields of every type testbed never writes, in committed batches: nothing crashes (the
    reader, records verify / export / rm, table, report), nothing false passes, nothing stored is lost."""
    results = tmp_path / "results"
    store = ResultsStore(results)
    proc = start(ORACLE_RUN, results)
    out, err = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 0, err
    seen = stored_ids(store)
    record = next(r for r in read(store) if r["kind"] == "oracle")
    unfinished = "never-ended"
    store.append([{**{k: record[k] for k in ("schema", "experiment", "device", "backend", "started", "config",
                                             "fingerprint", "git_commit", "testbed_version")},
                   "run_id": unfinished, "run_mark": "started", "outcome": None}])
    store.append(hostile_rows(record, unfinished))
    with open(store.path, "ab") as f:  # batch and commit ids that are not strings
        f.write(b'{"batch": ["b"], "record_id": "x"}\n{"commit": {"c": 1}, "rows": 1}\n')
    COUNTS["faults"] += 1
    audit(store, seen, reported(out))
    assert not any(r["record_id"] == "claims-complete" and passed(r) for r in read(store))
    monkeypatch.setenv("TESTBED_RESULTS", str(results))
    capsys.readouterr()
    assert main(["records", "verify"]) == 1
    said = capsys.readouterr().out
    assert "with a field missing or of a type testbed never writes" in said and "Traceback" not in said
    for fmt in ("jsonl", "json", "csv"):
        assert main(["records", "export", "--format", fmt]) == 0
    assert main(["records", "rm", "--where", "verdict=fail", "--dry-run"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    still_works(results, tmp_path, monkeypatch, capsys)


def test_hostile_file_names_through_the_host_transport(local_device, tmp_path):
    for i, name in enumerate(HOSTILE):
        src = tmp_path / "src"
        src.write_bytes(os.urandom(4096) + name.encode())
        local_device.push(src, f"hostile/{name.replace('/', '_')}")
        local_device.pull(f"hostile/{name.replace('/', '_')}", tmp_path / "back")
        assert (tmp_path / "back").read_bytes() == src.read_bytes()
        COUNTS["faults"] += 1
    assert local_device.run(["ls", "pwned"]).returncode != 0
    local_device.run(["rm", "-rf", "hostile"])


# --- a torn store --------------------------------------------------------------------------------


def tear(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncate":  # power loss: the file ends at a random byte of its last third
        path.write_bytes(data[: RNG.randrange(2 * len(data) // 3, len(data))])
    elif how == "nul-padding":
        path.write_bytes(data + b"\0" * RNG.randrange(1, 8192))
    elif how == "torn-line":
        line = data.splitlines(keepends=True)[-3]
        path.write_bytes(data + line[: RNG.randrange(1, len(line) - 1)])
    elif how == "not-utf8":
        path.write_bytes(data + b'{"record_id": "\xff\xfe", "verdict": "pass"}\n')
    elif how == "not-an-object":
        path.write_bytes(data + b'["pass", "pass"]\n')
    elif how == "newer-schema":
        path.write_bytes(data + b'{"schema": 99, "record_id": "future", "verdict": "pass"}\n')


@pytest.mark.parametrize("how", ["truncate", "nul-padding", "torn-line", "not-utf8", "not-an-object", "newer-schema"])
def test_a_torn_store_keeps_what_it_can_and_takes_new_runs(how, tmp_path, monkeypatch, capsys):
    results = tmp_path / "results"
    store = ResultsStore(results)
    for chunk in (16, 32):
        proc = start([*ORACLE_RUN, f"chunk={chunk}"], results)
        proc.communicate(timeout=DEADLINE_S)
    before = stored_ids(store)
    tear(store.path, how)
    COUNTS["faults"] += 1
    survivors = stored_ids(store)
    if how != "truncate":
        assert survivors == before  # damage after the last batch costs nothing stored
    proc = start([*ORACLE_RUN, "chunk=64"], results)
    out, err = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 0, err
    audit(store, survivors, reported(out))
    still_works(results, tmp_path, monkeypatch, capsys)


# --- the counts ----------------------------------------------------------------------------------


def test_campaign_counts():
    """Last in the file: what the campaign did (run the file whole, with -s, to read it)."""
    print(f"\nfault campaign (seed {SEED}): {COUNTS['faults']} faults injected, {COUNTS['stored_seen']} stored "
          f"records watched, {COUNTS['lost']} records lost, {COUNTS['false_passes']} false passes")
    assert COUNTS["lost"] == 0 and COUNTS["false_passes"] == 0
