"""Checkpoints with no published file set vendored under tests/published/, rebuilt by
hand with tiny random weights, and PEFT LoRA adapters.

Every checkpoint whose published files are vendored is built from them by
tests/published.py instead. LLaDA-MoE-7B-A1B has none (no copy of its files was found:
SOURCE.md of ../shared/checkpoints/inclusionAI__LLaDA-MoE-7B-A1B-Instruct), so its file
set stays hand-written here: config.json with every key of the published LLaDAMoEConfig
(configuration_lladamoe.py; sizes shrunk by published.shrink), the vocabulary size
157184, <|endoftext|> at its eos_token_id 156892 and <|mask|> at 156895 (docs/usage.md;
LLaDA2's Ling tokenizer has the same two ids), a Ling-style chat template, 3 shards
with the index, the remote-code files as stubs. PEFT LoRA adapters (adapter_config.json
+ adapter_model.safetensors under PEFT's key names) are generated for any base layout,
published-built ones included."""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

import torch
from safetensors.torch import save_file

from engine import ModelConfig, build_model, save_model
from published import MERGES, bpe_vocab, shrink

# The keys of the published LLaDAMoEConfig (configuration_lladamoe.py) at LLaDA-MoE-7B-A1B's
# sizes (16 layers, 64 experts, top-8, expert width 1024); write_llada_moe shrinks them.
LLADA_MOE_CONFIG = {
    "architectures": ["LLaDAMoEModelLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_lladamoe.LLaDAConfig", "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM"},
    "clip_qkv": None, "dense_intermediate_size": 8192, "eos_token_id": 156892, "expert_intermediate_size": 1024,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "max_position_embeddings": 8192,
    "model_type": "llada", "moe_layer_freq": [1] * 16, "moe_router_enable_expert_bias": False,
    "moe_router_score_function": "softmax", "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 64,
    "num_experts_per_tok": 8, "num_hidden_layers": 16, "num_key_value_heads": 16, "output_router_logits": False,
    "pad_token_id": 156892, "partial_rotary_factor": 1, "qk_layernorm": True, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 50000, "routed_scaling_factor": 1, "router_aux_loss_coef": 0.01,
    "router_num_group": None, "router_topk_group": None, "shared_expert_intermediate_size": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.46.3", "use_cache": False,
    "vocab_size": 157184,
}
# The specials of the hand-written LLaDA-MoE tokenizer: <|endoftext|> and <|mask|> at the
# ids of the module docstring; bos and the chat markup at ids of this file's own choosing
# (no vendored file numbers them).
LING_SPECIAL = {156891: "<|startoftext|>", 156892: "<|endoftext|>", 156895: "<|mask|>", 156900: "<role>",
                156901: "</role>", 156902: "<|role_end|>"}
LING_TEMPLATE = ("{% for message in messages %}{{ '<role>' + message['role'] | upper + '</role>' + message['content'] "
                 "+ '<|role_end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<role>ASSISTANT</role>' }}{% endif %}")


def _dump(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)


