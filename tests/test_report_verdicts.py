"""The report read at a glance and as data (issue 14, items 9-12): a verdict banner per device, no
table or plot that mixes backends, bit-exact passes said in words, legends off the data, history by
commit and night, provenance folded, and `testbed table` formats that are data.

Records come from real runs on the host (testbed.cli.main, written by the real results store). What a
device's night looked like (a failing verdict, a loaded machine, an old run) is planted by copying a
real run's records under another device name, changed the way such a night would change them, and
appended through testbed.results.ResultsStore. The page is read back with html.parser, as a browser
would read its text; what must be shown is computed here from the records, not copied from the code.
"""

from __future__ import annotations

import copy
import csv
import datetime as dt
import io
import json
import math
import uuid
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest

from testbed.cli import main
from testbed.measure import history
from testbed.report import build as report, plots
from testbed.results import ResultsStore
from tests.store_support import as_runs
from tests.test_report import FIXTURES

GDN_RUN = ["run", "gdn", "matrix=awkward", "bench.tokens=[64]", "bench.heads=4", "bench.head_size=32", "bench.reps=3"]
HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>$\\frac{$'  # markup, and mathtext for the plots


class Page(HTMLParser):
    """What a reader sees on the page: the banner's lines by colour, the tables' cell texts, every tag
    that was opened (so markup smuggled in through a name shows up as a tag), the folded details."""

    def __init__(self, html: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.verdicts: list[tuple[str, str]] = []  # (colour, text)
        self.tables: list[dict] = []
        self.details: list[dict] = []
        self._verdict: list[str] | None = None
        self._cell: list[str] | None = None
        self._caption: list[str] | None = None
        self._summary: list[str] | None = None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        classes = (attrs.get("class") or "").split()
        if tag == "p" and "verdict" in classes:
            self._verdict = [next(c for c in classes if c != "verdict")]
        elif tag == "table":
            self.tables.append({"caption": "", "rows": []})
        elif tag == "caption":
            self._caption = []
        elif tag == "tr":
            self.tables[-1]["rows"].append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "details":
            self.details.append({"open": "open" in attrs, "summary": ""})
        elif tag == "summary":
            self._summary = []

    def handle_endtag(self, tag):
        if tag == "p" and self._verdict is not None:
            self.verdicts.append((self._verdict[0], "".join(self._verdict[1:])))
            self._verdict = None
        elif tag == "caption":
            self.tables[-1]["caption"] = "".join(self._caption)
            self._caption = None
        elif tag in ("td", "th"):
            self.tables[-1]["rows"][-1].append("".join(self._cell))
            self._cell = None
        elif tag == "summary":
            self.details[-1]["summary"] = "".join(self._summary)
            self._summary = None

    def handle_data(self, data):
        for part in (self._verdict, self._cell, self._caption, self._summary):
            if part is not None:
                part.append(data)

    def table(self, caption_start: str) -> list[dict]:
        """The rows of the first table whose caption starts so, as {header: text}."""
        found = next(t for t in self.tables if t["caption"].startswith(caption_start))
        header, *rows = found["rows"]
        return [dict(zip(header, row)) for row in rows]


def copy_run(records: list[dict], device: str, change=lambda r: r, days_ago: float = 0) -> list[dict]:
    """The run's records as a run of `device` (started `days_ago` days earlier), each through `change`, of
    a commit of its own (as a nightly's HEAD moves: a step over runs of one commit is the machine's)."""
    run_id = uuid.uuid4().hex[:12]
    out = []
    for r in records:
        r = change(copy.deepcopy(r))
        started = dt.datetime.fromisoformat(r["started"]) - dt.timedelta(days=days_ago)
        r.update(device=device, run_id=run_id, record_id=uuid.uuid4().hex, started=started.isoformat(timespec="seconds"),
                 git_commit=(run_id * 4)[:40])
        out.append(r)
    return out


def quiet(record: dict) -> dict:
    record["host_load"] = {"cores": 2, "load_1m_before": 0.3, "load_1m_after": 0.4, "noisy": False}
    return record


def loaded(record: dict) -> dict:
    record["host_load"] = {"cores": 2, "load_1m_before": 7.5, "load_1m_after": 9.0, "noisy": True}
    return quiet(record) if record["kind"] == "oracle" else record


def store_of(tmp_path: Path, *runs: list[dict]) -> ResultsStore:
    store = ResultsStore(tmp_path / "results")
    for run in runs:
        store.append(as_runs(run))
    return store


def slower(factor: float):
    """A run whose bench took `factor` times as long, every repetition: times up, rates down. The machine
    probe (numpy's sgemm) is as fast as before: the code got slower, not the machine."""
    def change(record: dict) -> dict:
        for fig in record["figures"].values():
            if fig.get("role") == "machine_probe":
                continue
            scale = factor if fig["unit"] in ("s", "ms", "us") else 1 / factor if fig["unit"].endswith("/s") else 1
            fig.update(median=fig["median"] * scale, min=min(fig["min"] * scale, fig["max"] * scale),
                       max=max(fig["min"] * scale, fig["max"] * scale), samples=[x * scale for x in fig["samples"]])
        return quiet(record)
    return change


def build_from(store: ResultsStore, out: Path, nights=()) -> tuple[dict, Page]:
    content = report.build(store.records(), out, FIXTURES, report.settings(), list(nights))
    return content, Page((out / "report.html").read_text())


@pytest.fixture(scope="module")
def gdn_run(tmp_path_factory) -> list[dict]:
    """One real gdn run on the host: nmse and bitexact verdicts, bench figures with their samples."""
    root = tmp_path_factory.mktemp("gdn-run")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TESTBED_RESULTS", str(root))
        assert main(GDN_RUN) == 0
    return ResultsStore(root).records()


# --- item 9: the verdict banner -------------------------------------------------------------------


def test_banner_is_red_amber_or_green_per_device_with_its_reason(tmp_path, gdn_run):
    victim = next(r for r in gdn_run if r["oracle"] == "nmse")

    def broken(record):  # what check_nmse records when the error is 100x the threshold
        if record["record_id"] == victim["record_id"]:
            record.update(verdict="fail", margin=-2.0, detail="nmse 1e-05 > 1e-07")
        return quiet(record)

    store = ResultsStore(tmp_path / "results")
    store.append(as_runs(copy_run(gdn_run, "phone-failing", broken)))
    store.append(as_runs(copy_run(gdn_run, "phone-loaded", loaded)))
    store.append(as_runs(copy_run(gdn_run, "phone-clean", quiet)))
    store.append(as_runs(copy_run(gdn_run, "phone-old", quiet, days_ago=report.settings()["stale_after_days"] + 3)))
    killed = copy_run(gdn_run, "phone-killed", quiet)  # its run started and never ended: no verdict counts
    context = ("schema", "run_id", "started", "experiment", "device", "backend", "emulated", "host_load",
               "fingerprint", "config", "git_commit", "testbed_version", "time")  # what RunInfo.mark writes
    store.append([{**{k: killed[0][k] for k in context}, "run_mark": "started", "outcome": None}])
    store.append(killed)
    for i in range(8):  # six nights as measured, then two at a third of the speed: a regression
        store.append(as_runs(copy_run(gdn_run, "phone-slower", slower(3.0 if i >= 6 else 1.0), days_ago=(8 - i) / 8)))
    night = {"night": "n1", "suite": "s", "started": gdn_run[0]["started"], "tools": {},
             "devices": {"phone-clean": {"status": "ok", "reason": ""},
                         "phone-gone": {"status": "unreachable", "reason": "adb: no device 10.0.0.7:5555"}}}
    content, page = build_from(store, tmp_path / "report", [night])

    # the colour is the result: a loaded machine whose verdicts all pass is green (issue 33), the load a note
    expected = {"phone-failing": "red", "phone-loaded": "green", "phone-clean": "green", "phone-old": "amber",
                "phone-gone": "amber", "phone-slower": "amber", "phone-killed": "red"}
    assert {v["device"]: v["colour"] for v in content["summary"]["verdicts"]} == expected
    shown = {text.split(":")[0]: (colour, text) for colour, text in page.verdicts}
    assert {device: colour for device, (colour, _) in shown.items()} == expected
    # each reason names what decided the colour
    assert "1 of" in shown["phone-failing"][1] and victim["case"] in shown["phone-failing"][1] \
        and "nmse 1e-05 > 1e-07" in shown["phone-failing"][1]
    assert "measured under load 9.0 on 2 cores (noisy)" in shown["phone-loaded"][1]
    # the warning says what the load changed: nothing is left out of judging
    figures = sum(len(r["figures"]) for r in gdn_run if r["kind"] == "measure")
    assert f"{figures} figures of 1 run measured" in shown["phone-loaded"][1]
    assert "judged like the others (none left out)" in shown["phone-loaded"][1]
    assert "did not end complete" in shown["phone-killed"][1] or "never ended" in shown["phone-killed"][1]
    n = sum(r["kind"] == "oracle" for r in gdn_run)
    assert f"all {n} oracle verdicts pass" in shown["phone-clean"][1]
    assert "figures measured under load 0.4 on 2 cores (quiet)" in shown["phone-clean"][1]  # what quiet() planted
    assert "regression flag" in shown["phone-slower"][1] and "all" in shown["phone-slower"][1]
    assert "stale" in shown["phone-old"][1] and "unreachable (adb: no device" in shown["phone-gone"][1]
    # the banner comes before every section
    first_section = next(i for i, (tag, _) in enumerate(page.tags) if tag == "h2")
    assert all(i < first_section for i, (tag, attrs) in enumerate(page.tags) if "verdict" in (attrs.get("class") or ""))


def test_the_banner_says_the_load_its_records_carry_and_never_calls_a_noisy_machine_quiet(tmp_path, gdn_run):
    """The banner's words and its colour come from one reading of the records: a green line names the
    load the records carry, and a machine a record calls noisy is never called quiet (issue 26)."""
    def at_load_26(record):  # a night at load 26 on 2 cores, as runner.host_load records it
        record["host_load"] = {"cores": 2, "load_1m_before": 25.1, "load_1m_after": 26.0, "noisy": True}
        return record

    def unread(record):  # ingested output and records from before readings carry none
        record["host_load"] = {}
        return record

    oracles = [r for r in gdn_run if r["kind"] == "oracle"]
    emulated = [{**r, "emulated": True} for r in gdn_run]  # its times are listed apart, never judged
    store = store_of(tmp_path, copy_run(oracles, "phone-verdicts-at-26", at_load_26),
                     copy_run(emulated, "qemu-at-26", at_load_26), copy_run(gdn_run, "phone-unread", unread),
                     copy_run(gdn_run, "phone-quiet", quiet))
    content, page = build_from(store, tmp_path / "report")
    verdicts = {v["device"]: v for v in content["summary"]["verdicts"]}
    shown = {text.split(":")[0]: (colour, text) for colour, text in page.verdicts}
    assert {device: colour for device, (colour, _) in shown.items()} == {d: v["colour"] for d, v in verdicts.items()}
    for device, v in verdicts.items():
        noisy = any(r["host_load"].get("noisy") for r in store.records() if r["device"] == device)
        assert "quiet" not in v["reason"] or not noisy, v["reason"]
        assert "quiet" not in v["reason"] or "load 0.4 on 2 cores" in v["reason"], v["reason"]
    # verdicts alone at load 26: no figure to be noisy, and the banner says the load they were taken under
    assert verdicts["phone-verdicts-at-26"]["colour"] == "green"
    assert "no figures in its current runs" in verdicts["phone-verdicts-at-26"]["reason"]
    assert "load 26.0 on 2 cores (noisy" in verdicts["phone-verdicts-at-26"]["reason"]
    # an emulated device's figures are listed apart, yet measured at load 26: green (the load is no
    # result), and it says so
    assert verdicts["qemu-at-26"]["colour"] == "green"
    assert "measured under load 26.0 on 2 cores (noisy)" in verdicts["qemu-at-26"]["reason"]
    # no reading: nothing said of quiet, and that the records carry none
    assert verdicts["phone-unread"]["colour"] == "green"
    assert "no load reading" in verdicts["phone-unread"]["reason"]
    assert verdicts["phone-quiet"]["colour"] == "green"
    assert "figures measured under load 0.4 on 2 cores (quiet)" in verdicts["phone-quiet"]["reason"]


def test_banner_escapes_hostile_device_and_backend_names(tmp_path, gdn_run):
    def hostile_backend(record):
        record["backend"] = record["config"]["backend"] = HOSTILE
        return quiet(record)

    store = store_of(tmp_path, copy_run(gdn_run, HOSTILE, hostile_backend, days_ago=1),
                     copy_run(gdn_run, HOSTILE, hostile_backend))  # two runs: a history plot names them too
    content, page = build_from(store, tmp_path / "report")
    assert [v["device"] for v in content["summary"]["verdicts"]] == [HOSTILE]
    assert any(img["file"].startswith("history-") for s in content["sections"] for img in s["images"])
    (colour, text), = page.verdicts
    assert colour == "green" and text.startswith(HOSTILE + ": green")  # shown as text, whole
    assert not [tag for tag, attrs in page.tags if tag == "script" or (tag == "img" and attrs.get("src") == "x")]
    md = (tmp_path / "report" / "report.md").read_text()
    assert "<script" not in md and "&lt;script&gt;" in md


# --- item 10: never mix implementations -----------------------------------------------------------


@pytest.fixture(scope="module")
def two_backends(tmp_path_factory) -> Path:
    """chunk_prefill on the host with two backends: refimpl at C=16, native (the C engine) at C=32
    and 64, the issue's own example; each run twice, so each has a history."""
    root = tmp_path_factory.mktemp("two-backends")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TESTBED_RESULTS", str(root))
        for _ in range(2):
            for overrides in (["backend=refimpl", "chunk=16"], ["backend=native", "chunk=32"],
                              ["backend=native", "chunk=64"]):
                assert main(["run", "chunk_prefill", "mode=bench", *overrides]) == 0
    return root


def projected_best(records: list[dict]) -> int:
    """The C of least mean latency over the run's utterances: ceil(n / C) calls of the chunk call."""
    calls = {r["params"]["chunk"]: r["figures"]["time"]["median"] for r in records
             if r["params"].get("form") == "chunk_call"}
    lengths = records[0]["config"]["latency.utterance_tokens"]
    return min(calls, key=lambda c: sum(math.ceil(n / c) * calls[c] for n in lengths))


def test_chunk_choice_and_history_never_mix_backends(tmp_path, two_backends, monkeypatch):
    records = ResultsStore(two_backends).records()
    latest = history.latest_runs(records)
    current = [r for r in records if r["run_id"] in latest and r["kind"] == "measure"]

    drawn = []  # every plot's legend, x labels and where the legend sits against the plotted area
    real_save = plots._save

    def save(fig, out, name):
        ax = fig.axes[0]
        renderer = fig.canvas.get_renderer()
        legend = ax.get_legend()
        drawn.append({"name": name, "title": ax.get_title(), "labels": [t.get_text() for t in legend.get_texts()],
                      "ticks": [t.get_text() for t in ax.get_xticklabels()],
                      "legend": legend.get_window_extent(renderer), "axes": ax.get_window_extent(renderer)})
        return real_save(fig, out, name)

    monkeypatch.setattr(plots, "_save", save)
    content, _ = build_from(ResultsStore(two_backends), tmp_path / "report")
    chunk = next(s for s in content["sections"] if s["id"] == "chunk")
    ours = [t for t in chunk["tables"] if t["caption"].startswith("host / ")]
    assert len(ours) == 2
    for backend, chunks in (("refimpl", {16}), ("native", {32, 64})):
        (table,) = [t for t in ours if t["caption"].startswith(f"host / {backend} / tiny, past ")]
        assert {row["C"] for row in table["rows"]} - {"token by token"} == chunks  # only this backend's calls
        mine = [r for r in current if r["config"]["backend"] == backend]
        if len(chunks) > 1:  # the best (or, undecided, the best by median) among this backend's C alone
            (best,) = [row["C"] for row in table["rows"]
                       if row["choice"].startswith(("<- best", "undecided: best by median"))]
            assert best == projected_best(mine)

    # one history plot per backend, each series named by case, figure and setting (no config hash)
    hashes = {history.config_key(r) for r in records}
    history_plots = [d for d in drawn if d["name"].startswith("history-")]
    assert sorted(d["title"].split(" on ")[1].split(":")[0] for d in history_plots) == \
        ["host / native / tiny", "host / refimpl / tiny"]
    for d in history_plots:
        assert d["labels"] and not any(h in label for h in hashes for label in d["labels"])
    native = next(d for d in history_plots if "native" in d["title"])
    assert {label.split()[-1] for label in native["labels"]} == {"chunk=32", "chunk=64"}
    # x: the runs in order, each its short commit over its night
    runs = list(dict.fromkeys(r["run_id"] for r in history.by_run_time(
        [r for r in records if r["config"]["backend"] == "native" and r["kind"] == "measure"])))
    first = {r["run_id"]: r for r in reversed(records)}
    assert native["ticks"] == [f"{first[run]['git_commit'][:7]}{'+' if first[run]['git_commit'].endswith('-dirty') else ''}"
                               f"\n{first[run]['started'][:10]}" for run in runs]
    # every legend right of the plotted area, none over the data
    assert drawn and all(d["legend"].x0 >= d["axes"].x1 for d in drawn)
    assert len(drawn) == len([img for s in content["sections"] for img in s["images"]])


def test_gdn_table_per_backend_with_numbers_as_numbers(tmp_path, gdn_run):
    native = copy_run(gdn_run, "host", lambda r: {**r, "config": {**r["config"], "backend": "native"}})
    content, page = build_from(store_of(tmp_path, gdn_run, native), tmp_path / "report")
    gdn = next(s for s in content["sections"] if s["id"] == "gdn")
    assert sorted(t["caption"] for t in gdn["tables"]) == ["host / native / 4 heads x 32",
                                                           "host / refimpl / 4 heads x 32"]
    bench = [r for r in gdn_run if r["kind"] == "measure" and "form" in r["params"]]  # not the machine probe
    for table in gdn["tables"]:
        assert len(table["rows"]) == len(bench)  # each shape once per backend, not once per record stored
        for row in table["rows"]:
            assert all(isinstance(row[c], float) for c in ("ms", "min ms", "max ms", "tokens/s", "GFLOP/s"))
            assert isinstance(row["reps"], int) and row["min ms"] <= row["ms"] <= row["max ms"]
    # the page's table says it per backend too: no gdn row without its backend in the caption
    assert {t["caption"] for t in page.tables if "4 heads x 32" in t["caption"]} == \
        {"host / native / 4 heads x 32", "host / refimpl / 4 heads x 32"}


# --- item 11: bit-exact, provenance folded ---------------------------------------------------------


def test_bit_exact_passes_read_bit_exact_and_a_near_miss_does_not(tmp_path, gdn_run):
    content, page = build_from(store_of(tmp_path, gdn_run), tmp_path / "report")
    (row,) = page.table("device x backend x model")
    n_exact = sum(r["oracle"] == "bitexact" for r in gdn_run)
    assert row["gdn:bitexact"] == f"{n_exact} pass, bit-exact"
    assert "margin" in row["gdn:nmse"] and "bit-exact" not in row["gdn:nmse"]
    (data,) = next(s for s in content["sections"] if s["id"] == "oracles")["tables"][0]["rows"]
    assert data["gdn:bitexact"]["bit_exact"] is True and data["gdn:nmse"]["bit_exact"] is False

    victim = next(r for r in gdn_run if r["oracle"] == "bitexact")

    def one_value_differs(record):  # what check_bitexact records when one output value differs
        if record["record_id"] == victim["record_id"]:
            record.update(verdict="fail", margin=-1.0, detail="out: 1 values differ")
        return record

    later = copy_run(gdn_run, "host", one_value_differs, days_ago=-1)
    content, page = build_from(store_of(tmp_path / "again", gdn_run, later), tmp_path / "report")
    (row,) = page.table("device x backend x model")
    assert row["gdn:bitexact"] == f"{n_exact - 1} pass, 1 fail, margin -1"


def test_provenance_is_one_closed_line_per_run(tmp_path, gdn_run):
    second = copy_run(gdn_run, "phone", quiet)
    content, page = build_from(store_of(tmp_path, gdn_run, second), tmp_path / "report")
    runs = {r["run_id"]: r for r in gdn_run + second}
    run_lines = [d for d in page.details if " run " in d["summary"]]
    assert len(run_lines) == len(runs) and not any(d["open"] for d in page.details)
    for run_id, r in runs.items():
        (line,) = [d["summary"] for d in run_lines if f"run {run_id}" in d["summary"]]
        assert r["git_commit"][:10] in line and r["device"] in line and "\n" not in line
    provenance = next(s for s in content["sections"] if s["id"] == "provenance")
    assert provenance["tables"] == []  # no config JSON in table cells any more
    configs = [d["data"] for d in provenance["details"] if " run " in d["summary"]]
    assert all(c["bench.heads"] == 4 for c in configs)  # the config as data, not a rendered string


# --- item 12: tables as data ----------------------------------------------------------------------


def test_table_formats_keep_numbers_and_samples(results_dir, capsys, gdn_run):
    ResultsStore(results_dir).append(gdn_run)
    bench = {r["case"]: r for r in gdn_run if r["kind"] == "measure" and "form" in r["params"]}  # not the probe

    assert main(["table", "gdn", "--format", "json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out)["rows"] if r["case"] in bench]
    assert len(rows) == len(bench)
    for row in rows:
        stored = bench[row["case"]]["figures"]
        assert isinstance(row["ms"], float) and isinstance(row["tokens_per_s"], float)
        assert row["samples"]["time"] == stored["time"]["samples"] and len(row["samples"]["time"]) == 3
        assert min(row["samples"]["time"]) == stored["time"]["min"] and row["ms"] == stored["time"]["median"]

    assert main(["table", "gdn", "--format", "jsonl"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert all(isinstance(line["samples"]["tokens_per_s"], list) for line in lines if line["case"] in bench)

    assert main(["table", "gdn", "--format", "csv"]) == 0
    table = pd.read_csv(io.StringIO(capsys.readouterr().out), comment="#")
    assert "samples" not in table and table.loc[table["case"].isin(bench), "ms"].dtype == float


def test_breakeven_is_its_own_object(results_dir, capsys, seed_fixtures):
    assert main(["run", "tail", "mode=fixture"]) == 0
    capsys.readouterr()
    sweep = pd.read_csv(seed_fixtures / "tail_sweep_m4pro_gemma4_e2b.csv", comment="#")
    # the smallest tail from which padding is faster (by 1% or more) at that tail and every larger one
    wins = (sweep.padded_tps / sweep.scalar_tps - 1) * 100 >= 1
    tails = sweep["tail"]
    expected = min(t for t in tails[tails > 0] if wins[tails >= t].all())

    assert main(["table", "tail", "--format", "json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert all(isinstance(row["N"], int) for row in table["rows"]) and len(table["rows"]) == len(sweep)
    (found,) = table["breakevens"]
    assert (found["tail"], found["threshold"]) == (expected, expected - 1)
    assert found["source"].startswith("fixture:")

    assert main(["table", "tail", "--format", "csv"]) == 0
    out, err = capsys.readouterr()
    rows = list(csv.DictReader(out.splitlines()))  # rows alone: the breakeven is said on stderr
    assert [int(r["N"]) for r in rows] == list(sweep.prompt_tokens)
    assert f"breakeven ({found['source']}): padded from tail {expected}" in err

    assert main(["table", "tail", "--format", "jsonl"]) == 0
    *row_lines, last = capsys.readouterr().out.splitlines()
    assert json.loads(last) == {"breakeven": found} and all("breakeven" not in json.loads(x) for x in row_lines)
