"""Engine metrics for Ray's Prometheus endpoint (names gain Ray's `ray_` prefix there).

Why deltas: EngineStats holds counters since the engine started, while a Ray Counter
only goes up by what it is given; after every block cycle the actor passes the stats
and this class adds the difference since the last cycle (an engine rebuilt after a
crash starts again from zero, which is detected and not counted as negative).
Names and meanings are listed in docs/metrics.md; keep the two in sync.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Dict, Iterable, Tuple

from ray.util.metrics import Counter, Gauge, Histogram

RANK = "engine_rank"
MODEL = "model"  # the model's short name (last path component of --model)
RUN = "run"  # the run id the job prints at start: two concurrent runs stay apart
REASON = "finish_reason"
LATENCY_BUCKETS_S = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0]

# name -> (kind, description); the single list docs/metrics.md and the dashboard follow.
METRICS: Dict[str, Tuple[str, str]] = {
    "blockray_generated_tokens": ("counter", "Tokens generated (committed, up to the stop token)"),
    "blockray_finished_requests": ("counter", "Requests finished, by finish_reason (stop, length, error)"),
    "blockray_block_cycles": ("counter", "Block cycles run (one per engine step with active requests)"),
    "blockray_denoising_steps": ("counter", "Denoising steps run (forward passes over the batch)"),
    "blockray_computed_cells": ("counter", "Query cells (rows x columns) forwarded"),
    "blockray_padded_cells": ("counter", "Pad query cells forwarded (left padding to the bounding box)"),
    "blockray_forward_seconds": ("counter", "Seconds spent in model forwards"),
    "blockray_active_requests": ("gauge", "Requests in the last block cycle's batch"),
    "blockray_pending_requests": ("gauge", "Requests queued in the engine, not yet admitted"),
    "blockray_batches_in_flight": ("gauge", "map_batches calls the engine actor is serving at once"),
    "blockray_token_budget_utilization": ("gauge", "Last batch cost / token_budget (0..1)"),
    "blockray_padding_fraction": ("gauge", "Padded cells / computed cells since the engine started"),
    "blockray_request_latency_seconds": ("histogram", "Seconds from add_request to finish, per request"),
    "blockray_prefix_cache_query_blocks": ("counter", "Complete prompt blocks of rows joining a batch, looked up in "
                                           "the prefix cache"),
    "blockray_prefix_cache_hit_blocks": ("counter", "Prompt blocks whose K/V came from the prefix cache"),
    "blockray_prefix_cache_query_tokens": ("counter", "Prompt tokens of rows joining a batch"),
    "blockray_prefix_cache_hit_tokens": ("counter", "Prompt tokens whose K/V came from the prefix cache"),
    "blockray_prefix_cache_evictions": ("counter", "Cached prompt blocks evicted to make room"),
    "blockray_prefix_cache_blocks": ("gauge", "Prompt blocks the prefix cache holds"),
    "blockray_prefix_cache_hit_rate": ("gauge", "Hit blocks / looked-up blocks since the engine started (0..1)"),
}
# Served only by engines with enable_prefix_caching (engine.prefix_cache), and from their first lookup
PREFIX_METRICS = frozenset(n for n in METRICS if n.startswith("blockray_prefix_cache_"))
# EngineStats counter -> its metric
PREFIX_COUNTERS = {"prefix_query_blocks": "blockray_prefix_cache_query_blocks",
                   "prefix_hit_blocks": "blockray_prefix_cache_hit_blocks",
                   "prefix_query_tokens": "blockray_prefix_cache_query_tokens",
                   "prefix_hit_tokens": "blockray_prefix_cache_hit_tokens",
                   "prefix_evictions": "blockray_prefix_cache_evictions"}


def new_run_id() -> str:
    """A short id for one run (the `run` tag): the job prints it at start, so a dashboard
    filtered on it shows that run alone even when two share a cluster."""
    return uuid.uuid4().hex[:8]


@dataclass
class _Seen:
    cycles: int = 0
    steps: int = 0
    generated_tokens: int = 0
    computed_cells: int = 0
    padded_cells: int = 0
    forward_s: float = 0.0
    finished: Dict[str, int] = field(default_factory=dict)
    prefix: Dict[str, int] = field(default_factory=dict)


class EngineMetrics:
    """Counters, gauges and histograms of one engine actor, tagged with its rank, model
    and run. One per engine actor, created once its rank is known (Ray registers metrics
    per worker process)."""

    def __init__(self, engine_rank: int, model: str = "", run: str = ""):
        tags = {RANK: str(engine_rank), MODEL: model, RUN: run}
        keys = (RANK, MODEL, RUN)

        def counter(name: str, tag_keys: Tuple[str, ...] = keys) -> Counter:
            c = Counter(name, description=METRICS[name][1], tag_keys=tag_keys)
            c.set_default_tags(tags)
            return c

        def gauge(name: str) -> Gauge:
            g = Gauge(name, description=METRICS[name][1], tag_keys=keys)
            g.set_default_tags(tags)
            return g

        self.generated_tokens = counter("blockray_generated_tokens")
        self.finished_requests = counter("blockray_finished_requests", (*keys, REASON))
        self.block_cycles = counter("blockray_block_cycles")
        self.denoising_steps = counter("blockray_denoising_steps")
        self.computed_cells = counter("blockray_computed_cells")
        self.padded_cells = counter("blockray_padded_cells")
        self.forward_seconds = counter("blockray_forward_seconds")
        self.active_requests = gauge("blockray_active_requests")
        self.pending_requests = gauge("blockray_pending_requests")
        self.batches_in_flight = gauge("blockray_batches_in_flight")
        self.budget_utilization = gauge("blockray_token_budget_utilization")
        self.padding_fraction = gauge("blockray_padding_fraction")
        self.latency = Histogram("blockray_request_latency_seconds", description=METRICS[
            "blockray_request_latency_seconds"][1], boundaries=LATENCY_BUCKETS_S, tag_keys=keys)
        self.latency.set_default_tags(tags)
        self._counter, self._gauge = counter, gauge
        self._prefix: Dict[str, object] = {}  # created at the engine's first prefix-cache lookup
        self._seen = _Seen()

    def record_step(self, stats, latencies_s: Iterable[float]) -> None:
        """Called after every engine step with its EngineStats and finished latencies."""
        seen = self._seen
        if stats.cycles < seen.cycles:  # a fresh engine replaced a crashed one
            seen = self._seen = _Seen()
        for attr, metric in (("cycles", self.block_cycles), ("steps", self.denoising_steps),
                             ("generated_tokens", self.generated_tokens),
                             ("computed_cells", self.computed_cells), ("padded_cells", self.padded_cells),
                             ("forward_s", self.forward_seconds)):
            delta = getattr(stats, attr) - getattr(seen, attr)
            if delta > 0:
                metric.inc(delta)
                setattr(seen, attr, getattr(stats, attr))
        for reason, count in stats.finished.items():
            delta = count - seen.finished.get(reason, 0)
            if delta > 0:
                self.finished_requests.inc(delta, tags={REASON: str(reason)})
                seen.finished[reason] = count
        self.active_requests.set(stats.active)
        self.pending_requests.set(stats.pending)
        if stats.token_budget:
            self.budget_utilization.set(stats.budget_used / stats.token_budget)
        if stats.computed_cells:
            self.padding_fraction.set(stats.padded_cells / stats.computed_cells)
        for s in latencies_s:
            self.latency.observe(max(float(s), 1e-9))
        if getattr(stats, "prefix_query_blocks", 0):
            self._record_prefix(stats, seen)

    def _record_prefix(self, stats, seen: _Seen) -> None:
        """The prefix cache's counters and gauges (engines with enable_prefix_caching)."""
        if not self._prefix:
            self._prefix = {name: self._counter(name) for name in PREFIX_COUNTERS.values()}
            for name in ("blockray_prefix_cache_blocks", "blockray_prefix_cache_hit_rate"):
                self._prefix[name] = self._gauge(name)
        for attr, name in PREFIX_COUNTERS.items():
            delta = getattr(stats, attr) - seen.prefix.get(attr, 0)
            if delta > 0:
                self._prefix[name].inc(delta)
                seen.prefix[attr] = getattr(stats, attr)
        self._prefix["blockray_prefix_cache_blocks"].set(stats.prefix_cached_blocks)
        self._prefix["blockray_prefix_cache_hit_rate"].set(stats.prefix_hit_blocks / stats.prefix_query_blocks)

    def set_batches_in_flight(self, n: int) -> None:
        self.batches_in_flight.set(n)