def _weights(root: str, hf: dict, n_shards: int, seed: int) -> ModelConfig:
    """Random weights under the family's key names, in about `n_shards` shards with the
    index naming (model-0000i-of-0000n.safetensors + model.safetensors.index.json)."""
    cfg = ModelConfig.from_hf(hf)
    model = build_model(cfg, dtype=torch.float32, seed=seed)
    total = sum(p.numel() * 4 for p in model.parameters())
    save_model(model, root, max_shard_bytes=total // n_shards + 1)
    index = json.load(open(os.path.join(root, "model.safetensors.index.json")))
    index["metadata"] = {"total_size": total}
    _dump(os.path.join(root, "model.safetensors.index.json"), index)
    return cfg


def _remote_code_stubs(root: str, names) -> None:
    """The checkpoint's own .py files: documentation only, they fail loudly if imported."""
    for name in names:
        with open(os.path.join(root, name), "w") as f:
            f.write(f"raise RuntimeError('remote code {name} ran')\n")


def _fast_tokenizer(root: str, size: int, special: Dict[int, str], specials: Dict[str, str], template: str) -> None:
    """tokenizer.json (PreTrainedTokenizerFast) of `size` ids with `special` at their ids,
    tokenizer_config.json (+ chat template, added tokens), special_tokens_map.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=bpe_vocab(size, special), merges=[tuple(m.split()) for m in MERGES]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(special.values()))
    tok.save(os.path.join(root, "tokenizer.json"))
    for i, s in special.items():
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    _dump(os.path.join(root, "tokenizer_config.json"), dict(
        specials, tokenizer_class="PreTrainedTokenizerFast", add_bos_token=False, add_eos_token=False,
        clean_up_tokenization_spaces=False, model_max_length=1000000000000000019884624838656,
        chat_template=template,
        added_tokens_decoder={str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for i, s in special.items()}))
    _dump(os.path.join(root, "special_tokens_map.json"), specials)


def write_llada_moe(root: str, seed: int = 0) -> str:
    """inclusionAI/LLaDA-MoE-7B-A1B-Instruct's file set, by hand (no published files are
    vendored): config.json (model_type 'llada' with Hugging Face keys, every key of the
    published LLaDAMoEConfig; published.shrink: hidden 16, 2 layers of 4 experts, top-2),
    the vocabulary 157184 with <|endoftext|> 156892 and <|mask|> 156895, tokenizer.json +
    tokenizer_config.json with a Ling-style chat template, 3 shards with the index, the
    remote-code files."""
    os.makedirs(root, exist_ok=True)
    hf = shrink(LLADA_MOE_CONFIG)
    _weights(root, hf, 3, seed)
    _dump(os.path.join(root, "config.json"), hf)
    _fast_tokenizer(root, 157184, LING_SPECIAL, dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                                      mask_token="<|mask|>"), LING_TEMPLATE)
    _remote_code_stubs(root, ("configuration_lladamoe.py", "modeling_lladamoe.py"))
    return root


# module names D2F's adapters target (SJTU-Deng-Lab/D2F_LLaDA_Instruct_8B_Lora, D2F_Dream_Base_7B_Lora)
D2F_TARGETS = {"llada": ["q_proj", "k_proj", "v_proj", "attn_out"], "Dream": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def write_lora(root: str, cfg: ModelConfig, r: int = 4, lora_alpha: float = 8.0, use_rslora: bool = False,
               targets: Optional[List[str]] = None, seed: int = 1, base: str = "", **config) -> str:
    """A PEFT LoRA adapter for `cfg`'s layout: adapter_config.json with the keys PEFT writes
    and random lora_A / lora_B (B non-zero, unlike a fresh adapter) under PEFT's names
    (base_model.model.<module>.lora_A.weight)."""
    os.makedirs(root, exist_ok=True)
    targets = targets or D2F_TARGETS[cfg.model_type]
    _dump(os.path.join(root, "adapter_config.json"), {
        "alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": base, "bias": "none",
        "corda_config": None, "eva_config": None, "exclude_modules": None, "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True, "layer_replication": None, "layers_pattern": None,
        "layers_to_transform": None, "loftq_config": {}, "lora_alpha": lora_alpha, "lora_bias": False,
        "lora_dropout": 0.05, "megatron_config": None, "megatron_core": "megatron.core", "modules_to_save": None,
        "peft_type": "LORA", "r": r, "rank_pattern": {}, "revision": None, "target_modules": targets,
        "task_type": "CAUSAL_LM", "trainable_token_indices": None, "use_dora": False, "use_rslora": use_rslora,
        **config})
    g = torch.Generator().manual_seed(seed)
    shapes = cfg.family.param_shapes(cfg)
    tensors = {}
    for name, shape in shapes.items():
        key = cfg.family.checkpoint_name(name)
        module = key.removesuffix(".weight")
        if not key.endswith(".weight") or len(shape) != 2 or module.rsplit(".", 1)[-1] not in targets:
            continue
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(r, shape[1], generator=g) / shape[1] ** 0.5
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(shape[0], r, generator=g) * 0.5
    save_file(tensors, os.path.join(root, "adapter_model.safetensors"), metadata={"format": "pt"})
    return root
