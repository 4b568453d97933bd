"""Named decoding settings (`blockray --preset NAME`, or `preset(NAME)` in Python): a
published method's recommended EngineConfig and SamplingParams values for a task, so a
user does not copy five numbers from a paper's scripts.

The D2F presets are D2F-LLaDA's evaluation settings, from
zhijie-group/Discrete-Diffusion-Forcing, D2F-eval/eval_llada.sh (commit 771f745):
gsm8k `block_size=64 block_add_threshold=0.7 decoded_token_threshold=0.95
skip_threshold=0.9`, humaneval `block_size=32 block_add_threshold=0.1
decoded_token_threshold=0.95 skip_threshold=0.9`, both `max_new_tokens=512
temperature=0`; D2F caches completed blocks (blockray: cache "persistent"). They need a
block-causal model (D2F-LLaDA: LLaDA-8B-Instruct with the D2F LoRA adapter, attention
block_causal).

The Dream-Coder presets are Dream-org/Dream-Coder-v0-Instruct-7B's evaluation settings
from DreamLM/Dream-Coder (commit 87409da): cruxeval runs `scripts/generate.py
--config_name cruxeval_entropy` (instruct/src/inference/generation_config.yaml: 768 tokens,
768 steps, temperature 0.1, top_p 0.95, alg entropy, alg_temp 0, no cache), bigcodebench
`--diffusion_steps 1024 --max_new_tokens 1024 --top_p 0.9 --alg entropy --alg_temp 0.0
--temperature 0.1` (instruct/code_eval/README.md). Both are Dream's own diffusion_generate
(`dream_generate`: one block of max_new_tokens, no first-position rule, no cache): exact
for any model of the Dream family (DiffuCoder too).

The TraDo presets are Gen-Verse/dLLM-RL's evaluation settings for TraDo and SDAR
(configs/trado_eval.yaml, sdar_eval.yaml: the same rollout; trado_longcot_eval.yaml; commit
10b4fd1): `block_size: 4 denoising_steps_per_block: 4 remasking_strategy:
low_confidence_dynamic dynamic_threshold: 0.9 temperature: 1.0 top_k: 0 top_p: 1.0`,
`max_token` 2000 (long-CoT: 10000). Their engine (JetEngine) stops at the tokenizer's
eos_token <|endoftext|> 151643 and the config's `stop_token_list` (long-CoT: <|im_end|>
151645), so the presets name those ids; blocks are cached once complete (blockray: cache
"persistent"). For SDAR / TraDo checkpoints (model_type sdar, sdar_moe) only.

The llada2.2 preset is LLaDA2.2-flash's generate() defaults (its edit loop, engine.indel), as
FLX-OSS/FluxServe's LLaDA2.2 guide reports them (the HF file is not readable first-hand)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, Optional, Tuple

from .config import EngineConfig, SamplingParams


@dataclass(frozen=True)
class Preset:
    engine: Dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    sampling: Dict[str, Any] = field(default_factory=dict)  # SamplingParams fields
    source: str = ""


# Dream's diffusion_generate `alg` (generation_utils.py `_sample`, shipped unchanged by DiffuCoder
# and Dream-Coder) as blockray's policy and remasking; its alg_temp is SamplingParams.alg_temp
DREAM_ALGS: Dict[str, Dict[str, str]] = {
    "maskgit_plus": dict(policy="timestep", remasking="low_confidence"),
    "topk_margin": dict(policy="timestep", remasking="margin"),
    "entropy": dict(policy="timestep", remasking="entropy"),
    "origin": dict(policy="origin", remasking="low_confidence"),
}


def dream_generate(alg: str, max_new_tokens: int, steps: int, source: str = "", **sampling: Any) -> Preset:
    """Dream's `diffusion_generate(max_new_tokens=, steps=, alg=, **sampling)` (alg_temp among them):
    the answer is one block of max_new_tokens masks decoded in `steps` steps over the whole
    canvas (no first-position rule; every step recomputes every column, as Dream's loop)."""
    return Preset(engine=dict(block_length=max_new_tokens, steps_per_block=steps, cache="none"),
                  sampling=dict(max_new_tokens=max_new_tokens, first_position=False, **DREAM_ALGS[alg], **sampling),
                  source=source)


_D2F_LLADA = "zhijie-group/Discrete-Diffusion-Forcing D2F-eval/eval_llada.sh (commit 771f745)"
_DREAM_CODER = "DreamLM/Dream-Coder (commit 87409da)"
_TRADO = "Gen-Verse/dLLM-RL (commit 10b4fd1) configs"
PRESETS: Dict[str, Preset] = {
    "d2f-gsm8k": Preset(
        engine=dict(block_length=64, cache="persistent"),
        sampling=dict(block_add_threshold=0.7, decoded_token_threshold=0.95, threshold=0.9, max_new_tokens=512,
                      temperature=0.0, policy="threshold", remasking="low_confidence"),
        source=f"{_D2F_LLADA}, gsm8k"),
    "d2f-humaneval": Preset(
        engine=dict(block_length=32, cache="persistent"),
        sampling=dict(block_add_threshold=0.1, decoded_token_threshold=0.95, threshold=0.9, max_new_tokens=512,
                      temperature=0.0, policy="threshold", remasking="low_confidence"),
        source=f"{_D2F_LLADA}, humaneval"),
    "dream-coder-cruxeval": dream_generate(
        "entropy", 768, 768, temperature=0.1, top_p=0.95,
        source=f"{_DREAM_CODER} instruct/src/inference/generation_config.yaml, cruxeval_entropy"),
    "dream-coder-bigcodebench": dream_generate(
        "entropy", 1024, 1024, temperature=0.1, top_p=0.9,
        source=f"{_DREAM_CODER} instruct/code_eval/README.md, bigcodebench"),
    "trado-eval": Preset(
        engine=dict(block_length=4, steps_per_block=4, cache="persistent"),
        sampling=dict(policy="threshold", remasking="low_confidence", threshold=0.9, temperature=1.0, top_k=0,
                      top_p=1.0, max_new_tokens=2000, stop_token_ids=[151643]),
        source=f"{_TRADO}/trado_eval.yaml (sdar_eval.yaml: the same)"),
    "trado-longcot-eval": Preset(
        engine=dict(block_length=4, steps_per_block=4, cache="persistent"),
        sampling=dict(policy="threshold", remasking="low_confidence", threshold=0.9, temperature=1.0, top_k=0,
                      top_p=1.0, max_new_tokens=10000, stop_token_ids=[151643, 151645]),
        source=f"{_TRADO}/trado_longcot_eval.yaml"),
    # LLaDA2.2's generate() defaults (../shared/checkpoints/REFERENCES.md "LLaDA2.2-flash", located second-hand:
    # FLX-OSS/FluxServe dev-notes/llada2.2-model-support-development-guide.md section 2): the edit loop
    "llada2.2": Preset(
        engine=dict(block_length=32, steps_per_block=32, cache="persistent"),
        sampling=dict(edit_ops=True, threshold=0.5, edit_threshold=0.0, max_post_steps=16, max_steps_per_block=1000,
                      temperature=0.0),
        source="inclusionAI/LLaDA2.2-flash generate() defaults, as FLX-OSS/FluxServe's LLaDA2.2 guide reports them"),
}


def get(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None


def preset(name: str, engine: Optional[EngineConfig] = None,
           sampling: Optional[SamplingParams] = None) -> Tuple[EngineConfig, SamplingParams]:
    """`engine` and `sampling` (default: the defaults) with preset `name` applied."""
    p = get(name)
    return replace(engine or EngineConfig(), **p.engine), replace(sampling or SamplingParams(), **p.sampling)
