"""Run one scheduler configuration over a workload and measure it.

Why one function for every scheduler: the comparison is only fair if each run gets the
same requests, the same decoding, the same engine loop and the same clock; the
schedulers differ only in `EngineConfig`. Every request arrives at time zero (offline
batch inference), so a request's latency is its completion time.

Wall-clock tokens/s is the headline. On a machine shared with other jobs it drifts
with their load, so each run also records the CPU time of this process: with one
torch thread, tokens per CPU-second is what the run would do on an idle core.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

import torch

from engine import Engine, EngineConfig
from engine.models.families import BlockLayout

from .planted import PlantedStops
from .workloads import Workload


@dataclass
class RunSpec:
    """One scheduler configuration. `token_budget` binds blockserve (and is only a
    request-size check for the baselines); `max_batch_size` is static's B."""

    label: str
    scheduler: str
    token_budget: int
    max_batch_size: int = 4096
    cache: str = "refresh"
    advance: str = "block"
    n_requests: Optional[int] = None  # run only the first n requests
    canvas: str = "auto"
    forward_overhead_cells: Optional[float] = None  # the catch-up planner's overhead (None: fitted online)
    compile_decode: bool = False  # the dual cache's block-only step through torch.compile (CUDA graphs on CUDA)
    profile: bool = True  # synchronize after every forward (exact forward_s); False: the loop runs ahead of the device

    def engine_config(self, w: Workload) -> EngineConfig:
        return EngineConfig(block_length=w.block_length, steps_per_block=w.steps_per_block, cache=self.cache,
                            token_budget=self.token_budget, scheduler=self.scheduler,
                            max_batch_size=self.max_batch_size, advance=self.advance, canvas=self.canvas,
                            forward_overhead_cells=self.forward_overhead_cells, compile_decode=self.compile_decode,
                            profile=self.profile)  # forward_fraction and MFU need exact forward times


@dataclass
class RunResult:
    label: str
    scheduler: str
    cache: str
    advance: str
    canvas: str  # as resolved by the engine: block or full
    token_budget: int
    max_batch_size: int
    requests: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    requests_per_s: float
    cpu_s: float  # CPU time of this process during the run (all threads)
    tokens_per_cpu_s: float  # with 1 torch thread: throughput as if the machine were not shared
    forward_s: float
    forward_fraction: float  # engine.stats.forward_s / wall
    host_overhead: float  # 1 - forward_fraction
    padding_fraction: float  # engine.stats.padded_cells / computed_cells
    computed_cells: int  # query cells forwarded (engine.stats)
    padded_cells: int  # of them, pad columns
    idle_row_fraction: Optional[float]  # forwarded rows whose block had nothing left to unmask (planted only)
    latency_p50_s: float
    latency_p99_s: float
    latency_mean_s: float
    cycles: int
    forwards: int
    steps: int
    mean_rows: float  # active rows per batch layout
    max_rows: int
    peak_cost: int  # largest |A| * W of any batch (equal-memory matching)
    mean_budget_use: Optional[float]  # mean cost / token_budget (blockserve)
    tokens_per_step: float  # generated tokens / sum of each request's denoising steps
    preemptions: int
    finished: Dict[str, int]
    accuracy: Optional[float] = None  # exact match (tiny-eval)
    model_flops: Optional[float] = None  # FLOPs the wrapped model executed (planted only)
    max_memory_bytes: Optional[int] = None  # torch.cuda.max_memory_allocated (GPU)
    loadavg: Optional[List[float]] = None  # 1-min load average before/after (CPU noise indicator)
    latencies_s: List[float] = field(default_factory=list, repr=False)
    output_digests: List[int] = field(default_factory=list, repr=False)  # hash of each request's tokens
    request_steps: List[int] = field(default_factory=list, repr=False)  # each request's denoising steps
    request_tokens: List[int] = field(default_factory=list, repr=False)  # each request's generated tokens
    error: Optional[str] = None
    peak_kv_over_budget: Optional[float] = None  # most K/V bytes alive / token_budget's K/V bytes
    kv_bytes_copied_per_token: Optional[float] = None  # K/V moved by slot moves, growth, shifts, catch-up reads
    host_ms_per_step: Optional[float] = None  # step() wall time outside forwards, per denoising step
    host_cpu_ms_per_step: Optional[float] = None  # the same in the stepping thread's CPU time (co-tenants' load aside)
    device_busy_share: Optional[float] = None  # device forward seconds (CUDA events, or exact) / wall seconds
    syncs_per_step: Optional[float] = None  # device -> host reads of the loop per denoising step
    kv_copied_by_per_token: Optional[Dict[str, float]] = None  # the K/V copies by cause (EngineStats.kv_copied_by)
    forward_overhead_cells: Optional[float] = None  # what the catch-up planner charged per extra forward, last
    catch_up: Optional[Dict[str, Any]] = None  # catch-up forwards: share of forward time and cells, padding
    pad_keys_per_token: Optional[float] = None  # (query, left-pad key) pairs attended per generated token
    pad_keys_per_token_unskipped: Optional[float] = None  # the same had every row attended the whole box
    compiled_forwards: int = 0  # forwards run by the compiled block-only step (compile_decode)
    compile_fallbacks: int = 0  # 1 when that step hit dynamo's recompile limit and the run went on eager

    def summary(self) -> Dict[str, Any]:
        d = asdict(self)
        for k in ("latencies_s", "output_digests", "request_steps", "request_tokens"):
            d.pop(k)
        if self.model_flops is not None:  # where the time goes: FLOP/s achieved, FLOPs spent per token
            d["model_flops_per_forward_s"] = self.model_flops / self.forward_s if self.forward_s else None
            d["model_flops_per_token"] = self.model_flops / self.tokens if self.tokens else None
        return d


