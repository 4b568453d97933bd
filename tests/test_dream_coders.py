"""DiffuCoder (apple/DiffuCoder-7B-Instruct, -cpGRPO) and Dream-Coder
(Dream-org/Dream-Coder-v0-Instruct-7B) against the decoding they publish: Dream's own
`diffusion_generate`, token for token in float64.

Their checkpoints are model_type "Dream" and ship Dream's modeling_dream.py and
generation_utils.py (DiffuCoder's card: "we reuse Dream's modeling architecture and
generation utils"); their READMEs call `diffusion_generate(max_new_tokens, steps,
temperature, top_p, alg, alg_temp=0)`. `diffusion_generate` below transcribes
DreamGenerationMixin._sample and sample_tokens (generation_utils.py of Dream-v0, vendored in
vivaikmalik/drug-dreaming @8c90769) for one request, in float64, with its own loop:

- the canvas is the prompt plus max_new_tokens masks, positions 0..n-1, every column
  attending to every column, every step recomputing every column; logits shifted right by
  one (`cat([l[:1], l[:-1]])`);
- sample_tokens: logits / temperature (when > 0), then top-p (a token goes once the sorted
  mass before it exceeds top_p), then top-k, then softmax; the proposal is the argmax at
  temperature 0, else a draw from that distribution, whose probability of it is the
  confidence (maskgit_plus), or its top-1 minus top-2 (topk_margin), or its negative entropy
  (entropy);
- steps timesteps t = linspace(1, eps=1e-3, steps + 1): `origin` unmasks each mask with
  probability 1 - s/t, the other algs the int(n_mask * (1 - s/t)) most confident masks (all
  at the last step); with alg_temp > 0, those positions drawn by torch.multinomial (without
  replacement) from softmax(confidence / alg_temp).

Two conventions are the engine's own, where the published loop leaves the result to torch:
the noise (torch's global RNG there): a generator seeded per (request seed, tokens before the
block, step) draws a Gumbel per (position, token) over the block, whose argmax over the
processed logits is the Categorical draw, then (origin) one uniform per position, then
(alg_temp > 0) a Gumbel per position, whose top-k over log-softmax(confidence / alg_temp) is
the multinomial draw without replacement (test_alg_temp_draws_as_dreams_multinomial); and ties
between equal confidences go to the lower position, where `torch.topk` leaves their order to
its kernel (on the CPU a short row picks 6 before 4). Ties are common under the published
settings: a position whose top-p nucleus is one token has confidence 1 and entropy 1e-10.

The engine decodes the same 12 requests in one mixed batch as `engine.presets.dream_generate`
maps them (one block of max_new_tokens, no first-position rule, no cache), under blockserve
(block and step advance, a budget that makes rows wait), static and sequential.
"""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

import published
from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model
from engine.models.families import ConfigRefused, Confidence, family_for
from engine.presets import DREAM_ALGS, dream_generate

torch.set_num_threads(1)
G, S = 8, 4  # max_new_tokens (the one block) and diffusion steps
# The coders' own metadata files are in no stored source byte for byte (their Hugging Face
# pages only): Dream-v0-Instruct's published files stand for the architecture they share
# (model_type "Dream", the same ids and tokenizer), and the test runs the coders' settings.
DREAM = "Dream-org__Dream-v0-Instruct-7B"
EOS, IM_END = 151643, 151645  # config.json eos_token_id; <|im_end|>, the chat template's end of turn
STOPS = [EOS, IM_END]


@pytest.fixture(scope="module")
def model():
    """Dream-v0-Instruct's published config.json, sizes shrunk (vocab 152064 and every id
    kept), random float64 weights: the output layer sharpened so that top-p drops tokens,
    and the stop tokens' rows copies of two other tokens' so that rows hit them."""
    m = build_model(ModelConfig.from_hf(published.shrink(published.config(DREAM))), dtype=torch.float64, seed=0)
    with torch.no_grad():
        w = m.lm_head.weight
        w.mul_(8.0)
        w[EOS], w[IM_END] = 1.02 * w[82327], 1.02 * w[101614]  # two tokens some answers hold
    return m


