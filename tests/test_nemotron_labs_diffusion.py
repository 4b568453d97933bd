"""Issue 54: Nemotron-Labs-Diffusion (model_type nemotron_labs_diffusion) exact against its
published code.

The forward: blockray's transformer against transformers' built-in Ministral3Model (the
published model's `encoder`, NOT remote code) in float64, weights mapped from the
checkpoint names (`encoder.*`, `diffusion_head.weight`), on a tiny model from the located
8B config (sizes shrunk, YaRN's and Llama-4's parameters kept and pushed where they act:
a small original_max_position_embeddings so that positions past it scale q, an attention
factor != 1), causally and with the current block bidirectional against a causal prefix.
transformers computes RoPE's frequencies and angles in float32 even in a float64 model
(blockray: float64), hence the forward's tolerance there; the decoding tests below compare
against a float64 transcription (`PublishedNemotron`) at 1e-12.

CONFIG is the 8B config.json as located (../shared/checkpoints/nvidia__Nemotron-Labs-
Diffusion-8B/SOURCE.md: FLX-OSS/FluxServe test/runtime/data/nemotron_checkpoints/8B/
config.json at index commit bba0797, "Official configuration ... HF revision 16c67f05"),
rebuilt key for key from the located values (no byte copy is reachable)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import ModelConfig, build_model
from engine.models.families import ConfigRefused

torch.set_num_threads(1)

CONFIG = {
    "ar_loss_weight": 1.0, "architectures": ["NemotronLabsDiffusionModel"], "attention_bias": False,
    "attention_dropout": 0.0, "attn_implementation": "sdpa",
    "auto_map": {"AutoConfig": "configuration_nemotron_labs_diffusion.NemotronLabsDiffusionConfig",
                 "AutoModel": "modeling_nemotron_labs_diffusion.NemotronLabsDiffusionModel"},
    "block_size": 32, "bos_token_id": 1, "dlm_loss_weight": None, "dlm_paradigm": "bidirectional",
    "dp_varying_mask_ratio": False, "eos_token_id": 11, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "mask_token_id": 100, "max_position_embeddings": 262144,
    "mlp_bias": False, "model_type": "nemotron_labs_diffusion", "num_attention_heads": 32, "num_hidden_layers": 34,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 16.0, "llama_4_scaling_beta": 0.1,
                        "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 16384,
                        "rope_theta": 1000000.0, "rope_type": "yarn"},
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "5.0.0",
    "use_cache": False, "vocab_size": 131072}

VOCAB, MASK, EOS = 128, 100, 11


def tiny_config(**rope) -> dict:
    """CONFIG with its sizes shrunk; `rope` overrides rope_parameters' values."""
    return {**CONFIG, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "vocab_size": VOCAB, "max_position_embeddings": 4096,
            "rope_parameters": {**CONFIG["rope_parameters"], **rope}}


# positions past original_max_position_embeddings (8) scale q; mscale 2 makes the attention factor != 1
ACTIVE_ROPE = dict(original_max_position_embeddings=8, factor=4.0, mscale=2.0, rope_theta=10000.0)


def tiny_model(seed: int = 0, **rope):
    cfg = ModelConfig.from_hf(tiny_config(**rope))
    model = build_model(cfg, dtype=torch.float64, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
        model.lm_head.weight[MASK] = 0.0  # never proposes the mask itself, as a trained model
    return model


def checkpoint(model):
    cfg = model.config
    return {cfg.family.checkpoint_name(n): p.detach().double() for n, p in model.named_parameters()}


def hf_encoder(model, **rope):
    """transformers' Ministral3Model with the checkpoint's encoder.* tensors, float64, eager
    (`rope`: the tiny config's rope_parameters overrides the model was built with)."""
    from transformers import Ministral3Config
    from transformers.models.ministral3.modeling_ministral3 import Ministral3Model

    src = tiny_config(**rope)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
            "tie_word_embeddings", "hidden_act")
    conf = Ministral3Config(**{k: src[k] for k in keys}, pad_token_id=None, attn_implementation="eager")
    enc = Ministral3Model(conf).double().eval()
    w = checkpoint(model)
    enc.load_state_dict({k[len("encoder."):]: v for k, v in w.items() if k.startswith("encoder.")}, strict=True)
    return enc, w["diffusion_head.weight"]


def context_mask(T: int, block: int) -> torch.Tensor:
    """Causal, but the last `block` columns bidirectional among themselves."""
    i = torch.arange(T)
    seg = torch.minimum(i, torch.tensor(T - block))
    return seg[None, :] <= seg[:, None]


@pytest.mark.parametrize("rope", [{}, ACTIVE_ROPE], ids=["published_rope", "yarn_and_q_scale_active"])
def test_forward_equals_transformers_ministral3(rope):
    model = tiny_model(**rope)
    enc, head = hf_encoder(model, **rope)
    T = 21
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(T)[None]
    for keep in (torch.ones(T, T).tril().bool(), context_mask(T, 5)):
        additive = torch.zeros(T, T, dtype=torch.float64).masked_fill(~keep, float("-inf"))[None, None]
        with torch.no_grad():
            ours = model(ids, pos, keep[None, None])[0]
            theirs = F.linear(enc(input_ids=ids, attention_mask=additive, position_ids=pos).last_hidden_state[0], head)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_the_published_config_parses():
    cfg = ModelConfig.from_hf(CONFIG)
    fam = cfg.family
    assert (fam.name, fam.causal_context, fam.first_position, fam.shift_logits, cfg.block_causal) == (
        "Nemotron-Labs-Diffusion", True, True, False, True)
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.head_dim, cfg.n_kv_heads, cfg.rope_theta, cfg.rms_norm_eps) == (
        100, 11, 128, 8, 1e6, 1e-5)
    assert cfg.rope_yarn.factor == 16.0 and cfg.rope_yarn.attention_factor == 1.0
    assert cfg.rope_yarn.original_max_position_embeddings == 16384 and cfg.q_position_scale == (0.1, 16384)
    assert not cfg.tie_word_embeddings
    names = fam.checkpoint_shapes(ModelConfig.from_hf(tiny_config()))
    assert "diffusion_head.weight" in names and "encoder.layers.1.self_attn.q_proj.weight" in names
    assert "encoder.embed_tokens.weight" in names and "encoder.norm.weight" in names


@pytest.mark.parametrize("key, value", [("dlm_paradigm", "block_diff"), ("dlm_paradigm", "autoregressive"),
                                        ("sliding_window", 4096), ("mlp_bias", True), ("attention_bias", True),
                                        ("hidden_act", "gelu"), ("some_new_key", 1)])
def test_keys_it_does_not_honour_are_refused(key, value):
    with pytest.raises(ConfigRefused, match=key):
        ModelConfig.from_hf({**CONFIG, key: value})


def test_rope_parameters_it_does_not_implement_are_refused():
    for bad, match in (({"rope_type": "default"}, "yarn"), ({"rope_type": "longrope"}, "yarn"),
                       ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
                       ({"llama_4_scaling_beta": None}, "llama_4_scaling_beta")):
        with pytest.raises(ConfigRefused, match=match):
            ModelConfig.from_hf({**CONFIG, "rope_parameters": {**CONFIG["rope_parameters"], **bad}})


def test_config_round_trips():
    cfg = ModelConfig.from_hf(tiny_config(**ACTIVE_ROPE))
    again = ModelConfig.from_hf(cfg.to_hf())
    assert again.rope_yarn == cfg.rope_yarn and again.q_position_scale == cfg.q_position_scale
    assert ModelConfig(**cfg.as_dict()).rope_yarn == cfg.rope_yarn
