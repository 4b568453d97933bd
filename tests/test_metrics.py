"""A4: every metric in docs/metrics.md is served, non-zero, on the node's Prometheus
endpoint during/after a processor run; the doc, the METRICS table and the Grafana
dashboard name the same metrics."""
from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.request
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

from actors.metrics import METRICS, PREFIX_METRICS
from conftest import ROOT
from pipeline import DLLMProcessorConfig, EngineConfig, SamplingParams, build_processor

DOC = os.path.join(ROOT, "docs", "metrics.md")
DASHBOARD = os.path.join(ROOT, "actors", "grafana_dashboard.json")


def documented() -> dict:
    """{exported name without Prometheus' counter suffix: type}, from docs/metrics.md."""
    rows = re.findall(r"^\| `(ray_blockray_\w+)` \| (\w+) \|", open(DOC).read(), flags=re.M)
    return {re.sub(r"_total$", "", n) if kind == "counter" else n: kind for n, kind in rows}


def scrape(port: int, run: str, tags: set) -> dict:
    """{sample name: max value over the series of run `run`} from the node's metrics
    endpoint, and the (model, run, engine_rank) of every blockray series added to `tags`.
    Only `run`'s series count: the session's Ray keeps serving what earlier tests' runs
    exported (a causal-prompt family's prefix-cache counters among them)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_blockray_"):
                tags.add(tuple(s.labels.get(k) for k in ("model", "run", "engine_rank")))
                if s.labels.get("run") == run:
                    out[s.name] = max(out[s.name], s.value)
    return out


def exported_value(samples: dict, name: str, kind: str) -> float:
    key = {"counter": name + "_total", "histogram": name + "_count"}.get(kind, name)
    return samples.get(key, 0.0)


def test_doc_table_and_dashboard_agree():
    doc = documented()
    assert set(doc) == {f"ray_{n}" for n in METRICS}
    assert all(doc[f"ray_{n}"] == kind for n, (kind, _) in METRICS.items())
    assert len(doc) == len(METRICS)
    dashboard = json.load(open(DASHBOARD))
    targets = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs = " ".join(targets)
    for name in doc:
        assert name in exprs, f"{name} has no panel in the Grafana dashboard"
    # a variable per tag, and every query filtered by all of them: two runs never mix
    variables = [v["name"] for v in dashboard["templating"]["list"]]
    assert variables == ["datasource", "model", "run", "engine_rank"], variables
    for expr in targets:
        assert all(f'{tag}=~"${tag}"' in expr for tag in ("model", "run", "engine_rank")), expr


def test_metrics_exported_with_nonzero_values(tiny_model_dir, ray_local, metrics_port):
    import ray

    assert ray.nodes()[0]["MetricsExportPort"] == metrics_port
    # One engine, at most 2 requests per cycle and prompts of different lengths in arrival
    # order (sort="none": the sorter would pair equal lengths): requests queue (pending > 0),
    # rows get padded, batches overlap, for a few export periods (48 tokens a row: the engine,
    # not the start-up, is most of the run, so the 1 s exports land while it is busy).
    config = DLLMProcessorConfig(
        model=tiny_model_dir, num_engines=1, batch_size=8, max_concurrent_batches=4, sort="none",
        should_continue_on_error=True,  # the empty prompt's error row
        engine=EngineConfig(block_length=4, steps_per_block=8, token_budget=1024, max_batch_size=2),
        sampling=SamplingParams(max_new_tokens=48, policy="fixed", stop_token_ids=[]))
    items = [{"prompt": "copy: " + "abcdefghijklmnop"[: 1 + i % 16]} for i in range(64)] + [{"prompt": ""}]
    ds = build_processor(config, run_id="mtest001")(ray.data.from_items(items, override_num_blocks=9))
    result = {}

    def run():
        result["rows"] = ds.take_all()

    worker = threading.Thread(target=run)
    worker.start()
    seen: dict = defaultdict(float)
    tags: set = set()
    doc = documented()
    deadline, grace_end = time.time() + 240, None
    while time.time() < deadline:
        try:
            for k, v in scrape(metrics_port, "mtest001", tags).items():
                seen[k] = max(seen[k], v)
        except OSError:
            pass
        missing = [n for n, kind in doc.items() if exported_value(seen, n, kind) <= 0 and n[4:] not in PREFIX_METRICS]
        if not worker.is_alive():
            # Run over: values are exported periodically, so wait a bounded while for the last ones.
            grace_end = grace_end or time.time() + 30
            if not missing or time.time() > grace_end:
                break
        time.sleep(0.25)
    worker.join(60)
    assert len(result["rows"]) == 65
    missing = {n: exported_value(seen, n, kind) for n, kind in doc.items()
               if exported_value(seen, n, kind) <= 0 and n[4:] not in PREFIX_METRICS}
    assert not missing, f"metrics never seen non-zero: {sorted(missing)}; seen: {dict(seen)}"
    # LLaDA's prompt is bidirectional: no prefix cache, and its metrics are not served
    # (tests/test_prefix_cache.py records them from an engine with the cache)
    assert not [n for n in seen if n.startswith("ray_blockray_prefix_cache")], dict(seen)
    assert seen["ray_blockray_batches_in_flight"] >= 2  # Ray Data overlapped batches on the actor
    assert seen["ray_blockray_finished_requests_total"] >= 1
    assert 0 < seen["ray_blockray_token_budget_utilization"] <= 1
    # tagged with the model's short name and the run id (the job prints it at start)
    assert (os.path.basename(tiny_model_dir.rstrip("/")), "mtest001", "0") in tags, tags