# --- the published loop ---------------------------------------------------------------
def top_p_logits(logits, top_p):
    sorted_logits, sorted_indices = torch.sort(logits, descending=True)
    cumulative_probs = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    remove = cumulative_probs > top_p
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = 0
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, sorted_indices, remove)
    return logits.masked_fill(mask, torch.finfo(logits.dtype).min)


def top_k_logits(logits, top_k):
    top_k = min(top_k, logits.size(-1))
    return logits.masked_fill(logits < torch.topk(logits, top_k)[0][..., -1, None], torch.finfo(logits.dtype).min)


def sample_tokens(logits, temperature, top_p, top_k, gumbel=None, margin_confidence=False, neg_entropy=False,
                  processed=True):
    """Dream's sample_tokens; `gumbel` [N, V]: the Categorical draw's noise. `processed=False`
    is the rule it does not follow (the model's own distribution ranks), for the check below."""
    raw = torch.softmax(logits, dim=-1)  # the model's own distribution
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = top_p_logits(logits, top_p)
    if top_k is not None:
        logits = top_k_logits(logits, top_k)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        x0 = (logits + gumbel).argmax(-1)
        confidence = torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
    else:
        confidence, x0 = probs.max(dim=-1)
    if not processed:
        probs, confidence = raw, raw.gather(-1, x0[:, None])[:, 0]
    if margin_confidence:
        top2 = torch.sort(probs, dim=-1, descending=True)[0]
        confidence = top2[:, 0] - top2[:, 1]
    if neg_entropy:
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return confidence, x0


def diffusion_generate(model, prompt, alg, sp: SamplingParams, steps=S, processed=True):
    """DreamGenerationMixin._sample for one request (no padding: attention "full"), then
    blockray's cut at the first stop id."""
    mask_id, g = model.config.mask_token_id, sp.max_new_tokens
    x = torch.tensor([prompt + [mask_id] * g])
    n, p = x.shape[1], len(prompt)
    pos, keys = torch.arange(n)[None], torch.ones(1, 1, 1, n, dtype=torch.bool)
    temperature, top_p, top_k = sp.temperature, sp.top_p, (sp.top_k or None)
    timesteps = torch.linspace(1, 1e-3, steps + 1)
    for i in range(steps):
        mask_index = x == mask_id
        with torch.no_grad():
            logits = model(x, pos, keys, None, 0)[0].double()
        logits = torch.cat([logits[:1], logits[:-1]])[None]
        t, s = timesteps[i], timesteps[i + 1]
        gumbel = drawn = positions = None
        if temperature > 0 or alg == "origin" or sp.alg_temp > 0:  # the engine's noise: the block's
            gen = torch.Generator().manual_seed(hash((sp.seed, 0, i)) & (2**62 - 1))  # Gumbel, then uniforms
            if temperature > 0:
                gumbel = -torch.log(-torch.log(torch.rand((g, logits.shape[-1]), generator=gen, dtype=torch.float64)))
            if alg == "origin":
                drawn = torch.rand(g, generator=gen, dtype=torch.float64)
            if sp.alg_temp > 0:  # a Gumbel per position: the multinomial draw of the positions
                positions = -torch.log(-torch.log(torch.rand(g, generator=gen, dtype=torch.float64)))
        cols = mask_index[0, p:]  # the masked answer positions, in order
        mask_logits = logits[mask_index]
        noise = None if gumbel is None else gumbel[cols]
        if alg == "origin":
            p_transfer = 1 - s / t if i < steps - 1 else 1
            x0 = torch.zeros_like(x[mask_index]) + mask_id
            transfer = drawn[cols] < p_transfer
            if transfer.any():
                _, x0[transfer] = sample_tokens(mask_logits[transfer], temperature, top_p, top_k,
                                                None if noise is None else noise[transfer])
            x[mask_index] = x0.clone()
            continue
        confidence, x0 = sample_tokens(mask_logits, temperature, top_p, top_k, noise, processed=processed,
                                       margin_confidence=alg == "topk_margin", neg_entropy=alg == "entropy")
        num_mask_token = mask_index.sum() / mask_index.shape[0]
        k = int(num_mask_token * (1 - s / t)) if i < steps - 1 else int(num_mask_token)
        full_confidence = torch.full_like(x, -torch.inf, dtype=logits.dtype)
        full_confidence[mask_index] = confidence
        if k > 0 and sp.alg_temp > 0:  # multinomial(softmax(full_confidence / alg_temp), k): without
            # replacement, the top-k of log-probabilities plus Gumbel noise
            full_confidence = torch.log_softmax(full_confidence / sp.alg_temp, dim=-1)
            full_confidence[0, p:] += positions
        if k > 0:
            transfer_index = full_confidence.sort(descending=True, stable=True).indices[:, :k]  # topk, ties by position
            x_ = torch.zeros_like(x) + mask_id
            x_[mask_index] = x0.clone()
            x[0, transfer_index[0]] = x_[0, transfer_index[0]]
    gen_ = x[0, p:].tolist()
    stops = [j for j, tok in enumerate(gen_) if tok in sp.stop_token_ids]
    return gen_[: stops[0]] if stops else gen_


