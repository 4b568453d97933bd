"""DiffusionGemma's canvas engine as an EngineCore (engine.core), so the actor's
EngineLoop drives it as it drives the masked-diffusion Engine: the same request intake,
validation, refusal of the settings it does not read (engine.reads.CANVAS: transformers'
knobs, max_new_tokens and seed), the same step wrapper and stats."""
from __future__ import annotations

import random
import time
from dataclasses import replace
from typing import Any, Dict, Optional

from ..config import EngineConfig
from ..core import EngineCore
from ..models.sharding import tensor_parallel_of
from ..reads import CANVAS
from ..sequence import Request
from .engine import CanvasEngine
from .params import CanvasParams


class CanvasServe(EngineCore):
    reads = CANVAS

    def __init__(self, model: Any, defaults: CanvasParams, config: EngineConfig = EngineConfig()):
        # it plans no budget (engine.budget); its prefix cache is exact (a causal encoder): auto is on
        config = replace(config, token_budget=config.fixed_token_budget(),
                         enable_prefix_caching=config.enable_prefix_caching is not False)
        self.tp = tensor_parallel_of(model, config)  # a shard (engine.canvas.sharding) under tensor_parallel_size > 1
        super().__init__(config, tokenizer=None, vocab_size=model.config.text_config.vocab_size)
        self.canvas = CanvasEngine(model, defaults, scheduler=config.scheduler, max_batch_size=config.max_batch_size,
                                   token_budget=config.token_budget,
                                   enable_prefix_caching=config.enable_prefix_caching)
        self._arrival: Dict[Any, float] = {}

    def check(self, req: Request) -> Optional[str]:
        """The canvas engine's own checks (CanvasEngine.refusal: its knobs, image tokens, the
        token budget), at intake as every engine's: a bad row never reaches its queue."""
        if req.params.seed is None and self.tp is not None:  # a rank's own draw would differ from the others'
            return ("seed is required under tensor_parallel_size > 1 (every rank must draw the same noise; "
                    "the Ray side fills each row's seed on rank 0 before it broadcasts the requests)")
        c = self.canvas
        return c.refusal(req.prompt, req.params.max_new_tokens, c.defaults.override(req.params))

    def admit(self, req: Request) -> None:
        """Hand a valid request (`check` passed) to the canvas engine."""
        seed = req.params.seed if req.params.seed is not None else random.getrandbits(62)
        self._arrival[req.request_id] = req.arrival
        self.canvas.enqueue(req.request_id, [int(t) for t in req.prompt], req.params.max_new_tokens, seed,
                            self.canvas.defaults.override(req.params))

    def run(self) -> None:
        c, st = self.canvas, self.stats
        forwards = c.decoder_forwards
        try:
            if c.has_unfinished():
                c.step()
        finally:
            st.steps += c.decoder_forwards - forwards
            st.cycles = st.forwards = c.decoder_forwards
            st.active = len(c.active)
            st.syncs = c.syncs
            for k, v in c.prefix_figures().items():  # the masked engine's names (engine.stats)
                setattr(st, k, v)
            self._collect()

    def fail_active(self, message: str) -> None:
        self.canvas.fail(message)
        self._collect()

    def pending(self) -> int:
        return len(self.canvas.waiting)

    def _collect(self) -> None:
        outs, self.canvas.outputs = self.canvas.outputs, []
        now = time.perf_counter()
        for o in outs:
            o.latency_s = now - self._arrival.pop(o.request_id, now)
            self.output(o)


__all__ = ["CanvasServe"]
