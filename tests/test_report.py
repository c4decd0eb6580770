"""The report, built from records of real host runs plus the seeds' fixtures loaded as records.

History is built the way nights build it: real runs appended to a store, then later "nights" made by
copying a real run's records with a new run id and start time, changed the way a real regression or
real noise would change them. What must be flagged is computed here from the planted change, not
copied from the code under test.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import math
import re
import shutil
import subprocess
import uuid
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from testbed import config, runner
from testbed.cli import main
from testbed.measure import history, seed
from testbed.report import build as report
from testbed.report import plots
from testbed.results import ResultsStore
from tests.store_support import as_runs

FIXTURES = seed.fixtures_dir(config.load([]).cfg.fixtures_dir)
HOST_RUN = ["mode=all", "matrix=awkward", "bench.tokens=[64]", "bench.heads=4", "bench.head_size=64",
            "bench.reps=5"]


@pytest.fixture(scope="session")
def host_records(tmp_path_factory) -> list[dict]:
    """One real gdn run on the host: oracle verdicts and bench figures with their repetitions."""
    root = tmp_path_factory.mktemp("host-run")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TESTBED_RESULTS", str(root))  # it wins over results_dir, whatever the caller's is
        runner.execute(config.load(HOST_RUN, experiment="gdn"))
    records = ResultsStore(root).records()
    assert {r["kind"] for r in records} == {"oracle", "measure"}
    return records


@pytest.fixture(scope="session")
def tail_records(tmp_path_factory) -> list[dict]:
    """A real tail measurement on the host at tail 10, the seed's sweep loaded as records by the
    tail experiment (mode=fixture), and real chunk_prefill timings at C = 16 and 32."""
    root = tmp_path_factory.mktemp("tail-runs")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TESTBED_RESULTS", str(root))
        for experiment, overrides in (("tail", ["tail=10", "reps=2", "warmup=0"]), ("tail", ["mode=fixture"]),
                                      ("chunk_prefill", ["mode=bench", "chunk=16"]),
                                      ("chunk_prefill", ["mode=bench", "chunk=32"])):
            runner.execute(config.load(overrides, experiment=experiment))
    return ResultsStore(root).records()


def later_night(records: list[dict], days: int, change=lambda r: r) -> list[dict]:
    """The same run's records as a run `days` later, each passed through `change`, of a commit of its own
    (as a nightly's HEAD moves: a step over runs of one commit is the machine's, testbed.measure.history)."""
    run_id = uuid.uuid4().hex[:12]
    out = []
    for r in records:
        r = change(copy.deepcopy(r))
        when = dt.datetime.fromisoformat(r["started"]) + dt.timedelta(days=days)
        r.update(run_id=run_id, record_id=uuid.uuid4().hex, started=when.isoformat(timespec="seconds"),
                 git_commit=(run_id * 4)[:40])
        out.append(r)
    return out


def scale_time(record: dict, factor: float, case: str) -> dict:
    """The case's bench got `factor` times slower: every rep's time up, every rate down."""
    if record["case"] != case:
        return record
    for name, fig in record["figures"].items():
        if fig["unit"] == "ms":
            fig.update(median=fig["median"] * factor, min=fig["min"] * factor, max=fig["max"] * factor)
        elif fig["unit"].endswith("/s") and name != "sgemm":
            fig.update(median=fig["median"] / factor, min=fig["min"] / factor, max=fig["max"] / factor)
    return record


def within_spread(record: dict) -> dict:
    """Noise: a night whose median is the worst repetition seen the night before, same spread."""
    for fig in record["figures"].values():
        fig["median"] = fig["max"] if fig["unit"] in ("ms", "s") else fig["min"]
    return record


def build(tmp_path: Path, records: list[dict]) -> dict:
    out = tmp_path / "report"
    return report.build(records, out, FIXTURES, report.settings())


def bench_case(records, form="chunkwise") -> str:
    return next(r["case"] for r in records if r["kind"] == "measure" and r["params"]["form"] == form)


def seed_records(tmp_path: Path) -> list[dict]:
    store = ResultsStore(tmp_path / "seed")
    seed.store_records(store, FIXTURES)
    return store.records()


# --- content ---------------------------------------------------------------------------------------


def column(table: dict, name: str) -> list:
    return [row[name] for row in table["rows"]]


def breakeven_of(content: dict, device: str, source: str) -> int | None:
    (found,) = [b["tail"] for b in content["breakevens"] if (b["device"], b["source"]) == (device, source)]
    return found


def best_by_median(table: dict):
    """The C a chunk-choice table marks best (decided) or best by median (undecided)."""
    (best,) = [row["C"] for row in table["rows"] if row["choice"].startswith(("<- best", "undecided: best by median"))]
    return best


def test_report_tables_from_host_runs_and_seed(tmp_path, host_records, tail_records):
    records = host_records + tail_records + seed_records(tmp_path)
    content = build(tmp_path, records)
    sections = {s["id"]: s for s in content["sections"]}

    # the tail sweep: the seed's numbers give a breakeven of 10 (tail 8 scalar wins, tail 10 padded)
    fixture_source = f"fixture:{seed.TAIL_SWEEP}"
    assert breakeven_of(content, "host", fixture_source) == 10
    seed_table = next(t for t in sections["tail"]["tables"] if Path(seed.TAIL_SWEEP).stem in t["caption"])
    # the decision with its confidence: the seed's medians alone pin it only to the grid, never at 95%
    assert "breakeven tail between 8 and 10 (medians only" in seed_table["caption"]
    assert "no confidence" in seed_table["caption"] and seed_table["caption"].endswith("(seed: 10)")
    sweep = pd.read_csv(FIXTURES / seed.TAIL_SWEEP, comment="#")
    assert column(seed_table, "tail") == list(sweep["tail"])
    for winner, p, s in zip(column(seed_table, "winner"), sweep.padded_tps, sweep.scalar_tps):
        assert winner == "tie" or winner.split()[0] == ("padded" if p > s else "scalar")
    # the host's own measurement at tail 10, with the seed's figures at the same tail beside it
    measured = next(t for t in sections["tail"]["tables"] if t is not seed_table)
    assert column(measured, "tail") == [10] and len(sections["tail"]["tables"]) == 2
    at_10 = sweep.set_index("tail").loc[10]
    assert [column(measured, "seed padded tok/s")[0], column(measured, "seed scalar tok/s")[0]] == \
        [at_10.padded_tps, at_10.scalar_tps]

    # the chunk-size choice on the Mali: one 64-call per 36..52-token utterance beats two 32-calls
    calls = pd.read_csv(FIXTURES / seed.CHUNK_PREFILL, comment="#").dropna()
    mali = calls[calls.target == "mali-vulkan-valhall4"].set_index("chunk").chunk_call_s
    lengths = report.settings()["utterance_lengths"]
    projected = {c: sum(math.ceil(n / c) * mali[c] for n in lengths) / len(lengths) for c in mali.index}
    table = next(t for t in sections["chunk"]["tables"] if t["caption"].startswith("mali"))
    assert table["caption"] == \
        f"mali-vulkan-valhall4 / seed / {seed.SEED_MODEL}: utterances of {lengths} tokens, reply 0"
    marks = {row["C"]: row["choice"] for row in table["rows"]}
    # the seed's figures are medians, one value each: the least projected C is the best by median, and
    # nothing is decided (never a bare "<- best")
    assert marks.pop(min(projected, key=projected.get)) == "undecided: best by median"
    best = min(projected, key=projected.get)
    assert set(marks.values()) <= {"undecided: not distinguishable", f"undecided against C={best}"}, marks

    # the host's own chunk calls: the C of least mean projected latency over its run's utterance lengths
    host_table = next(t for t in sections["chunk"]["tables"] if t["caption"].startswith("host / refimpl / tiny, past "))
    timed = {r["params"]["chunk"]: r["figures"]["time"]["median"] for r in tail_records
             if r["experiment"] == "chunk_prefill" and r["params"].get("form") == "chunk_call"}
    run_lengths = next(r["config"]["latency.utterance_tokens"] for r in tail_records if r["experiment"] == "chunk_prefill")
    mean = {c: sum(math.ceil(n / c) * t for n in run_lengths) / len(run_lengths) for c, t in timed.items()}
    assert column(host_table, "C") == [16, 32, "token by token"]
    assert best_by_median(host_table) == min(mean, key=mean.get)

    # the oracle matrix: one cell per device, backend and oracle, counts as in the store
    matrix = sections["oracles"]["tables"][0]
    host = next(row for row in matrix["rows"] if row["device"] == "host" and row["gdn:nmse"])
    ids = {r["record_id"] for r in host_records}
    for oracle in ("nmse", "bitexact"):
        n = sum(r["oracle"] == oracle for r in host_records if r["kind"] == "oracle")
        cell = host[f"gdn:{oracle}"]
        assert (cell["passed"], cell["total"]) == (n, n) and cell["worst_record"] in ids
    assert any(row["device"] == "mali-vulkan-valhall4" for row in matrix["rows"])

    # GDN throughput: one row per bench record; no ratio over sgemm from the run's between-repetition wall
    # clock (issue 35: "of sgemm 1.3-8.2" on a loaded night), though the records carry one
    (gdn,) = sections["gdn"]["tables"]  # one run: one device, backend and model
    measures = [r for r in host_records if r["kind"] == "measure" and "form" in r["params"]]  # not the probe
    assert gdn["caption"] == "host / refimpl / 4 heads x 64" and len(gdn["rows"]) == len(measures)
    assert all(r["metrics"]["sgemm_fraction"] for r in measures)
    assert not [c for c in gdn["columns"] if "sgemm" in c]
    assert any("measured interleaved" in line for line in sections["gdn"]["lines"])

    # the same content for people (Markdown) and the page's images beside it
    md = (tmp_path / "report" / "report.md").read_text()
    assert "breakeven tail between 8 and 10 (medians only" in md and "| host | refimpl |" in md
    for section in content["sections"]:
        for image in section["images"]:
            assert (tmp_path / "report" / image["file"]).stat().st_size > 1000
    assert breakeven_of(json.loads((tmp_path / "report" / "report.json").read_text()), "host", fixture_source) == 10


def seed_sweep_records(tmp_path: Path) -> list[dict]:
    """The seed's M4 Pro tail sweep (140-440 tok/s) loaded as records by the tail experiment (mode=fixture)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TESTBED_RESULTS", str(tmp_path / "seed-sweep"))
        runner.execute(config.load(["mode=fixture"], experiment="tail"))
    return ResultsStore(tmp_path / "seed-sweep").records()