# --- the engine against it --------------------------------------------------------------
# (alg, sampling): the four algs greedy, top-p / top-k at temperature 0 (they still change the
# ranking distribution), DiffuCoder's and Dream-Coder's README settings (sampled); top-p sorts
# the 152,064-token vocabulary, so three rows only
KINDS = [("maskgit_plus", {}), ("entropy", {}), ("topk_margin", {}), ("origin", dict(seed=3)),
         ("maskgit_plus", dict(top_p=0.9)), ("entropy", dict(top_k=40)),
         ("entropy", dict(temperature=0.4, top_p=0.95, seed=5)),  # DiffuCoder's README
         ("maskgit_plus", dict(temperature=0.1, top_p=0.95, seed=7)),  # Dream-Coder's generation_config.yaml default
         ("origin", dict(temperature=0.5, seed=9)), ("topk_margin", dict(top_k=3, alg_temp=0.2, seed=13)),
         ("entropy", dict(alg_temp=2.0, seed=15)), ("origin", dict(seed=11))]


def workload(seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(0, EOS) for _ in range(rng.randint(1, 24))] for _ in KINDS]
    preset = [dream_generate(alg, G, S, stop_token_ids=STOPS, **kw) for alg, kw in KINDS]
    return prompts, [alg for alg, _ in KINDS], [SamplingParams(**p.sampling) for p in preset], preset[0].engine


@pytest.fixture(scope="module")
def reference(model):
    prompts, algs, params, engine = workload()
    return prompts, algs, params, engine, [diffusion_generate(model, pr, a, sp)
                                           for pr, a, sp in zip(prompts, algs, params)]


@pytest.mark.parametrize("scheduler,advance,budget", [("blockserve", "block", 2048), ("blockserve", "step", 100),
                                                      ("static", "block", 2048), ("sequential", "block", 2048)])
def test_the_engine_decodes_as_diffusion_generate(model, reference, scheduler, advance, budget):
    prompts, _, params, engine, ref = reference
    eng = Engine(model, EngineConfig(scheduler=scheduler, advance=advance, token_budget=budget, max_batch_size=12,
                                     **engine), record_batches=True)
    outs = eng.generate(prompts, params)
    assert [o.error for o in outs] == [None] * len(prompts)
    if scheduler != "sequential":
        assert max(len(b.request_ids) for b in eng.batch_log) > 1  # mixed batches
    if budget < 2048:  # rows waited for room, admitted as others finished
        assert max(len(b.request_ids) for b in eng.batch_log) < len(prompts)
    assert [o.token_ids for o in outs] == ref
    assert {o.finish_reason for o in outs} == {"stop", "length"}  # the published stop ids cut some rows


