"""DiffusionGemma (google/diffusiongemma-26B-A4B-it; model_type "diffusion_gemma"): a Gemma 4
backbone (sliding and global layers with two RoPE bases, QK norm, final logit softcap,
128 experts top-8 plus a shared MLP, scaled embeddings) run as a causal encoder that
writes a K/V cache and a bidirectional denoiser over a random canvas with
self-conditioning. Not a masked-diffusion model: there is no mask token and no block
schedule. Its network is transformers' own DiffusionGemmaForBlockDiffusion (native in
transformers, never remote code), which reads every key of config.json, driven by
engine.canvas (serving mode CANVAS, engine.serving: it names no weights of blockray's
transformer). The ModelConfig parsed here is approximate (its text
backbone's widths, layer count, heads, vocabulary and context; the MoE width one token
computes as a dense MLP): what the sorter's cost model and the preflight's vocabulary
check need; it never builds a network. Torch-free."""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from ...serving import CANVAS
from .base import ConfigRefused, Family, Shard

# transformers' DiffusionGemmaGenerationConfig default (checked by tests/test_diffusion_gemma.py):
# read here without importing transformers, since the sorter runs in data-side workers.
DEFAULT_MAX_DENOISING_STEPS = 48


class DiffusionGemmaFamily(Family):
    def check_config(self, hf: Mapping[str, Any]) -> None:
        """What the canvas engine needs beyond what transformers' class reads."""
        tc: Optional[Mapping[str, Any]] = hf.get("text_config")
        if not isinstance(tc, Mapping):
            raise ConfigRefused("config.json of a diffusion_gemma checkpoint has no text_config")
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "layer_types"):
            if key not in tc:
                raise ConfigRefused(f"config.json text_config lacks {key!r}")
        if not isinstance(hf.get("canvas_length", 256), int) or hf.get("canvas_length", 256) < 1:
            raise ConfigRefused(f"config.json canvas_length={hf.get('canvas_length')!r} must be an integer >= 1")

    def parse(self, hf: Mapping[str, Any]) -> Dict[str, Any]:
        tc = hf["text_config"]
        heads = int(tc.get("num_attention_heads", 8))
        width = int(tc.get("intermediate_size", 4 * tc["hidden_size"]))
        if tc.get("enable_moe_block"):
            width += int(tc.get("moe_intermediate_size", 0)) * int(tc.get("top_k_experts", 0))
        eos = tc.get("eos_token_id", 1)
        return dict(model_type=self.model_type, vocab_size=int(tc["vocab_size"]), hidden_size=int(tc["hidden_size"]),
                    n_layers=int(tc["num_hidden_layers"]), n_heads=heads,
                    n_kv_heads=int(tc.get("num_key_value_heads", heads)), intermediate_size=width,
                    mask_token_id=int(tc.get("pad_token_id") or 0),
                    eos_token_id=int(eos[0] if isinstance(eos, list) else eos),
                    max_seq_len=int(tc.get("max_position_embeddings", 131072)))

    def to_hf(self, cfg: Any) -> Dict[str, Any]:
        return {"model_type": self.model_type}  # approximate: never written back as a checkpoint

    @staticmethod
    def canvas_length(hf: Mapping[str, Any]) -> int:
        return int(hf.get("canvas_length", 256))

    @staticmethod
    def denoising_steps(sampling: Any, generation: Mapping[str, Any]) -> int:
        """The most decoder steps a canvas takes: the request's max_denoising_steps, else
        generation_config.json's, else transformers' default (the sorter's cost model)."""
        steps = sampling.max_denoising_steps or generation.get("max_denoising_steps")
        return int(steps or DEFAULT_MAX_DENOISING_STEPS)


DIFFUSION_GEMMA = DiffusionGemmaFamily(
    name="DiffusionGemma", model_type="diffusion_gemma", examples="google/diffusiongemma-26B-A4B-it",
    honoured=frozenset(), fixed={}, serving=CANVAS,
    # tensor parallel (engine.canvas.sharding), by transformers' module names; embedding and LM head replicated
    sharding={"q_proj": Shard.COLUMN, "k_proj": Shard.KV, "v_proj": Shard.KV, "o_proj": Shard.ROW,
              "gate_proj": Shard.COLUMN, "up_proj": Shard.COLUMN, "down_proj": Shard.ROW, "experts": Shard.EXPERT})