def slower_host_sweep(records: list[dict], factors: dict[str, float], backend: str = "native") -> list[dict]:
    """The seed's sweep as a bench run of the host, each mode `factors[mode]` times as fast (the issue's
    host: 15-50 tok/s), labelled as the tail experiment labels its bench runs (tail.source_label, the
    reference model's shape)."""
    shape = {"shape.layers": 6, "shape.hidden": 512, "shape.window": 512}
    source = f"host/{backend} h512x6 w512 C=128 float32 sink=0"
    run_id = uuid.uuid4().hex[:12]
    out = []
    for r in copy.deepcopy(records):
        if r["kind"] == "measure":
            factor = factors[r["params"]["mode"]]
            for fig in r["figures"].values():
                scale = factor if fig["unit"].endswith("/s") else 1 / factor
                fig.update(median=fig["median"] * scale, min=fig["min"] * scale, max=fig["max"] * scale)
            r["params"]["source"] = source
        r["config"] = {**{k: v for k, v in r["config"].items() if k != "fixture"}, **shape, "mode": "bench",
                       "backend": backend}
        r.update(run_id=run_id, record_id=uuid.uuid4().hex, backend=backend)
        out.append(r)
    return out


def test_tail_plot_shows_each_breakeven_on_a_log_axis_under_a_title_said_once(tmp_path, monkeypatch):
    """A host at 15-50 tok/s beside the seed's 140-440: on one linear axis the host's curves lay flat
    under the seed's; the throughput axis is logarithmic, each breakeven marked on its own pair, and the
    title names device, backend and model once (it named them twice: label and source side by side)."""
    seeds = seed_sweep_records(tmp_path)
    factors = {"padded": 0.11, "scalar": 0.10}  # padding gains on the host: its breakeven comes earlier
    host = slower_host_sweep(seeds, factors)
    tps = [r["figures"]["tokens_per_s"]["median"] for r in host if r["kind"] == "measure"]
    assert 13 < min(tps) and max(tps) < 50  # the two scales of the issue
    drawn = {}
    real_save = plots._save

    def save(fig, out, name):
        drawn[name] = fig.axes
        return real_save(fig, out, name)

    monkeypatch.setattr(plots, "_save", save)
    content = build(tmp_path, seeds + host)
    images = [img for s in content["sections"] if s["id"] == "tail" for img in s["images"]]
    assert len(images) == 2 and set(drawn) == {img["file"] for img in images}
    for img in images:
        for ax in drawn[img["file"]]:
            title = ax.get_title()
            assert ax.get_yscale() == "log", title
            words = re.findall(r"[A-Za-z_]\w*", title)  # "host/native" and "host / native" alike
            assert len(words) == len(set(words)), title
            assert title.count("512") <= 2 and "h512x6" not in title  # the shape said once
        assert (tmp_path / "report" / img["file"]).stat().st_size > 1000
    # each breakeven marked on its pair: a star on the padded curve at its tail, the host's and the seed's
    host_ax, = drawn[next(img["file"] for img in images if "native" in img["file"])]
    sweep = pd.read_csv(FIXTURES / seed.TAIL_SWEEP, comment="#").set_index("tail").padded_tps
    tail = next(b["tail"] for b in content["breakevens"] if b["backend"] == "native")
    seed_tail = next(b["tail"] for b in content["breakevens"] if b["source"].startswith("fixture:"))
    stars = sorted((line.get_xdata()[0], line.get_ydata()[0]) for line in host_ax.get_lines()
                   if line.get_marker() == "*")
    assert tail != seed_tail and stars == sorted([(tail, pytest.approx(factors["padded"] * sweep[tail])),
                                                  (seed_tail, pytest.approx(sweep[seed_tail]))], key=lambda s: s[0])
    # the host's curves span their own decade, not a sliver of the seed's linear range
    low, high = host_ax.get_ylim()
    assert high / low < 100


