"""Watching a run, with the real watchers (issue 29): one local `blockray` run with
--dashboard, shared by every test here (a run costs a minute on 2 cores):
- a headless Chromium finds the run's job and its engine actors in the Ray dashboard
  while it runs (the driver paused meanwhile);
- our own Prometheus scrapes what Ray's file-based service discovery names, and every
  PromQL query of actors/grafana_dashboard.json, variables substituted as Grafana does,
  returns a series with the run's `model` and `run` tags (a renamed metric does not);
- report.html renders its plots in Chromium without a console error.
Screenshots stay in out/test_watch/screenshots (CI artifacts)."""
from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from typing import Optional

import pytest

from conftest import ROOT, free_port
from procs import stop_group
from watch_tools import (CHROMIUM, PROMETHEUS, empty_panel_queries, launch_chromium, ray_auth_token, require,
                         start_prometheus, variable_values)

DASHBOARD = os.path.join(ROOT, "actors", "grafana_dashboard.json")
OUT = os.path.join(ROOT, "out", "test_watch")  # the run's output: report.html, screenshots/
SHOTS = os.path.join(OUT, "screenshots")
MODEL_TAG = "tiny-dllm"  # the embedded model's metrics tag (last path component)
# Enough rows, two at a time per engine, for about ten seconds of generation on 2 cores: a
# few Prometheus scrapes while the counters move, and a tokens/s curve in the report.
ROWS = 720
RUN_ARGS = ["--limit", str(ROWS), "--max-batch-size", "2", "--num-engines", "2", "--num-cpus", "2"]


@dataclass
class Watched:
    proc: subprocess.Popen
    log: str
    dashboard_url: str
    run_id: str
    prometheus: Optional[str]  # its URL, None when it is not installed (outside CI)
    started: float
    finished: Optional[float] = None

    def wait(self, timeout: float = 600) -> int:
        """The run's exit code, once it finished."""
        rc = self.proc.wait(timeout)
        self.finished = self.finished or time.time()
        return rc

    def text(self) -> str:
        return open(self.log).read()


def _wait_for(what: str, check, timeout: float, proc: subprocess.Popen, log: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = check()
        if value:
            return value
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"{what} not seen; run log:\n{open(log).read()[-4000:]}")


@pytest.fixture(scope="module")
def watched():
    if not PROMETHEUS and not CHROMIUM:
        require(None, "prometheus and chromium")
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(SHOTS)
    temp = tempfile.mkdtemp(prefix="brw-", dir="/tmp")  # short: Ray's unix sockets live under it
    log = os.path.join(temp, "run.log")
    env = dict(os.environ, RAY_metrics_report_interval_ms="1000")  # engines' metrics every second
    env.pop("RAY_ADDRESS", None)
    port = free_port()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "jobs", "offline_eval.py"), *RUN_ARGS,
                                 "--output", OUT, "--temp-dir", temp, "--dashboard", "--dashboard-port", str(port)],
                                cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    prom = None
    try:
        text = lambda: open(log).read()  # noqa: E731
        url = _wait_for("the dashboard URL", lambda: next(
            (line.split()[2] for line in text().splitlines() if line.startswith("Ray dashboard: http")), None),
            300, proc, log)
        assert url == f"http://127.0.0.1:{port}", url
        run_id = next(line.split()[2] for line in text().splitlines() if line.startswith("blockray run "))
        if PROMETHEUS:  # Ray's file-based service discovery: the metrics export of every node
            sd = os.path.join(temp, "prom_metrics_service_discovery.json")
            _wait_for(sd, lambda: os.path.exists(sd), 120, proc, log)
            prom_port = free_port()
            prom = start_prometheus(sd, prom_port, temp)
        yield Watched(proc, log, url, run_id, prom and f"http://127.0.0.1:{prom_port}", time.time())
    finally:
        if proc.poll() is None:
            try:
                proc.wait(600)
            except subprocess.TimeoutExpired:
                stop_group(proc, 30)
        if prom is not None:
            prom.terminate()
            prom.wait(30)
        shutil.rmtree(temp, ignore_errors=True)


# --- (a) the Ray dashboard during the run --------------------------------------------------

