"""What an engine counts (EngineStats), and the online fit of what one more forward
costs (ForwardFit, fed by ForwardTimer on every device), which the catch-up planner reads
unless EngineConfig.forward_overhead_cells fixes it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple


@dataclass
class EngineStats:
    """Counters since the engine started; `active`, `pending`, `budget_used` describe the last cycle."""

    cycles: int = 0
    steps: int = 0
    forwards: int = 0
    generated_tokens: int = 0
    padded_cells: int = 0  # pad query columns forwarded
    computed_cells: int = 0
    forward_s: float = 0.0
    forward_cpu_s: float = 0.0  # CPU time of the stepping thread inside forwards (on a CPU with one torch thread: all of it)
    busy_s: float = 0.0  # wall time inside step()
    busy_cpu_s: float = 0.0  # CPU time of the stepping thread inside step(): unaffected by co-tenants' load
    active: int = 0
    pending: int = 0
    budget_used: int = 0
    token_budget: int = 0
    finished: Dict[str, int] = field(default_factory=dict)
    # K/V bytes copied, by cause (engine.slots): a new shape of the slots, a row moved into
    # a freed slot, a persistent row's shift at a block start
    kv_copied_by: Dict[str, int] = field(default_factory=lambda: dict(regrow=0, move=0, shift=0))
    kv_peak_bytes: int = 0  # most K/V bytes allocated at once (one layer more while the buffers grow)
    kv_budget_bytes: int = 0  # token_budget cells of K/V, one buffer (0 without a cache)
    forward_overhead_cells: float = 0.0  # the catch-up planner's cost of one more forward, in cells (EngineConfig
    # .forward_overhead_cells when set, else ForwardFit)
    syncs: int = 0  # host waits on the device by the step path: its reads (Engine._fetch: one per denoising
    # step, two more with logprob rows); uploads are pinned and non-blocking (tests/test_host_waits.py)
    # (query column, left-padding key) pairs attended; and what attending every row's whole
    # box would have cost (the padding key runs skip: engine.runner.key_runs)
    pad_key_cells: int = 0
    pad_key_cells_unskipped: int = 0
    # catch-up sub-batches (engine.runner.catch_up): rows recomputed before the batch's forward
    catch_up: Dict[str, float] = field(default_factory=lambda: dict(forwards=0, cells=0, padded_cells=0, seconds=0.0))
    # the compiled block-only step (EngineConfig.compile_decode): forwards it ran, and 1 once it gave
    # up (dynamo's recompile limit) and the engine went on eager
    compiled_forwards: int = 0
    compile_fallbacks: int = 0
    uncompiled_steps: int = 0  # steady steps compile_decode ran eager (a bucket beyond the K/V room, or given up)
    step_failures: int = 0  # steps that raised (their rows failed; engine.core logs them)
    # prefix caching (engine.prefix_cache): complete prompt blocks (and prompt tokens) of the
    # rows that joined a batch, those taken from the cache, blocks cached now, added, evicted,
    # and the K/V bytes copied between the cache and the rows' slots
    prefix_query_blocks: int = 0
    prefix_hit_blocks: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_cached_blocks: int = 0
    prefix_inserted_blocks: int = 0
    prefix_evictions: int = 0
    prefix_copied_bytes: int = 0

    @property
    def prefix_hit_rate(self) -> Optional[float]:
        """Complete prompt blocks of joining rows found in the prefix cache (None: none looked up)."""
        return self.prefix_hit_blocks / self.prefix_query_blocks if self.prefix_query_blocks else None

    @property
    def prefix_token_hit_rate(self) -> Optional[float]:
        """Prompt tokens of joining rows whose K/V came from the prefix cache."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else None

    @property
    def kv_bytes_copied(self) -> int:
        return sum(self.kv_copied_by.values())

    @property
    def forward_tokens(self) -> int:
        """Real (non-pad) query columns forwarded."""
        return self.computed_cells - self.padded_cells

    @property
    def host_s(self) -> float:
        """Wall time inside step() outside forwards (exact with EngineConfig.profile on a GPU)."""
        return self.busy_s - self.forward_s

    def memory_figures(self) -> Dict[str, Optional[float]]:
        """The figures the benchmarks report per run, under these names."""
        return {"peak_kv_over_budget": self.kv_peak_bytes / self.kv_budget_bytes if self.kv_budget_bytes else None,
                "kv_bytes_copied_per_token": self.kv_bytes_copied / self.generated_tokens
                if self.generated_tokens else None,
                "kv_copied_by_per_token": {k: v / self.generated_tokens for k, v in self.kv_copied_by.items()}
                if self.generated_tokens else None,
                "host_ms_per_step": 1e3 * self.host_s / self.steps if self.steps else None,
                "host_cpu_ms_per_step": 1e3 * (self.busy_cpu_s - self.forward_cpu_s) / self.steps
                if self.steps else None,
                "syncs_per_step": self.syncs / self.steps if self.steps else None,
                "catch_up": {"forward_share": self.catch_up["seconds"] / self.forward_s if self.forward_s else None,
                             "cell_share": self.catch_up["cells"] / self.computed_cells if self.computed_cells else None,
                             "padding": self.catch_up["padded_cells"] / self.catch_up["cells"]
                             if self.catch_up["cells"] else None, "forwards": self.catch_up["forwards"]},
                "pad_keys_per_token": self.pad_key_cells / self.generated_tokens if self.generated_tokens else None,
                "pad_keys_per_token_unskipped": self.pad_key_cells_unskipped / self.generated_tokens
                if self.generated_tokens else None}

    @property
    def padding_fraction(self) -> float:
        return self.padded_cells / self.computed_cells if self.computed_cells else 0.0


