"""Families as declarations (issue 36, acceptance 4): a dense Qwen3-style family (QK norm,
an explicit head_dim wider than hidden / heads, separate q/k/v, untied embeddings) is
defined only in this file and registered; it builds, loads from a config.json that
transformers' own Qwen3Config wrote (every key of it accounted for: the ones the family
neither reads nor fixes are derived inert from transformers' source), computes what
transformers' Qwen3 computes, and generates. Nothing outside the registry is edited
for it."""
from __future__ import annotations

import json
from typing import Any, Dict, Mapping

import pytest
import torch

from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model, load_model, save_model
from engine.checkpoint import Checkpoint
from engine.models.families import ConfigRefused, Family, register
from engine.models.families.dream import rope_theta

MASK, EOS = 63, 1


class Qwen3Dense(Family):
    """transformers' Qwen3Config keys; Qwen3's weight names; a masked-diffusion decoder."""

    def parse(self, hf: Mapping[str, Any]) -> Dict[str, Any]:
        if any(t != "full_attention" for t in hf.get("layer_types") or []):
            raise ConfigRefused("sliding-window layers are not part of this family")
        return dict(self._common(hf), vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                    n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
                    n_kv_heads=hf["num_key_value_heads"], head_dim=hf["head_dim"],
                    intermediate_size=hf["intermediate_size"], rope_theta=rope_theta(hf, 10000.0),
                    rms_norm_eps=hf["rms_norm_eps"], tie_word_embeddings=hf["tie_word_embeddings"], qk_norm=True,
                    max_seq_len=hf["max_position_embeddings"])

    def to_hf(self, cfg: Any) -> Dict[str, Any]:
        return dict(model_type=self.model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                    num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                    head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size, rms_norm_eps=cfg.rms_norm_eps,
                    rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                    tie_word_embeddings=cfg.tie_word_embeddings, max_position_embeddings=cfg.max_seq_len)


QWEN3_DENSE = register(Qwen3Dense(
    name="Qwen3-dense (a test's)", model_type="qwen3_dense_test", examples="tests/test_families.py", layout="qwen3",
    honoured=frozenset({"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                        "head_dim", "intermediate_size", "rms_norm_eps", "rope_parameters", "rope_theta",
                        "tie_word_embeddings", "max_position_embeddings", "layer_types"}),
    fixed={"hidden_act": ("silu",), "attention_bias": (False,), "use_sliding_window": (False,)},
    top_weights={"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "lm_head.weight": "lm_head.weight"},
    layer_prefix="model.layers.{i}.",
    layer_weights={"attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
                   "v": "self_attn.v_proj", "o": "self_attn.o_proj", "q_norm": "self_attn.q_norm",
                   "k_norm": "self_attn.k_norm", "mlp_norm": "post_attention_layernorm", "gate": "mlp.gate_proj",
                   "up": "mlp.up_proj", "down": "mlp.down_proj"},
    defaults={"mask_token_id": MASK, "eos_token_id": EOS}))


def qwen3_config_json() -> Dict[str, Any]:
    """config.json as transformers' Qwen3Config writes it (head_dim 16 > 32 / 4), this family's model_type."""
    from transformers import Qwen3Config

    hf = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=1024).to_dict()
    return json.loads(json.dumps({**hf, "model_type": QWEN3_DENSE.model_type, "mask_token_id": MASK,
                                  "eos_token_id": EOS}))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("qwen3-dense")
    hf = qwen3_config_json()
    save_model(build_model(ModelConfig.from_hf(hf), dtype=torch.float32, seed=0), root)
    (root / "config.json").write_text(json.dumps(hf))  # transformers' keys, verbatim
    return str(root)


def test_the_family_accounts_for_every_key_transformers_writes(checkpoint):
    ckpt = Checkpoint.open(checkpoint)
    assert ckpt.family is QWEN3_DENSE and (ckpt.config.head_dim, ckpt.config.qk_norm) == (16, True)
    # derived from transformers' Qwen3Config, not listed: its cache, init and dropout knobs
    assert {"initializer_range", "use_cache", "attention_dropout", "max_window_layers"} <= QWEN3_DENSE.inert
    assert "model.layers.0.self_attn.q_norm.weight" in ckpt.tensors  # Qwen3's weight names
    with pytest.raises(ConfigRefused, match="use_sliding_window"):
        Checkpoint.open(checkpoint).family.check_config({**qwen3_config_json(), "use_sliding_window": True})
    with pytest.raises(ConfigRefused, match="'qk_norm_scale'"):  # a key neither Qwen3Config nor the family knows
        QWEN3_DENSE.check_config({**qwen3_config_json(), "qk_norm_scale": 2.0})


def test_it_computes_what_transformers_qwen3_computes(checkpoint):
    """The declared layer (separate q/k/v, QK norm per head before RoPE, head_dim 16) is
    Qwen3's: the same weights through transformers' Qwen3ForCausalLM, causally masked."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    ours, _ = load_model(checkpoint, dtype=torch.float32, tokenizer=False)
    hf = {k: v for k, v in qwen3_config_json().items() if k not in ("model_type", "mask_token_id")}
    theirs = Qwen3ForCausalLM(Qwen3Config(**hf)).eval()
    state = {ours.config.family.checkpoint_name(n): p for n, p in ours.named_parameters()}
    theirs.load_state_dict(state, strict=True)
    ids = torch.randint(2, 60, (1, 11), generator=torch.Generator().manual_seed(0))
    causal = torch.ones(11, 11, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        got = ours(ids, torch.arange(11)[None], causal)
        want = theirs(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_it_loads_and_generates(checkpoint):
    model, _ = load_model(checkpoint, dtype=torch.float64, tokenizer=False)
    params = SamplingParams(max_new_tokens=8, stop_token_ids=[EOS])
    outs = Engine(model, EngineConfig(block_length=4, steps_per_block=4, token_budget=256)).generate(
        [[5, 6, 7], [9, 10, 11, 12, 13]], params)
    assert [o.error for o in outs] == [None, None]
    assert all(o.finish_reason in ("stop", "length") and 0 < len(o.token_ids) <= 8 for o in outs)
    alone = Engine(model, EngineConfig(block_length=4, steps_per_block=4, token_budget=256)).generate([[5, 6, 7]],
                                                                                                       params)
    assert alone[0].token_ids == outs[0].token_ids  # batched equals alone
