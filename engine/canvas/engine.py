"""Canvas-grained continuous batching for DiffusionGemma.

A row is its prompt plus committed canvases (their K/V written by transformers' encoder
into the row's own DynamicCache, whose sliding layers keep only the window) plus the
canvas being denoised. Every step forwards the canvases of all active rows in ONE
decoder call: the rows' caches are left-padded into one read-only batch cache with a
boolean mask per layer type, positions per row. The rows whose canvas stops in a step
(stable and confident, or out of steps) commit theirs in ONE encoder forward (the same
batch view, written through) and start their next canvas at the next step; a row leaves
at EOS or max_tokens; new rows are admitted under the token budget at any step
(`blockserve`), only into an empty batch (`static`), or one at a time (`sequential`).

Rows grow by a canvas per commit, so the admitted rows can outgrow the token budget.
Then, like vLLM's recompute preemption, the most recently admitted rows are preempted
(their K/V dropped; tokens, canvas in progress and generator kept) to the front of the
waiting queue, and re-admitted by one encoder pass over prompt + committed canvases
when they fit again. No row is ever dropped or mixed; the oldest row always stays.

Random draws come from a per-request torch.Generator seeded with the request's seed, in
transformers' order (initial canvas; per step the multinomial sample, then the renoise),
so a row's tokens equal `torch.manual_seed(S); model.generate(prompt alone)` whatever
batch it is served in."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import torch

from ..config import SchedulerKind, enum_value
from ..sequence import FinishReason, RequestOutput
from .params import CanvasParams, budget_refusal

# What a request gets back: the engine's RequestOutput (num_blocks counts canvases).
CanvasOutput = RequestOutput


@dataclass(eq=False)
class _Row:
    request_id: Any
    prompt: List[int]
    max_tokens: int
    params: CanvasParams
    gen: torch.Generator
    cache: Any = None  # transformers DynamicCache: prompt + committed canvases
    generated: List[int] = field(default_factory=list)
    canvas: Optional[torch.Tensor] = None  # (1, L) current (noisy) canvas
    argmax: Optional[torch.Tensor] = None
    sc_logits: Optional[torch.Tensor] = None  # previous step's processed logits (self-conditioning)
    cur_step: int = 0  # steps remaining (transformers counts N..1)
    stopper: Any = None
    num_steps: int = 0

    @property
    def cur_len(self) -> int:
        return len(self.prompt) + len(self.generated)


class _BatchCache:
    """The batch view of the rows' caches: per layer, their K/V left-padded to one length.
    transformers' decoder only reads `layers[i].keys/values` and `is_compileable`; its
    encoder calls `update`, which here returns cached + new K/V and keeps the new ones
    (`written`) for the rows' own caches."""

    is_compileable = False

    class _Layer:
        def __init__(self, keys: torch.Tensor, values: torch.Tensor):
            self.keys, self.values = keys, values

    def __init__(self, layers: List["_BatchCache._Layer"]):
        self.layers = layers
        self.written: dict = {}

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.written[layer_idx] = (keys, values)
        old = self.layers[layer_idx]
        return torch.cat([old.keys, keys], dim=-2), torch.cat([old.values, values], dim=-2)


