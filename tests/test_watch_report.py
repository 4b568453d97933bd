"""The report's and the watch tools' pure parts (no Ray): the figures the summary gains
for report.html, the page itself, the dashboard flags, and Grafana's variable
substitution as tests/test_watch_run.py applies it."""
from __future__ import annotations

import re

import pyarrow as pa
import pytest

from pipeline.cli import parse_args
from pipeline.dashboard import dashboard_url, local_ray_options
from pipeline.report import Chart, contiguous, nice_axis, render_report
from pipeline.summary import block_stats, format_summary, summarize, tokens_over_time
from watch_tools import grafana_regex_escape, substitute


def rows(n_steps, finished, ranks, errors=None):
    n = len(n_steps)
    return pa.table({
        "error": errors or [None] * n, "latency_s": [0.5] * n, "num_blocks": [1] * n, "num_steps": n_steps,
        "num_generated_tokens": [10] * n, "finish_reason": ["stop"] * n, "finished_at": finished,
        "engine_rank": ranks, "sample_index": [0] * n, "generated_text": ["x"] * n})


def test_summary_counts_steps_tokens_over_time_and_rows_per_engine():
    a = block_stats(rows([3, 3, 5], [100.2, 100.9, 102.5], [0, 0, 1]))
    b = block_stats(rows([5, 7], [101.1, 250.0], [1, 1], errors=[None, "boom"]))
    s = summarize([a, b], wall_s=10.0)
    assert s["steps_to_finish"] == {"3": 2, "5": 2}  # the error row is not counted
    assert s["engine_rows"] == {"0": 2, "1": 3}
    assert s["tokens_over_time"] == {"start": 100, "bin_s": 1, "tokens_per_s": [20.0, 10.0, 10.0]}
    assert sum(s["latency_histogram"].values()) == 4


def test_tokens_over_time_keeps_at_most_60_bins():
    t = tokens_over_time({1000 + i: 2 for i in range(150)})
    assert t["bin_s"] == 3 and len(t["tokens_per_s"]) == 50 and t["tokens_per_s"][0] == 2.0
    assert tokens_over_time({}) is None


def test_histograms_get_their_empty_bins_back():
    assert contiguous({"2": 1, "5": 4}) == {"2": 1, "3": 0, "4": 0, "5": 4}
    assert contiguous({}) == {}
    assert [nice_axis(v)[0] for v in (0, 0.3, 3, 7, 10, 11, 600)] == pytest.approx([1.0, 0.3, 3, 8, 10, 12, 600])
    assert nice_axis(24) == (25, 5) and nice_axis(110) == (120, 4)


def test_report_page_is_self_contained_and_escapes_what_it_shows():
    s = summarize([block_stats(rows([3, 4], [100.0, 101.0], [0, 1], errors=[None, "<bad & row>"]))], 5.0,
                  run_id="r1", model="m")
    s["engines"] = {"0": {"busy_s": 1.5, "padding_fraction": 0.25, "padded_cells": 1, "computed_cells": 4}}
    page = render_report(s)
    assert page.count('<svg class="plot"') == 6  # every plot has data
    assert "&lt;bad &amp; row&gt;" in page and "<bad" not in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # nothing fetched
    assert "Padding per engine" in page and "0.25" in page
    assert Chart("t", [], [], "x", "y").svg() == '<p class="empty">t: no data</p>'


def test_summary_text_names_the_report():
    s = summarize([], 1.0)
    s["report_file"] = "file:///o/report.html"
    assert format_summary(s).endswith("report             file:///o/report.html")


def test_dashboard_flags():
    a = parse_args([])
    assert (a.dashboard, a.dashboard_port, a.report) == (False, 8265, True)
    a = parse_args(["--dashboard", "--dashboard-port", "9000", "--no-report"])
    assert (a.dashboard, a.dashboard_port, a.report) == (True, 9000, False)
    assert local_ray_options(False, 9000) == {"include_dashboard": False}
    assert local_ray_options(True, 9000) == {"include_dashboard": True, "dashboard_host": "127.0.0.1",
                                             "dashboard_port": 9000}

    class Ctx:
        dashboard_url = "127.0.0.1:9000"
    assert dashboard_url(Ctx()) == "http://127.0.0.1:9000"


def test_grafana_substitution():
    assert grafana_regex_escape("a.b-c(1)") == r"a\\.b-c\\(1\\)"
    expr = 'rate(x{model=~"$model", run=~"${run}", engine_rank=~"$engine_rank"}[1m])'
    assert substitute(expr, {"model": ["m.1"], "run": ["r1", "r2"], "engine_rank": None}) == \
        r'rate(x{model=~"m\\.1", run=~"(r1|r2)", engine_rank=~".*"}[1m])'
