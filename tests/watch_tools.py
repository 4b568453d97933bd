"""Real watchers of a run for the tests: a Prometheus server (Debian's `prometheus`) scraping
what Ray's file-based service discovery names, the Grafana dashboard's queries evaluated
through its HTTP API as Grafana would send them, and a headless Chromium (Debian's
`chromium`, driven by playwright). Everything on loopback."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from typing import Any, Dict, List, Optional, Tuple

import pytest

PROMETHEUS = shutil.which("prometheus")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def require(binary: Optional[str], name: str) -> str:
    """The binary's path; a skip outside CI when it is missing, a failure under CI=true
    (.ci/run installs it)."""
    if binary:
        return binary
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{name} is not installed (.ci/run installs it with apt-get)")
    pytest.skip(f"{name} is not installed (apt-get install {name})")


# --- Prometheus ---------------------------------------------------------------------------

def start_prometheus(sd_file: str, port: int, workdir: str) -> subprocess.Popen:
    """Our own Prometheus on 127.0.0.1:`port`, storage under `workdir`, scraping every second
    the targets Ray lists in `sd_file`; returns once it answers."""
    config = os.path.join(workdir, "prometheus.yml")
    with open(config, "w") as f:
        json.dump({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},  # JSON is YAML
                   "scrape_configs": [{"job_name": "ray", "file_sd_configs": [
                       {"files": [sd_file], "refresh_interval": "1s"}]}]}, f)
    log = open(os.path.join(workdir, "prometheus.log"), "w")
    proc = subprocess.Popen([require(PROMETHEUS, "prometheus"), f"--config.file={config}",
                             f"--storage.tsdb.path={os.path.join(workdir, 'data')}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=1)
            return proc
        except Exception:  # noqa: BLE001 - not up yet
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"prometheus did not start: {open(log.name).read()[-2000:]}")
            time.sleep(0.3)


def prom_api(url: str, path: str, **params: Any) -> Any:
    """GET `path` of Prometheus' HTTP API; its `data` (raises on an error status)."""
    query = urllib.parse.urlencode(params, doseq=True)
    with urllib.request.urlopen(f"{url}/api/v1/{path}?{query}", timeout=30) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]


def grafana_regex_escape(value: str) -> str:
    """A variable's value as Grafana's Prometheus data source puts it into a regex matcher
    (prometheusRegularEscape): regex metacharacters escaped, written for a PromQL string."""
    return re.sub(r"([$^*{}\[\]'+?.()|])", r"\\\\\1", value.replace("\\", "\\\\\\\\"))


def substitute(expr: str, values: Dict[str, Optional[List[str]]], all_value: str = ".*") -> str:
    """`expr` with Grafana's template variables replaced: a multi-value variable's values as
    (a|b), escaped; None (All selected) as the variable's allValue."""
    def one(m: "re.Match[str]") -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            return m.group(0)
        chosen = values[name]
        if chosen is None:
            return all_value
        escaped = [grafana_regex_escape(v) for v in chosen]
        return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


def variable_values(url: str, dashboard: Dict[str, Any], chosen: Dict[str, Optional[List[str]]],
                    start: float, end: float) -> Dict[str, List[str]]:
    """What each query variable offers, from its label_values(metric{…}, label) query
    (evaluated with the variables before it substituted), over [start, end]."""
    offered: Dict[str, List[str]] = {}
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["definition"].strip())
        assert m, var["definition"]
        selector = substitute(m.group(1), chosen)
        offered[var["name"]] = prom_api(url, f"label/{m.group(2)}/values", **{"match[]": selector},
                                        start=start, end=end)
    return offered


def panel_queries(dashboard: Dict[str, Any]) -> List[Tuple[str, str]]:
    """(panel title, PromQL expression) of every target of every panel."""
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def empty_panel_queries(url: str, dashboard: Dict[str, Any], chosen: Dict[str, Optional[List[str]]],
                        tags: Dict[str, str], start: float, end: float, step: float = 1.0) -> List[str]:
    """The panel queries that, evaluated over [start, end] as Grafana would (a range query,
    variables substituted), return no series carrying `tags` with a finite value."""
    empty = []
    for title, expr in panel_queries(dashboard):
        result = prom_api(url, "query_range", query=substitute(expr, chosen), start=start, end=end, step=step)
        ok = [s for s in result["result"] if all(s["metric"].get(k) == v for k, v in tags.items())
              and any(math.isfinite(float(v)) for _, v in s["values"])]
        if not ok:
            empty.append(f"{title}: {expr} -> {len(result['result'])} series, none with {tags} and a value")
    return empty


# --- Chromium -----------------------------------------------------------------------------

def launch_chromium(playwright: Any) -> Any:
    """Headless Debian chromium through playwright (never a downloaded browser)."""
    return playwright.chromium.launch(executable_path=require(CHROMIUM, "chromium"), headless=True)


def ray_auth_token() -> Optional[str]:
    """The token a local Ray with token auth checks (Ray's own lookup order), or None."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"]
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    try:
        return open(path).read().strip() or None
    except OSError:
        return None