class CanvasEngine:
    """Serves DiffusionGemma requests; `model` is transformers' DiffusionGemmaForBlockDiffusion."""

    def __init__(self, model, defaults: CanvasParams, scheduler: SchedulerKind = SchedulerKind.BLOCKSERVE,
                 max_batch_size: int = 64, token_budget: int = 65536, stop_token_ids: Optional[Sequence[int]] = None):
        from transformers.models.diffusion_gemma import generation_diffusion_gemma as g

        self._g = g
        self.model, self.defaults = model, defaults
        self.scheduler = enum_value("scheduler", scheduler, SchedulerKind)
        self.max_batch_size = 1 if self.scheduler == SchedulerKind.SEQUENTIAL else max_batch_size
        self.token_budget = token_budget
        cfg = model.config
        self.L, self.V = cfg.canvas_length, cfg.text_config.vocab_size
        self.image_token_id = getattr(cfg, "image_token_id", None)
        self.layer_types = list(cfg.text_config.layer_types)
        self.sliding_window = cfg.text_config.sliding_window
        eos = model.generation_config.eos_token_id if stop_token_ids is None else list(stop_token_ids)
        if eos is None:
            eos = cfg.text_config.eos_token_id
        self.eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.waiting: List[_Row] = []
        self.active: List[_Row] = []
        self.outputs: List[CanvasOutput] = []
        self.decoder_forwards = 0  # batched decoder calls
        self.row_forwards = 0  # sum over calls of rows in the call
        self.encoder_forwards = 0
        self.cells = 0  # tokens forwarded: encoder tokens + L per decoder row (the sorter's `cells`)
        self.preemptions = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: Any, prompt_ids: Sequence[int], max_tokens: int, seed: int,
                    params: Any = None) -> None:
        p = self.defaults.override(params) if params is not None else self.defaults
        err = p.validate()
        prompt = [int(t) for t in prompt_ids]
        if err is None and (not isinstance(max_tokens, int) or max_tokens < 1):
            err = f"max_tokens must be an integer >= 1, got {max_tokens!r}"
        if err is None and not prompt:
            err = "empty prompt"
        if err is None and any(not 0 <= t < self.V for t in prompt):
            err = f"prompt token ids must be in [0, {self.V})"
        if err is None and self.image_token_id is not None and self.image_token_id in prompt:
            err = "the prompt holds image tokens; blockray serves DiffusionGemma text only"
        if err is None:
            err = budget_refusal(len(prompt), max_tokens, self.L, self.token_budget)
        if err is not None:
            self.outputs.append(RequestOutput(request_id, prompt, [], FinishReason.ERROR, error=err))
            return
        self.waiting.append(_Row(request_id, prompt, max_tokens, p, torch.Generator().manual_seed(int(seed))))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.active)

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int, seeds: Sequence[int],
                 params: Any = None) -> List[CanvasOutput]:
        for i, (p, s) in enumerate(zip(prompts, seeds)):
            self.add_request(i, p, max_tokens, s, params)
        while self.has_unfinished():
            self.step()
        out, self.outputs = sorted(self.outputs, key=lambda o: o.request_id), []
        return out

    # ------------------------------------------------------------------ the loop
    def _area(self, rows: Sequence[_Row]) -> int:
        return sum(r.cur_len + self.L for r in rows)

    def _admit(self) -> None:
        if self.scheduler == SchedulerKind.STATIC and self.active:
            return
        while self.waiting and len(self.active) < self.max_batch_size:
            row = self.waiting[0]
            if self.active and self._area(self.active + [row]) > self.token_budget:
                break
            self.waiting.pop(0)
            self.active.append(row)  # before its prefill: a failing forward fails it with the others
            self._prefill(row)
            if row.canvas is None:  # else a preempted row resumes its canvas
                self._start_canvas(row)

    def _preempt(self) -> None:
        """Recompute preemption (vLLM's policy): while the admitted rows outgrow the token
        budget, the newest one gives back its K/V and waits at the front of the queue.
        The oldest row always stays: it fits alone (add_request checked its full width)."""
        while len(self.active) > 1 and self._area(self.active) > self.token_budget:
            row = self.active.pop()
            row.cache = None
            self.preemptions += 1
            self.waiting.insert(0, row)

    @torch.no_grad()
    def step(self) -> List[CanvasOutput]:
        """Admit, one decoder forward over every active row, commit the canvases that stopped.
        Returns every output so far (`outputs`). A forward that raises propagates: the
        caller (engine.canvas.serve, an EngineCore) fails the active rows (`fail`)."""
        self._preempt()
        self._admit()
        if not self.active:
            return self.outputs
        rows = list(self.active)
        logits = self._decode(rows)
        done = [r for b, r in enumerate(rows) if self._denoise_row(r, logits[b:b + 1])]
        self._commit([r for r in done if not self._ends(r)])
        return self.outputs

    def fail(self, message: str) -> None:
        """Every active row finishes with `message` (a step raised); waiting rows go on."""
        for r in list(self.active):
            self._finish(r, FinishReason.ERROR, error=message)

    # ------------------------------------------------------------------ per row
    def _prefill(self, row: _Row) -> None:
        """transformers' prefill encoder pass (as `generate` calls it at batch size 1):
        writes prompt + committed canvases (a preempted row's recompute) into a new cache."""
        from transformers import DynamicCache

        m = self.model
        row.cache = DynamicCache(config=m.config.get_text_config(decoder=True))
        ids = torch.tensor([row.prompt + row.generated], dtype=torch.long, device=m.device)
        n = ids.shape[1]
        pos = torch.arange(n, dtype=torch.int32, device=m.device).unsqueeze(0)
        attn = torch.ones((1, n), dtype=torch.bool, device=m.device)
        unprocessed, masks = m._prepare_encoder_inputs(input_ids=ids, attention_mask=attn, encoder_position_ids=pos,
                                                       cache=row.cache, is_prefill=True, canvas_length=n,
                                                       batch_size=1)
        m.model.encoder(input_ids=unprocessed, attention_mask=masks, cache=row.cache, position_ids=pos)
        self.encoder_forwards += 1
        self.cells += n

    def _start_canvas(self, row: _Row) -> None:
        p = row.params
        row.canvas = torch.randint(0, self.V, (1, self.L), generator=row.gen).to(self.model.device)
        row.argmax, row.sc_logits, row.cur_step = row.canvas, None, p.max_denoising_steps
        row.stopper = self._g.StableAndConfidentStoppingCriteria(p.stability_threshold, p.confidence_threshold)

    def _gather(self, rows: Sequence[_Row], causal: bool) -> tuple:
        """The rows' caches as one left-padded _BatchCache, and per layer type the boolean
        (B, 1, L, n + L) mask of L new tokens of each row (at positions cur_len.., or, for
        `causal`, the canvas just appended to `generated`, at cur_len - L..) over
        [its cached K/V | the L new]. `causal` (the encoder's commit): key position <= query
        position, and within the sliding window on sliding layers, as transformers' own
        masks at batch size 1; else (the denoiser) every real key."""
        L, dev = self.L, self.model.device
        B = len(rows)
        layers, masks = [], {}
        q = torch.arange(L, device=dev).view(1, L, 1)
        for i, kind in enumerate(self.layer_types):
            ks = [r.cache.layers[i].keys for r in rows]
            vs = [r.cache.layers[i].values for r in rows]
            n = max(k.shape[-2] for k in ks)
            pad = lambda t: torch.nn.functional.pad(t, (0, 0, n - t.shape[-2], 0))
            layers.append(_BatchCache._Layer(torch.cat([pad(k) for k in ks]), torch.cat([pad(v) for v in vs])))
            if kind in masks:
                continue
            held = torch.tensor([k.shape[-2] for k in ks], device=dev).view(B, 1, 1)
            col = torch.arange(n + L, device=dev).view(1, 1, n + L)
            mk = col >= n - held  # a real key: cached (not padding) or new
            if causal:
                rel = col - n - q  # key position minus query position
                mk = mk & (rel <= 0)
                if kind == "sliding_attention" and self.sliding_window:
                    mk = mk & (rel > -self.sliding_window)
            masks[kind] = mk.expand(B, L, n + L).unsqueeze(1).contiguous()
        start = [r.cur_len - (L if causal else 0) for r in rows]
        pos = torch.stack([torch.arange(s, s + L, dtype=torch.int32) for s in start]).to(dev)
        return _BatchCache(layers), masks, pos

    def _decode(self, rows: Sequence[_Row]) -> torch.Tensor:
        """One decoder forward over every row's canvas; (B, L, V) float32 logits."""
        m, L, dev = self.model, self.L, self.model.device
        B = len(rows)
        cache, masks, pos = self._gather(rows, causal=False)
        canvas = torch.cat([r.canvas for r in rows])
        sc_mask = torch.tensor([r.sc_logits is not None for r in rows], device=dev)
        sc = None
        if sc_mask.any():
            dt = m.model.decoder.embed_tokens.weight.dtype
            sc = torch.cat([r.sc_logits if r.sc_logits is not None else torch.zeros((1, L, self.V), dtype=dt,
                                                                                     device=dev) for r in rows])
        out = m(decoder_input_ids=canvas, cache=cache, self_conditioning_logits=sc,
                self_conditioning_mask=None if sc is None or bool(sc_mask.all()) else sc_mask,
                decoder_attention_mask=masks, decoder_position_ids=pos)
        self.decoder_forwards += 1
        self.row_forwards += B
        self.cells += B * L
        return out.logits

    def _denoise_row(self, row: _Row, raw_logits: torch.Tensor) -> bool:
        """transformers' `_denoising_step` for one row at batch size 1, draws from the row's
        generator. True when the canvas is done (stopped, or out of steps)."""
        p, g = row.params, self._g
        cur = torch.tensor(row.cur_step, dtype=torch.int32)
        processed = g.LinearTemperatureScheduleLogitsProcessor(p.t_min, p.t_max, p.max_denoising_steps)(
            None, raw_logits, cur_step=cur)
        probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
        denoiser = torch.multinomial(probs.view(-1, self.V), num_samples=1, generator=row.gen).view(1, self.L)
        new_argmax = torch.argmax(processed, dim=-1)
        sampler = g.EntropyBoundSampler(g.EntropyBoundSamplerConfig(entropy_bound=float(p.entropy_bound)), self.L,
                                        self.V, p.max_denoising_steps)
        accepted = sampler.accept_canvas(row.canvas, denoiser, processed, cur)
        noise = torch.randint(0, self.V, (1, self.L), generator=row.gen).to(accepted.device)
        row.canvas = torch.where(~sampler.accepted_token_mask, noise, accepted)
        stop = bool(row.stopper(new_argmax, processed)[0])
        row.argmax = new_argmax
        row.sc_logits = processed.to(self.model.model.decoder.embed_tokens.weight.dtype)
        row.num_steps += 1
        row.cur_step -= 1
        return stop or row.cur_step == 0

    def _ends(self, row: _Row) -> bool:
        """Appends the finished canvas to the row; True (and the row finished) when it ends
        the row: EOS in it, or max_tokens reached. Such a canvas is never encoded."""
        canvas = row.argmax[0].tolist()
        row.generated += canvas
        if any(t in self.eos for t in canvas):
            cut = len(row.generated) - self.L + next(i for i, t in enumerate(canvas) if t in self.eos) + 1
            toks = row.generated[:cut]
            if len(toks) > row.max_tokens:
                self._finish(row, FinishReason.LENGTH, toks[:row.max_tokens])
            else:
                self._finish(row, FinishReason.STOP, toks)
            return True
        if len(row.generated) >= row.max_tokens:
            self._finish(row, FinishReason.LENGTH, row.generated[:row.max_tokens])
            return True
        return False

    def _commit(self, rows: Sequence[_Row]) -> None:
        """ONE encoder forward writes the last canvas of every row in `rows` (appended to
        `generated`, at positions cur_len - L..) into the rows' caches, then each starts
        its next canvas."""
        if not rows:
            return
        m, L = self.model, self.L
        cache, masks, pos = self._gather(rows, causal=True)
        ids = torch.tensor([r.generated[-L:] for r in rows], dtype=torch.long, device=m.device)
        m.model.encoder(input_ids=ids, attention_mask=masks, cache=cache, position_ids=pos)
        self.encoder_forwards += 1
        self.cells += len(rows) * L
        for i, (k, v) in sorted(cache.written.items()):
            for b, r in enumerate(rows):
                r.cache.layers[i].update(k[b:b + 1], v[b:b + 1])
        for r in rows:
            self._start_canvas(r)

    def _finish(self, row: _Row, reason: FinishReason, tokens: Optional[List[int]] = None,
                error: Optional[str] = None) -> None:
        self.active.remove(row)
        self.outputs.append(RequestOutput(row.request_id, row.prompt, tokens or [], reason, error=error,
                                          num_blocks=math.ceil(len(row.generated) / self.L),
                                          num_steps=row.num_steps))
        row.cache = None


__all__ = ["CanvasEngine", "CanvasOutput"]