def _quantile(xs: List[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _sync(device) -> None:
    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize()


def run(w: Workload, spec: RunSpec, deadline_s: Optional[float] = None) -> RunResult:
    """Serve the workload's requests with one engine; `deadline_s` stops a run that
    would not finish in time (its result then carries `error`, numbers over what finished)."""
    if spec.n_requests is not None:
        w = w.subset(spec.n_requests)
    eng = Engine(w.model, spec.engine_config(w), tokenizer=w.tokenizer, record_batches=True)
    meter = w.model.meter if isinstance(w.model, PlantedStops) else None
    m0 = dict(meter.as_dict()) if meter else None
    dev = eng.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    _sync(dev)
    c0 = time.process_time()
    t0 = time.perf_counter()
    ids = [eng.add_request(p, sp, request_id=i) for i, (p, sp) in enumerate(zip(w.prompts, w.params))]
    outs: Dict[Any, Any] = {}
    error = None
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
        if deadline_s is not None and time.perf_counter() - t0 > deadline_s:
            error = f"stopped at the {deadline_s:.0f} s deadline with {len(outs)}/{len(ids)} requests done"
            break
    _sync(dev)
    wall = time.perf_counter() - t0
    device_s = eng.runner.timer.drain()
    cpu = time.process_time() - c0
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    done = [outs[i] for i in ids if i in outs]
    errors = [o.error for o in done if o.finish_reason == "error"]
    if errors and error is None:
        error = f"{len(errors)} requests failed, first: {errors[0]}"
    st = eng.stats
    tokens = sum(len(o.token_ids) for o in done)
    lat = [o.latency_s for o in done]
    log = eng.batch_log or []
    steps = sum(o.num_steps for o in done)
    acc = None
    if w.references is not None:
        acc = sum((o.text or "").strip() == w.references[i].strip() for i, o in zip(ids, done)) / max(1, len(done))
    m1 = meter.as_dict() if meter else None
    idle = None
    if meter:
        cols = m1["row_columns"] - m0["row_columns"]
        idle = (m1["idle_row_columns"] - m0["idle_row_columns"]) / cols if cols else 0.0
    return RunResult(
        label=spec.label, scheduler=spec.scheduler, cache=spec.cache, advance=spec.advance,
        canvas="full" if eng.full_canvas else "block", token_budget=spec.token_budget, max_batch_size=spec.max_batch_size, requests=len(done), tokens=tokens,
        wall_s=wall, tokens_per_s=tokens / wall, requests_per_s=len(done) / wall, cpu_s=cpu,
        tokens_per_cpu_s=tokens / cpu if cpu else 0.0, forward_s=st.forward_s,
        forward_fraction=st.forward_s / wall, host_overhead=1.0 - st.forward_s / wall,
        padding_fraction=st.padding_fraction, computed_cells=st.computed_cells, padded_cells=st.padded_cells,
        idle_row_fraction=idle, forward_overhead_cells=st.forward_overhead_cells,
        latency_p50_s=_quantile(lat, 0.5), latency_p99_s=_quantile(lat, 0.99),
        latency_mean_s=sum(lat) / max(1, len(lat)), cycles=st.cycles, forwards=st.forwards, steps=st.steps,
        compiled_forwards=st.compiled_forwards, compile_fallbacks=st.compile_fallbacks,
        **st.memory_figures(),
        mean_rows=sum(len(b.request_ids) for b in log) / max(1, len(log)),
        max_rows=max((len(b.request_ids) for b in log), default=0), peak_cost=max((b.cost for b in log), default=0),
        mean_budget_use=(sum(b.cost for b in log) / max(1, len(log)) / spec.token_budget
                         if spec.scheduler == "blockserve" else None),
        tokens_per_step=tokens / steps if steps else 0.0, preemptions=getattr(eng.scheduler, "preemptions", 0),
        finished=dict(st.finished), accuracy=acc,
        model_flops=(m1["flops"] - m0["flops"]) if meter else None,
        max_memory_bytes=torch.cuda.max_memory_allocated() if dev.type == "cuda" else None,
        loadavg=[load0, load1] if load0 is not None else None, device_busy_share=device_s / wall if wall else None,
        latencies_s=lat, output_digests=[hash(tuple(o.token_ids)) for o in done], error=error,
        request_steps=[o.num_steps for o in done], request_tokens=[len(o.token_ids) for o in done])


def warmup(w: Workload, n: int = 4) -> None:
    """A short untimed run: first-call allocations and kernel selection stay out of the numbers."""
    run(w.subset(n), RunSpec("warmup", "blockserve", token_budget=max(4096, _widest(w.subset(n)) * n)))


def fit_overhead(w: Workload, spec: RunSpec, n: int = 8) -> float:
    """The catch-up planner's overhead fitted once (ForwardFit, online) on the first `n`
    requests under `spec`'s settings, for every run of a bench to plan with: fixed, it
    makes the runs' forwards, padding and tokens the same on every repetition."""
    sub = w.subset(min(n, len(w.prompts)))
    return run(sub, RunSpec("fit", spec.scheduler, spec.token_budget, spec.max_batch_size, spec.cache, spec.advance,
                            canvas=spec.canvas)).forward_overhead_cells


def _widest(w: Workload) -> int:
    """Largest final row width of the workload's requests (prompt + all blocks): the
    widest row under either canvas. Blocks at absolute positions (SDAR, LLaDA2) start
    with the prompt's tail, so a row's blocks cover it and max_new_tokens."""
    tok, L = w.tokenizer, w.block_length
    absolute = w.model.config.family.blocks == BlockLayout.ABSOLUTE
    lens = [len(p) if not isinstance(p, str) else len(tok(p, add_special_tokens=False)["input_ids"])
            for p in w.prompts]

    def width(p: int, n: int) -> int:
        tail = p % L if absolute else 0
        return p - tail + -(-(tail + n) // L) * L

    return max(width(p, sp.max_new_tokens) for p, sp in zip(lens, w.params))