def _live_engines(url: str) -> int:
    """How many DLLMEngineActor actors are ALIVE, from the dashboard's own state API."""
    query = "&".join(f"filter_keys={k}&filter_predicates=%3D&filter_values={v}"
                     for k, v in (("class_name", "DLLMEngineActor"), ("state", "ALIVE")))
    token = ray_auth_token()
    request = urllib.request.Request(f"{url}/api/v0/actors?{query}",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return len(json.load(r)["data"]["result"]["result"])
    except OSError:
        return 0


def test_dashboard_shows_the_job_and_its_engines(watched):
    """Once the state API says both engines are up, the driver is paused (SIGSTOP: the job
    stays RUNNING, its engines ALIVE) while Chromium finds them: on a loaded machine the
    browser takes longer to start than the tiny run takes to finish."""
    from playwright.sync_api import sync_playwright

    require(CHROMIUM, "chromium")
    _wait_for("two live engines", lambda: _live_engines(watched.dashboard_url) >= 2, 300, watched.proc, watched.log)
    os.kill(watched.proc.pid, signal.SIGSTOP)
    try:
        with sync_playwright() as p:
            browser = launch_chromium(p)
            context = browser.new_context(viewport={"width": 1400, "height": 900})
            token = ray_auth_token()
            if token:  # what the dashboard's login page stores
                context.add_cookies([{"name": "ray-authentication-token", "value": token,
                                      "url": watched.dashboard_url}])
            page = context.new_page()
            page.set_default_timeout(120_000)
            page.goto(watched.dashboard_url + "/#/jobs")
            # a driver job's entrypoint is its command line
            job = page.locator("tr", has_text="offline_eval.py").filter(has_text="RUNNING").first
            job.wait_for()
            job_id = job.locator("td").first.inner_text().strip()
            page.screenshot(path=os.path.join(SHOTS, "dashboard-jobs.png"), full_page=True)
            page.goto(watched.dashboard_url + "/#/actors")
            page.get_by_label("Class").fill("DLLMEngineActor")  # the actor holding each engine
            rows = page.locator("tr", has_text="DLLMEngineActor").filter(has_text="ALIVE").filter(has_text=job_id)
            rows.nth(1).wait_for()
            alive = {re.search(r"\b[0-9a-f]{32}\b", row.inner_text()).group() for row in rows.all()}  # actor ids
            page.screenshot(path=os.path.join(SHOTS, "dashboard-actors.png"), full_page=True)
            browser.close()
    finally:
        os.kill(watched.proc.pid, signal.SIGCONT)
    assert len(alive) == 2, f"live DLLMEngineActor actors of job {job_id} in the dashboard: {alive}"


# --- the Grafana dashboard against a real Prometheus ---------------------------------------

@pytest.fixture(scope="module")
def scraped(watched):
    """The run finished, and Prometheus scraped its engines: (url, dashboard, chosen, tags, start, end)."""
    require(PROMETHEUS, "prometheus")
    assert watched.wait() == 0, watched.text()[-4000:]
    time.sleep(2)  # the last scrape
    dashboard = json.load(open(DASHBOARD))
    start, end = watched.started - 60, time.time()
    # Grafana offers the run in its variables; the user picks this model and run, all ranks
    offered = variable_values(watched.prometheus, dashboard, {"model": None, "run": None, "engine_rank": None},
                              start, end)
    assert MODEL_TAG in offered["model"] and watched.run_id in offered["run"], offered
    assert {"0", "1"} <= set(offered["engine_rank"]), offered
    chosen = {"model": [MODEL_TAG], "run": [watched.run_id], "engine_rank": None}
    return watched.prometheus, dashboard, chosen, {"model": MODEL_TAG, "run": watched.run_id}, start, end


def test_every_grafana_panel_query_has_the_runs_series(scraped):
    url, dashboard, chosen, tags, start, end = scraped
    queries = [t for p in dashboard["panels"] for t in p["targets"]]
    assert len(queries) == 19
    assert empty_panel_queries(url, dashboard, chosen, tags, start, end) == []


def test_a_renamed_metric_empties_its_panel(scraped):
    url, dashboard, chosen, tags, start, end = scraped
    broken = copy.deepcopy(dashboard)
    target = broken["panels"][0]["targets"][0]
    assert "ray_blockray_generated_tokens_total" in target["expr"]
    target["expr"] = target["expr"].replace("ray_blockray_generated_tokens_total", "ray_blockray_tokens_generated_total")
    empty = empty_panel_queries(url, broken, chosen, tags, start, end)
    assert len(empty) == 1 and "ray_blockray_tokens_generated_total" in empty[0], empty
    # another run chosen in the run variable: none of this run's series shows
    other = {**chosen, "run": ["not-" + tags["run"]]}
    assert len(empty_panel_queries(url, dashboard, other, tags, start, end)) == 19


# --- (b) report.html in the browser --------------------------------------------------------

def test_report_renders_its_plots(watched):
    from playwright.sync_api import sync_playwright

    require(CHROMIUM, "chromium")
    assert watched.wait() == 0, watched.text()[-4000:]
    report = os.path.join(OUT, "report.html")
    assert f"report             file://{report}" in watched.text()
    summary = json.load(open(os.path.join(OUT, "summary.json")))
    assert summary["report_file"] == f"file://{report}" and summary["rows"] == ROWS
    with sync_playwright() as p:
        browser = launch_chromium(p)
        page = browser.new_page(viewport={"width": 1340, "height": 900})
        problems, requests = [], []
        page.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.on("request", lambda r: requests.append(r.url))
        page.goto(f"file://{report}")
        page.screenshot(path=os.path.join(SHOTS, "report.png"), full_page=True)
        plots = page.eval_on_selector_all("svg.plot", """els => els.map(e => ({
            title: e.querySelector('title').textContent, w: e.getBoundingClientRect().width,
            h: e.getBoundingClientRect().height, marks: e.querySelectorAll('rect, circle').length,
            tall: [...e.querySelectorAll('rect')].filter(r => r.getBBox().height > 0).length}))""")
        browser.close()
    assert problems == []
    assert requests == [f"file://{report}"]  # self-contained: nothing fetched
    titles = [p["title"] for p in plots]
    assert titles == ["Request latency (rows the engines ran)", "Blocks to finish", "Denoising steps per request",
                      "Generated tokens / s over time", "Busy time per engine", "Padding per engine"]
    for plot in plots:
        assert plot["w"] > 100 and plot["h"] > 100 and plot["marks"] > 0, plot
    bars = {p["title"]: p["tall"] for p in plots}
    assert bars["Busy time per engine"] == 2 and bars["Blocks to finish"] >= 1, bars
    # the histograms count every row the engines ran
    assert sum(summary["steps_to_finish"].values()) == sum(summary["blocks_to_finish"].values()) == ROWS