@dataclass
class ForwardFit:
    """Least squares of forward seconds = a + b * cells over the engine's own forwards,
    exponentially weighted (`decay` per forward) so it follows warm-up and load. a / b
    is what one more forward costs in cells: kernel launches and per-layer host work on
    a GPU, about 50 cells on a 2-core CPU for the tiny model."""

    decay: float = 0.98
    min_forwards: int = 16
    max_cells: float = 4096.0
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    count: int = 0

    def add(self, cells: int, seconds: float) -> None:
        d = self.decay
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + cells, d * self.sy + seconds
        self.sxx, self.sxy = d * self.sxx + cells * cells, d * self.sxy + cells * seconds
        self.count += 1

    def overhead_cells(self, default: float) -> float:
        """a / b, clamped to [0, max_cells]; `default` until the fit is determined
        (too few forwards, all of one size, or time not growing with cells)."""
        var = self.n * self.sxx - self.sx * self.sx
        if self.count < self.min_forwards or var <= 1e-9 * self.n * self.sxx:
            return default
        b = (self.n * self.sxy - self.sx * self.sy) / var
        if b <= 0:
            return default
        a = (self.sy - b * self.sx) / self.n
        return min(max(a / b, 0.0), self.max_cells)


class ForwardTimer:
    """Feeds ForwardFit on every device. Where a forward's host time is its run time (CPU,
    or CUDA with `exact`: synchronized), that time; on CUDA otherwise a pair of CUDA events
    around it, read once they completed (at a later forward: never a stall)."""

    def __init__(self, fit: ForwardFit, device, exact: bool = False):
        self.fit, self.events = fit, device.type == "cuda" and not exact
        self.pending: List[Tuple[int, Any, Any]] = []
        self._cells, self._start = 0, None
        self.device_s = 0.0  # forward seconds on the device (CUDA events) read so far; run time elsewhere

    def drain(self) -> float:
        """Wait for the forwards still in flight and read their events; the device's forward
        seconds so far (what the GPU bench divides by wall time: the device's busy share)."""
        if self.events:
            for n, e0, e1 in self.pending:
                e1.synchronize()
                self.fit.add(n, e0.elapsed_time(e1) / 1e3)
                self.device_s += e0.elapsed_time(e1) / 1e3
            self.pending = []
        return self.device_s

    def start(self, cells: int) -> "ForwardTimer":
        self._cells = cells
        if self.events:
            import torch

            while self.pending and self.pending[0][2].query():
                n, e0, e1 = self.pending.pop(0)
                self.fit.add(n, e0.elapsed_time(e1) / 1e3)
                self.device_s += e0.elapsed_time(e1) / 1e3
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        return self

    def stop(self, seconds: float) -> None:
        if not self.events:
            self.fit.add(self._cells, seconds)
            self.device_s += seconds
            return
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pending.append((self._cells, self._start, end))