def jittered_nights(records: list[dict], first_day: int, factors: list[float], case: str) -> list[list[dict]]:
    """One later night per factor, the case's bench that many times slower (a night's noise, or a step)."""
    return [later_night(records, first_day + i, lambda r, f=f: scale_time(r, f, case)) for i, f in enumerate(factors)]


def test_planted_regression_flagged_once_and_noise_not(tmp_path, host_records):
    case = bench_case(host_records)
    jitter = np.random.default_rng(0).lognormal(0.0, 0.03, 8)  # how much a night moves on a quiet machine
    noise = [r for night in jittered_nights(host_records, 1, list(jitter[:6]), case) for r in night]
    assert build(tmp_path, host_records + noise)["flags"] == []

    # two nights 30% slower: one measured quantity per timing is flagged, the rates gdn computes from the
    # wall time named beside it
    slow = jittered_nights(host_records, 7, list(1.3 * jitter[6:]), case)
    flags = build(tmp_path, host_records + noise + slow[0] + slow[1])["flags"]
    timings = [name for name, fig in next(r for r in host_records if r["case"] == case)["figures"].items()
               if fig["unit"] == "ms"]  # the wall time, and the CPU time where the backend measures it
    assert sorted(f["what"] for f in flags) == sorted(timings) and {f["case"] for f in flags} == {case}
    time_flag = next(f for f in flags if f["what"] == "time")
    assert sorted(time_flag["derived"]) == ["gflops", "gflops_form", "tokens_per_s"]
    assert time_flag["since"] == slow[0][0]["started"]  # the new level began with the first slow night

    def medians(records):
        return [r["figures"]["time"]["median"] for r in records if r["case"] == case]

    change = np.median(medians(slow[0] + slow[1])) / np.median(medians(host_records + noise)) - 1
    assert time_flag["change"] == f"{change:+.1%}"
    md = (tmp_path / "report" / "report.md").read_text()
    assert time_flag["change"] in md and slow[0][0]["started"] in md
    assert f"time (and {', '.join(time_flag['derived'])})" in md


