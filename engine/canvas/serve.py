"""CanvasEngine behind the masked-diffusion Engine's interface, so the actor's EngineLoop
drives either: `add_request(prompt, SamplingParams, request_id)` from any thread (queued,
handed to the CanvasEngine by the stepping thread), `step()` returning the requests that
finished in it, `has_unfinished()`, `stats` (EngineStats: the metrics' counters)."""
from __future__ import annotations

import random
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..config import EngineConfig, SamplingParams
from ..models.families.diffusion_gemma import masked_only_settings
from ..sequence import RequestOutput
from ..stats import EngineStats
from .engine import CanvasEngine
from .params import CanvasParams


class CanvasServe:
    def __init__(self, model: Any, defaults: CanvasParams, config: EngineConfig = EngineConfig()):
        self.canvas = CanvasEngine(model, defaults, scheduler=config.scheduler, max_batch_size=config.max_batch_size,
                                   token_budget=config.token_budget)
        self.tokenizer = None  # stop strings are refused per row: no text is decided on here
        self.batch_log = None
        self.stats = EngineStats(token_budget=config.token_budget)
        self._intake: List[Tuple[Any, List[int], SamplingParams]] = []
        self._arrival: Dict[Any, float] = {}
        self._lock = threading.Lock()
        self._in_flight = 0

    def add_request(self, prompt: Sequence[int], params: SamplingParams = SamplingParams(),
                    request_id: Any = None) -> Any:
        """Queue one request; a bad one comes back from the next step() as an error."""
        with self._lock:
            self._in_flight += 1
            self._arrival[request_id] = time.perf_counter()
            self._intake.append((request_id, list(prompt), params))
        return request_id

    def has_unfinished(self) -> bool:
        with self._lock:
            return self._in_flight > 0

    @staticmethod
    def refusal(params: SamplingParams) -> Optional[str]:
        bad = masked_only_settings(params)
        if bad:
            return (f"{', '.join(bad)} appl{'ies' if len(bad) == 1 else 'y'} to masked-diffusion models only, not "
                    "to DiffusionGemma (its knobs: max_denoising_steps, entropy_bound, t_min, t_max, "
                    "stability_threshold, confidence_threshold, seed, max_new_tokens)")
        return None

    def step(self) -> List[RequestOutput]:
        t0 = time.perf_counter()
        with self._lock:
            intake, self._intake = self._intake, []
        c = self.canvas
        for rid, prompt, params in intake:
            err = self.refusal(params)
            if err:
                c.outputs.append(RequestOutput(rid, prompt, [], "error", error=err))
                continue
            seed = params.seed if params.seed is not None else random.getrandbits(62)
            c.add_request(rid, prompt, params.max_new_tokens, seed, params)
        forwards = c.decoder_forwards
        if c.has_unfinished():
            c.step()
        outs, c.outputs = c.outputs, []
        now = time.perf_counter()
        st = self.stats
        st.steps += c.decoder_forwards - forwards
        st.cycles = st.forwards = c.decoder_forwards
        st.active, st.pending = len(c.active), len(c.waiting)
        st.busy_s += now - t0
        with self._lock:
            self._in_flight -= len(outs)
            for o in outs:
                o.latency_s = now - self._arrival.pop(o.request_id, now)
        for o in outs:
            st.generated_tokens += len(o.token_ids)
            st.finished[o.finish_reason] = st.finished.get(o.finish_reason, 0) + 1
        return outs


__all__ = ["CanvasServe"]