def test_the_sampled_distribution_ranks_the_positions(model, reference):
    """Dream ranks positions by the distribution it samples from (top-p applied even at
    temperature 0): ranking by the model's own distribution (Confidence.MODEL, LLaDA's rule)
    gives other tokens on these rows, so the test above would catch that rule."""
    prompts, algs, params, _, ref = reference
    rows = [i for i, sp in enumerate(params) if (sp.top_p < 1 or sp.temperature > 0) and algs[i] != "origin"]
    other = [diffusion_generate(model, prompts[i], algs[i], params[i], processed=False) for i in rows]
    assert sum(o != ref[i] for o, i in zip(other, rows)) >= 2


def test_dream_loads_with_its_ids_and_sampled_confidence():
    """Dream's published config.json (the coders' architecture): the Dream family, its mask /
    eos / pad ids as published, its decoding traits Dream's; the RL-era key Dream-Coder's demo
    names (`eos_penalty`, read by its generation_utils.py, not by blockray) is refused, not
    ignored."""
    hf = published.config(DREAM)
    family = family_for(hf)
    assert (family.name, family.shift_logits, family.confidence) == ("Dream", True, Confidence.SAMPLED)
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.rope_theta) == (151666, EOS, EOS, 1e6)
    with pytest.raises(ConfigRefused, match="'eos_penalty'"):
        ModelConfig.from_hf(dict(hf, eos_penalty=3.0))
    # DiffuCoder-7B-Instruct's config.json, as its model page shows it (no copy of the file is
    # stored anywhere: ../shared/checkpoints/apple__DiffuCoder-7B-Instruct/SOURCE.md), differs
    # from Dream-v0's in keys that cannot change the math only
    diffucoder = dict(hf, _name_or_path="apple/DiffuCoder-7B-Instruct", transformers_version="4.51.3",
                      use_cache=False)
    assert replace(ModelConfig.from_hf(diffucoder), extra={}) == replace(cfg, extra={})  # extra: keys passed through
    assert set(DREAM_ALGS) == {"maskgit_plus", "topk_margin", "entropy", "origin"}
    assert "remasking" in replace(SamplingParams(), policy="origin", remasking="entropy").validate()


def test_the_alg_temp_rows_are_not_the_top_k(model, reference):
    """The rows with alg_temp > 0 decode otherwise at alg_temp 0: the equality above checks
    the draw of their positions."""
    prompts, algs, params, _, ref = reference
    rows = [i for i, sp in enumerate(params) if sp.alg_temp > 0]
    assert len(rows) == 2
    assert all(diffusion_generate(model, prompts[i], algs[i], replace(params[i], alg_temp=0.0)) != ref[i] for i in rows)


def test_alg_temp_draws_as_dreams_multinomial():
    """alg_temp > 0: the engine's Gumbel top-k of confidence / alg_temp (propose, then the
    timestep policy's top-k) picks each pair of positions as often as Dream's
    torch.multinomial(softmax(confidence / alg_temp), 2) without replacement, within 5
    standard errors over 4000 seeded draws; and it needs the timestep policy."""
    from itertools import permutations

    from engine.decoding import RowParams, propose

    logits = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    need = torch.ones(1, 4, dtype=torch.bool)
    sp = SamplingParams(policy="timestep", alg_temp=0.3, seed=0)
    _, conf = propose(logits, RowParams.build([replace(sp, alg_temp=0.0)], [None], "cpu"), None, need)
    w = torch.softmax(conf[0] / sp.alg_temp, -1).tolist()
    exact = {frozenset((i, j)): 0.0 for i, j in permutations(range(4), 2)}
    for i, j in permutations(range(4), 2):
        exact[frozenset((i, j))] += w[i] * w[j] / (1 - w[i])
    n, counts = 4000, {k: 0 for k in exact}
    rp = RowParams.build([sp], [0], "cpu")
    for key in range(n):
        _, c = propose(logits, rp, [key], need)
        counts[frozenset(c[0].topk(2).indices.tolist())] += 1
    for pair, prob in exact.items():
        assert abs(counts[pair] / n - prob) <= 5 * (prob * (1 - prob) / n) ** 0.5 + 1e-9, (pair, counts[pair] / n, prob)
    assert "alg_temp" in replace(sp, policy="threshold").validate()