def test_a_history_too_short_to_judge_says_so(tmp_path, host_records):
    content = build(tmp_path, host_records + later_night(host_records, 1))
    section = next(s for s in content["sections"] if s["id"] == "regressions")
    assert content["flags"] == [] and any(line.startswith("Not judged yet: ") and
                                          f"1 earlier runs, {report.settings()['min_history']} needed" in line
                                          for line in section["lines"])


def test_noise_is_measured_not_a_fixed_percentage(host_records):
    """The same 8% slowdown is a regression for a steady figure and noise for a jittery one."""
    case = bench_case(host_records)
    for sigma, flagged in ((0.01, True), (0.06, False)):
        jitter = list(np.random.default_rng(1).lognormal(0.0, sigma, 11))
        nights = jittered_nights(host_records, 1, jitter[:8] + [1.08 * j for j in jitter[8:]], case)
        flags = history.figure_regressions([r for night in nights for r in night], history=30, min_history=5)
        assert ((case, "time") in {(f.case, f.what) for f in flags}) is flagged


def test_oracle_that_flips_to_fail_is_flagged(tmp_path, host_records):
    victim = next(r for r in host_records if r["oracle"] == "nmse")

    def broken(record):
        if record["case"] == victim["case"]:  # what check_nmse records when the error is 100x the threshold
            record.update(verdict="fail", margin=-2.0, detail="nmse 1e-05 > 1e-07")
        return record

    bad = later_night(host_records, 1, broken)
    content = build(tmp_path, host_records + bad)
    flips = [f for f in content["flags"] if f["kind"] == "oracle"]
    assert [(f["case"], f["change"], f["since"]) for f in flips] == [(victim["case"], "pass -> fail", bad[0]["started"])]
    matrix = next(s for s in content["sections"] if s["id"] == "oracles")["tables"][0]
    (host,) = [row for row in matrix["rows"] if row["device"] == "host"]
    cell = host["gdn:nmse"]
    n = sum(r["oracle"] == "nmse" for r in host_records)
    assert (cell["passed"], cell["total"]) == (n - 1, n)
    record_id = next(r["record_id"] for r in bad if r["case"] == victim["case"])
    assert cell["worst_record"] == record_id
    assert f'id="rec-{record_id[:12]}"' in (tmp_path / "report" / "report.html").read_text()


