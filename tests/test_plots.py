"""Every plotted figure shows its spread: medians with bars from the least to the greatest repetition
(issue 14, item 2), drawn from the records' own min and max."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pandas as pd  # noqa: E402
from matplotlib.container import ErrorbarContainer  # noqa: E402

from testbed.report import plots  # noqa: E402
from testbed.experiments import tail  # noqa: E402


def bar_extents(ax) -> list[tuple[float, float]]:
    """(low, high) of every error bar drawn on the axes."""
    out = []
    for container in ax.containers:
        if isinstance(container, ErrorbarContainer):
            for segments in container.lines[2]:
                out += [(float(seg[0][1]), float(seg[1][1])) for seg in segments.get_segments()]
    return out


def test_a_median_is_drawn_with_its_min_and_max():
    fig, ax = plots._pyplot().subplots()
    plots.with_spread(ax, [1, 2], [10.0, 20.0], [8.0, 19.0], [13.0, 26.0], label="x")
    assert sorted(bar_extents(ax)) == [(8.0, 13.0), (19.0, 26.0)]
    plots._pyplot().close(fig)


def test_without_a_spread_nothing_pretends_to_have_one():
    fig, ax = plots._pyplot().subplots()
    plots.with_spread(ax, [1, 2], [10.0, 20.0], label="x")
    assert bar_extents(ax) == [] and len(ax.lines) == 1
    plots._pyplot().close(fig)


def test_the_tail_sweep_carries_each_throughputs_min_and_max_to_its_plot_and_table(tmp_path, monkeypatch):
    rows = []
    for t, (lo, med, hi) in {4: (80.0, 90.0, 95.0), 8: (110.0, 120.0, 140.0), 16: (100.0, 125.0, 130.0)}.items():
        for mode, (a, b, c) in (("padded", (lo, med, hi)), ("scalar", (99.0, 100.0, 101.0))):
            rows.append({"kind": "measure", "time": "2026-01-01T00:00:00", "run_id": "r1", "params.source": "s",
                         "params.prompt_tokens": 128 + t, "params.tail": t, "params.mode": mode,
                         "figures.tokens_per_s.median": b, "figures.tokens_per_s.min": a,
                         "figures.tokens_per_s.max": c, "figures.ttft.median": 1e3 * (128 + t) / b})
    frame = tail.sweep_frame(pd.DataFrame(rows))
    assert frame.set_index("tail").loc[8, ["padded_tps_min", "padded_tps_max"]].tolist() == [110.0, 140.0]
    table = tail.breakeven.tail_table(frame).set_index("tail")
    assert table.loc[8, "padded spread %"] == round((140 - 110) / 120 * 100, 1)
    captured = {}
    real = plots.with_spread

    def spy(ax, xs, medians, lows=None, highs=None, **style):
        captured[style["label"]] = (lows, highs)
        real(ax, xs, medians, lows, highs, **style)

    monkeypatch.setattr(plots, "with_spread", spy)
    plots.tail_plot(tmp_path, "host", frame, 8, None, None)
    assert captured["padded"] == ([80.0, 110.0, 100.0], [95.0, 140.0, 130.0])
