"""Canvas-grained continuous batching for DiffusionGemma.

A row is its prompt plus committed canvases (their K/V written by transformers' encoder
into the row's own DynamicCache, whose sliding layers keep only the window) plus the
canvas being denoised. Every step forwards the canvases of all active rows in ONE
decoder call: the rows' caches are left-padded into one read-only batch cache with a
boolean mask per layer type, positions per row. A row whose canvas stops (stable and
confident, or out of steps) commits it with one encoder pass and starts its next canvas
at the next step; it leaves at EOS or max_tokens; new rows are admitted under the token
budget at any step (`blockserve`), only into an empty batch (`static`), or one at a time
(`sequential`).

Random draws come from a per-request torch.Generator seeded with the request's seed, in
transformers' order (initial canvas; per step the multinomial sample, then the renoise),
so a row's tokens equal `torch.manual_seed(S); model.generate(prompt alone)` whatever
batch it is served in."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import torch

from ..sequence import RequestOutput
from .params import CanvasParams

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


class _ReadOnlyCache:
    """The batch view the decoder reads: per layer, the rows' K/V left-padded to one length
    (transformers' decoder only reads `layers[i].keys/values` and `is_compileable`)."""

    is_compileable = False

    class _Layer:
        def __init__(self, keys: torch.Tensor, values: torch.Tensor):
            self.keys, self.values = keys, values

    def __init__(self, layers: List["_ReadOnlyCache._Layer"]):
        self.layers = layers


class CanvasEngine:
    """Serves DiffusionGemma requests; `model` is transformers' DiffusionGemmaForBlockDiffusion."""

    def __init__(self, model, defaults: CanvasParams, scheduler: str = "blockserve", max_batch_size: int = 64,
                 token_budget: int = 65536, stop_token_ids: Optional[Sequence[int]] = None):
        from transformers.models.diffusion_gemma import generation_diffusion_gemma as g

        if scheduler not in ("blockserve", "static", "sequential"):
            raise ValueError(f"scheduler must be blockserve, static or sequential, got {scheduler!r}")
        self._g = g
        self.model, self.defaults, self.scheduler = model, defaults, scheduler
        self.max_batch_size = 1 if scheduler == "sequential" else max_batch_size
        self.token_budget = token_budget
        cfg = model.config
        self.L, self.V = cfg.canvas_length, cfg.text_config.vocab_size
        self.image_token_id = getattr(cfg, "image_token_id", None)
        self.layer_types = list(cfg.text_config.layer_types)
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
        if err is None and len(prompt) + math.ceil(max_tokens / self.L) * self.L > self.token_budget:
            err = f"prompt + max_tokens exceed the token budget {self.token_budget}"
        if err is not None:
            self.outputs.append(RequestOutput(request_id, prompt, [], "error", error=err))
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
        if self.scheduler == "static" and self.active:
            return
        while self.waiting and len(self.active) < self.max_batch_size:
            row = self.waiting[0]
            if self.active and self._area(self.active + [row]) > self.token_budget:
                break
            self.waiting.pop(0)
            self._encode(row, row.prompt, 0, prefill=True)
            self._start_canvas(row)
            self.active.append(row)

    @torch.no_grad()
    def step(self) -> List[CanvasOutput]:
        """Admit, one decoder forward over every active row, commit the canvases that stopped.
        Returns every output so far (`outputs`)."""
        self._admit()
        if not self.active:
            return self.outputs
        rows = list(self.active)
        try:
            logits = self._decode(rows)
        except Exception as exc:  # one failing forward fails its rows, never the engine
            for r in rows:
                self._finish(r, "error", error=f"{type(exc).__name__}: {exc}")
            return self.outputs
        for b, r in enumerate(rows):
            if self._denoise_row(r, logits[b:b + 1]):
                self._commit(r)
        return self.outputs

    # ------------------------------------------------------------------ per row
    def _encode(self, row: _Row, tokens: Sequence[int], start: int, prefill: bool) -> None:
        """transformers' encoder pass (as `generate` calls it at batch size 1): writes
        `tokens` at positions start.. into the row's cache."""
        from transformers import DynamicCache

        m = self.model
        if row.cache is None:
            row.cache = DynamicCache(config=m.config.get_text_config(decoder=True))
        ids = torch.tensor([row.prompt + row.generated], dtype=torch.long, device=m.device)
        n = len(tokens)
        pos = torch.arange(start, start + n, dtype=torch.int32, device=m.device).unsqueeze(0)
        attn = torch.ones((1, ids.shape[1]), dtype=torch.bool, device=m.device)
        unprocessed, masks = m._prepare_encoder_inputs(input_ids=ids, attention_mask=attn, encoder_position_ids=pos,
                                                       cache=row.cache, is_prefill=prefill, canvas_length=n,
                                                       batch_size=1)
        m.model.encoder(input_ids=unprocessed, attention_mask=masks, cache=row.cache, position_ids=pos)
        self.encoder_forwards += 1

    def _start_canvas(self, row: _Row) -> None:
        p = row.params
        row.canvas = torch.randint(0, self.V, (1, self.L), generator=row.gen).to(self.model.device)
        row.argmax, row.sc_logits, row.cur_step = row.canvas, None, p.max_denoising_steps
        row.stopper = self._g.StableAndConfidentStoppingCriteria(p.stability_threshold, p.confidence_threshold)

    def _decode(self, rows: Sequence[_Row]) -> torch.Tensor:
        """One decoder forward over every row's canvas; (B, L, V) float32 logits."""
        m, L, dev = self.model, self.L, self.model.device
        B = len(rows)
        layers, masks = [], {}
        for i, kind in enumerate(self.layer_types):
            ks = [r.cache.layers[i].keys for r in rows]
            vs = [r.cache.layers[i].values for r in rows]
            n = max(k.shape[-2] for k in ks)
            pad = lambda t: torch.nn.functional.pad(t, (0, 0, n - t.shape[-2], 0))
            layers.append(_ReadOnlyCache._Layer(torch.cat([pad(k) for k in ks]), torch.cat([pad(v) for v in vs])))
            if kind not in masks:
                mk = torch.zeros((B, 1, L, n + L), dtype=torch.bool, device=dev)
                for b, k in enumerate(ks):
                    mk[b, :, :, n - k.shape[-2]:] = True
                masks[kind] = mk
        canvas = torch.cat([r.canvas for r in rows])
        pos = torch.stack([torch.arange(r.cur_len, r.cur_len + L, dtype=torch.int32) for r in rows]).to(dev)
        sc_mask = torch.tensor([r.sc_logits is not None for r in rows], device=dev)
        sc = None
        if sc_mask.any():
            dt = m.model.decoder.embed_tokens.weight.dtype
            sc = torch.cat([r.sc_logits if r.sc_logits is not None else torch.zeros((1, L, self.V), dtype=dt,
                                                                                     device=dev) for r in rows])
        out = m(decoder_input_ids=canvas, cache=_ReadOnlyCache(layers), self_conditioning_logits=sc,
                self_conditioning_mask=None if sc is None or bool(sc_mask.all()) else sc_mask,
                decoder_attention_mask=masks, decoder_position_ids=pos)
        self.decoder_forwards += 1
        self.row_forwards += B
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

    def _commit(self, row: _Row) -> None:
        canvas = row.argmax[0].tolist()
        start = row.cur_len
        row.generated += canvas
        if any(t in self.eos for t in canvas):
            cut = len(row.generated) - self.L + next(i for i, t in enumerate(canvas) if t in self.eos) + 1
            toks = row.generated[:cut]
            if len(toks) > row.max_tokens:
                return self._finish(row, "length", toks[:row.max_tokens])
            return self._finish(row, "stop", toks)
        if len(row.generated) >= row.max_tokens:
            return self._finish(row, "length", row.generated[:row.max_tokens])
        self._encode(row, canvas, start, prefill=False)
        self._start_canvas(row)

    def _finish(self, row: _Row, reason: str, tokens: Optional[List[int]] = None,
                error: Optional[str] = None) -> None:
        self.active.remove(row)
        self.outputs.append(RequestOutput(row.request_id, row.prompt, tokens or [], reason, error=error,
                                          num_blocks=math.ceil(len(row.generated) / self.L),
                                          num_steps=row.num_steps))
        row.cache = None


__all__ = ["CanvasEngine", "CanvasOutput"]