def test_report_command_since_and_bad_input(tmp_path, host_records, monkeypatch, capsys):
    store = ResultsStore(tmp_path / "results")
    store.append(as_runs(host_records + later_night(host_records, 30)))
    monkeypatch.setenv("TESTBED_RESULTS", str(store.root))
    out = tmp_path / "out"

    assert main(["report", "--since", "2000-13-01", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'2000-13-01'" in err and "YYYY-MM-DD" in err
    assert not out.exists()

    since = (dt.datetime.fromisoformat(host_records[0]["started"]) + dt.timedelta(days=1)).date().isoformat()
    assert main(["report", "--since", since, "--out", str(out)]) == 0
    content = json.loads((out / "report.json").read_text())
    assert content["records"] == len(host_records)  # the first run is before --since
    assert [p.name for p in out.glob(".*")] == [report.MARKER] and list(tmp_path.glob(".out.*")) == []  # nothing left staged


def test_a_report_that_fails_midway_leaves_the_previous_one(tmp_path, host_records, monkeypatch):
    build(tmp_path, host_records)
    before = (tmp_path / "report" / "report.json").read_text()

    def broken(inp, flags):  # a section that breaks is drawn as a notice (report.draw); the page's summary cannot be
        raise RuntimeError("the summary broke")

    monkeypatch.setattr(report, "summary", broken)
    with pytest.raises(RuntimeError):
        build(tmp_path, host_records + later_night(host_records, 1))
    assert (tmp_path / "report" / "report.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]


# --- the page in a browser -------------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Runs first in the page: records script errors and resources that fail to load, then, once the
# page has loaded, every image's natural size, into an element --dump-dom prints.
PROBE = """<script>
window.__errors = [];
window.addEventListener("error", e => window.__errors.push(e.message || ("failed to load " + (e.target.src || e.target.href))), true);
window.addEventListener("load", () => {
  const probe = document.createElement("pre");
  probe.id = "probe";
  probe.textContent = JSON.stringify({errors: window.__errors,
    images: [...document.images].map(i => [i.getAttribute("src"), i.naturalWidth, i.naturalHeight]),
    sections: [...document.querySelectorAll("h2")].map(h => h.textContent)});
  document.body.appendChild(probe);
});
</script>"""


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}"]
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium is not installed (scripts/bootstrap.sh --test)")
def test_page_renders_in_chromium_with_its_images(tmp_path, host_records, tail_records):
    records = host_records + later_night(host_records, 1, within_spread) + tail_records + seed_records(tmp_path)
    content = build(tmp_path, records)
    folder = tmp_path / "report"
    page = (folder / "report.html").read_text()
    probe = folder / "probe.html"  # beside the page, so its relative image paths resolve the same way
    probe.write_text(page.replace("<head>", "<head>\n" + PROBE, 1))

    dom = chromium("--virtual-time-budget=5000", "--dump-dom", probe.as_uri(), profile=tmp_path / "profile-1")
    assert dom.returncode == 0, dom.stderr[-2000:]
    found = json.loads(dom.stdout.split('<pre id="probe">', 1)[1].split("</pre>", 1)[0].replace("&quot;", '"'))
    assert found["errors"] == []
    expected = [img["file"] for s in content["sections"] for img in s["images"]]
    assert sorted(src for src, _, _ in found["images"]) == sorted(expected) and len(expected) >= 4
    assert all(w > 100 and h > 100 for _, w, h in found["images"]), found["images"]
    assert found["sections"] == [s["title"] for s in content["sections"]]

    shot = tmp_path / "report.png"
    chromium(f"--screenshot={shot}", "--window-size=1280,2400", "--hide-scrollbars", (folder / "report.html").as_uri(),
             profile=tmp_path / "profile-2")
    assert shot.stat().st_size > 20_000
    print(f"screenshot: {shot}")


# --- wide tables -------------------------------------------------------------------------------------

# Runs in the page once it has loaded: the window's width, the page's, and per table how far it reaches
# against the box it sits in (measured before the probe's own text is added).
WIDTH_PROBE = """<script>
window.addEventListener("load", () => {
  const tables = [...document.querySelectorAll("table")].map(t => ({
    caption: t.caption ? t.caption.textContent : "", right: t.getBoundingClientRect().right,
    box: t.parentElement.getBoundingClientRect().right, box_scroll: t.parentElement.scrollWidth,
    box_client: t.parentElement.clientWidth}));
  const found = {window: window.innerWidth, page: document.documentElement.scrollWidth, tables};
  const probe = document.createElement("pre");
  probe.id = "probe";
  probe.textContent = JSON.stringify(found);
  document.body.appendChild(probe);
});
</script>"""


def perf_report(tmp_path: Path) -> Path:
    """A report of ingested test-backend-ops perf rows, whose cases run to 90 characters without a space."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TESTBED_RESULTS", str(tmp_path / "store"))
        assert main(["ingest", str(FIXTURES / "test-backend-ops" / "perf_b_CPU.stdout")]) == 0
    records = ResultsStore(tmp_path / "store").records()
    assert max(len(r["case"]) for r in records) > 80
    build(tmp_path, records)
    return tmp_path / "report" / "report.html"


class TableBoxes(HTMLParser):
    """Each table's enclosing element (tag, classes), and the classes of its long cells."""

    def __init__(self, html: str):
        super().__init__()
        self.open: list[tuple[str, list[str]]] = []
        self.tables: list[dict] = []
        self.style = ""
        self._in_style = False
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if tag == "table":
            self.tables.append({"parent": self.open[-1], "cells": []})
        if tag == "td":
            self.tables[-1]["cells"].append([classes, ""])
        self._in_style = tag == "style"
        self.open.append((tag, classes))

    def handle_endtag(self, tag):
        while self.open and self.open.pop()[0] != tag:
            pass
        self._in_style = False

    def handle_data(self, data):
        if self._in_style:
            self.style += data
        elif self.open and self.open[-1][0] in ("td", "a") and self.tables and self.tables[-1]["cells"]:
            self.tables[-1]["cells"][-1][1] += data


def css_rule(style: str, selector: str) -> str:
    return re.search(re.escape(selector) + r"\s*\{([^}]*)\}", style).group(1)


def test_a_wide_table_sits_in_a_box_that_scrolls_and_its_long_cells_wrap(tmp_path):
    """The structure that keeps a table inside the page (issue 26): every table in a box that scrolls
    sideways rather than widen the page, and every long cell (an op's parameters) free to break."""
    page = TableBoxes(perf_report(tmp_path).read_text())
    assert page.tables
    for table in page.tables:
        tag, classes = table["parent"]
        assert tag == "div" and "table-box" in classes
        for cell_classes, text in table["cells"]:
            assert ("wrap" in cell_classes) == (len(text) > report.TEMPLATE_ENV.globals["long_cell"]), text
    box = css_rule(page.style, ".table-box")
    assert "overflow-x: auto" in box and "max-width: 100%" in box
    assert "overflow-wrap: anywhere" in css_rule(page.style, "td.wrap")


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium is not installed (scripts/bootstrap.sh --test)")
def test_other_measurements_fit_a_1400_pixel_window_in_chromium(tmp_path):
    html = perf_report(tmp_path)
    probe = html.with_name("probe.html")
    probe.write_text(html.read_text().replace("<head>", "<head>\n" + WIDTH_PROBE, 1))
    dom = chromium("--window-size=1400,900", "--virtual-time-budget=5000", "--dump-dom", probe.as_uri(),
                   profile=tmp_path / "profile")
    assert dom.returncode == 0, dom.stderr[-2000:]
    found = json.loads(dom.stdout.split('<pre id="probe">', 1)[1].split("</pre>", 1)[0].replace("&quot;", '"'))
    assert found["window"] == 1400 and found["page"] <= found["window"], found
    other = next(t for t in found["tables"] if t["caption"] == "measure records")
    # it fits its box as laid out: its cells wrapped, nothing left to scroll to
    assert other["right"] <= other["box"] + 1 and other["box_scroll"] <= other["box_client"], other
