"""The file sets of published checkpoints, rebuilt from their metadata with tiny random
weights: config.json with every published key (only the sizes shrunk: hidden 16, one
layer; the real vocabulary sizes, so every special id sits where it does in the real
model), generation_config.json, tokenizer_config.json with its added tokens, specials and
chat template, special_tokens_map.json, the shard index naming, and PEFT LoRA adapters
(adapter_config.json + adapter_model.safetensors under PEFT's key names).

Sources (read with the search tool): GSAI-ML/LLaDA-8B-Instruct config.json as vendored in
public repositories (e.g. a LLaDA-100M tutorial copying it key for key), Dream-org's
Dream-v0-Instruct-7B generation_config.json (monash-yann/dllm-research,
models/Dream-7B-Instruct/), Qwen2.5's tokenizer layout for Dream (151643 byte-level BPE
entries in vocab.json, then the added tokens from 151643; Dream adds <|beginoftext|>
151665 and <|mask|> 151666), LLaDA's special ids (126080 <|startoftext|>, 126081
<|endoftext|>, 126336 <|mdm_mask|>, 126346-126348 header / <|eot_id|>). Dream's
vocab.json here is a small valid byte-level BPE vocabulary (256 byte symbols, a few
merges) padded with unreachable fillers to the real size."""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

import torch
from safetensors.torch import save_file

from engine import ModelConfig, build_model, save_model

TINY = dict(hidden=16, layers=1, heads=2, kv_heads=1, ffn=32)

LLADA_CONFIG = {
    "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
    "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
    "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
                 "AutoModel": "modeling_llada.LLaDAModelLM"},
    "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": 4096,
    "embedding_dropout": 0.0, "embedding_size": 126464, "eos_token_id": 126081, "flash_attention": False,
    "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "meta",
    "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False, "layer_norm_type": "rms",
    "layer_norm_with_affine": True, "mask_token_id": 126336, "max_sequence_length": 4096, "mlp_hidden_size": 12288,
    "mlp_ratio": 4, "model_type": "llada", "multi_query_attention": None, "n_heads": 32, "n_kv_heads": 32,
    "n_layers": 32, "pad_token_id": 126081, "precision": "amp_bf16", "residual_dropout": 0.0, "rms_norm_eps": 1e-05,
    "rope": True, "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False,
    "transformers_version": "4.46.3", "use_cache": False, "vocab_size": 126464, "weight_tying": False,
}
LLADA_GENERATION = {"_from_model_config": True, "bos_token_id": 126080, "eos_token_id": 126081,
                    "pad_token_id": 126081, "transformers_version": "4.46.3"}
LLADA_SPECIAL = {126080: "<|startoftext|>", 126081: "<|endoftext|>", 126336: "<|mdm_mask|>",
                 126346: "<|start_header_id|>", 126347: "<|end_header_id|>", 126348: "<|eot_id|>"}
LLADA_TEMPLATE = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
                  "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
                  "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
                  "{{ content }}{% endfor %}{% if add_generation_prompt %}"
                  "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

DREAM_CONFIG = {
    "architectures": ["DreamModel"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
    "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584,
    "initializer_range": 0.02, "intermediate_size": 18944, "mask_token_id": 151666,
    "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "Dream", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "pad_token_id": 151643, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.46.2", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 152064,
}
DREAM_GENERATION = {"_from_model_config": True, "alg": "origin", "alg_temp": None, "bos_token_id": 151643,
                    "eos_token_id": 151643, "eps": 0.001, "mask_token_id": None, "output_history": False,
                    "pad_token_id": 151643, "steps": 512, "temperature": 0.0, "top_k": None, "top_p": None,
                    "transformers_version": "4.46.2"}
# The keys of the published LLaDAMoEConfig (configuration_lladamoe.py) at LLaDA-MoE-7B-A1B's
# sizes (16 layers, 64 experts, top-8, expert width 1024); sizes are shrunk by write_llada_moe.
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
# LLaDA2.0-mini's config.json (the keys of the published LLaDA2MoeConfig, its values at the
# mini sizes: 20 layers, 256 experts top-8 in 8 groups, one shared expert); no eos_token_id
# nor mask_token_id: generate() defaults them to 156892 / 156895. LLaDA2.1-mini's is the same.
LLADA2_CONFIG = {
    "architectures": ["LLaDA2MoeModelLM"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                 "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                 "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
    "embedding_dropout": 0.0, "first_k_dense_replace": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5120, "max_position_embeddings": 32768,
    "max_window_layers": 28, "model_type": "llada2_moe", "moe_intermediate_size": 512,
    "moe_router_enable_expert_bias": True, "n_group": 8, "norm_head": False, "norm_topk_prob": True,
    "num_attention_heads": 16, "num_experts": 256, "num_experts_per_tok": 8, "num_hidden_layers": 20,
    "num_key_value_heads": 4, "num_shared_experts": 1, "output_dropout": 0.0, "output_router_logits": False,
    "pad_token_id": 156892, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 600000, "routed_scaling_factor": 2.5, "router_dtype": "fp32", "score_function": "sigmoid",
    "sliding_window": 4096, "tie_word_embeddings": False, "topk_group": 4, "torch_dtype": "bfloat16",
    "transformers_version": "4.52.4", "use_bias": False, "use_cache": False, "use_qk_norm": True,
    "use_qkv_bias": False, "use_sliding_window": False, "vocab_size": 157184,
}
LING_SPECIAL = {156891: "<|startoftext|>", 156892: "<|endoftext|>", 156895: "<|mask|>", 156900: "<role>",
                156901: "</role>", 156902: "<|role_end|>"}
LING_TEMPLATE = ("{% for message in messages %}{{ '<role>' + message['role'] | upper + '</role>' + message['content'] "
                 "+ '<|role_end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<role>ASSISTANT</role>' }}{% endif %}")
QWEN_BASE_VOCAB = 151643
DREAM_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
               "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
               "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
               "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<|beginoftext|>",
               "<|mask|>"]  # ids 151643.. in this order
DREAM_NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                     "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
DREAM_TEMPLATE = ("{% if messages[0]['role'] == 'system' %}{{ '<|im_start|>system\n' + messages[0]['content'] + "
                  "'<|im_end|>\n' }}{% else %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
                  "{% endif %}{% for message in messages %}{% if message['role'] != 'system' %}"
                  "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
                  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "e r", "o n", "Ġ c", "o p", "Ġc op", "Ġcop y"]


def _dump(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def bpe_vocab(size: int, special: Optional[Dict[int, str]] = None) -> Dict[str, int]:
    """A valid byte-level BPE vocabulary of exactly `size` ids: the 256 byte symbols, the
    MERGES results, `special` at their ids, unreachable fillers elsewhere."""
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: i for i, b in enumerate(range(256))}
    for m in MERGES:
        vocab.setdefault(m.replace(" ", ""), len(vocab))
    special = special or {}
    for i in range(len(vocab), size):
        vocab[special.get(i, f"<|filler_{i}|>")] = i
    return vocab


def _weights(root: str, hf: dict, n_shards: int, seed: int) -> ModelConfig:
    """Random weights under the real key names, in `n_shards` shards with the real index
    naming (model-0000i-of-0000n.safetensors + model.safetensors.index.json)."""
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
    """tokenizer.json (PreTrainedTokenizerFast) of `size` ids with `special` at their real
    ids, tokenizer_config.json (+ chat template, added tokens), special_tokens_map.json."""
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


def write_llada(root: str, variant: str = "Instruct", seed: int = 0, **tiny) -> str:
    """GSAI-ML/LLaDA-8B-{Instruct,Base}'s file set: config.json, generation_config.json,
    tokenizer.json (PreTrainedTokenizerFast) with the special ids at their real places,
    tokenizer_config.json (+ chat template), special_tokens_map.json, 6 shards."""
    t = {**TINY, **tiny}
    os.makedirs(root, exist_ok=True)
    hf = dict(LLADA_CONFIG, d_model=t["hidden"], n_layers=t["layers"], n_heads=t["heads"], n_kv_heads=t["heads"],
              mlp_hidden_size=t["ffn"])
    _weights(root, hf, 6, seed)
    _dump(os.path.join(root, "config.json"), hf)
    _dump(os.path.join(root, "generation_config.json"), LLADA_GENERATION)
    _fast_tokenizer(root, 126464, LLADA_SPECIAL, dict(bos_token="<|startoftext|>", eos_token="<|endoftext|>",
                                                      pad_token="<|endoftext|>"), LLADA_TEMPLATE)
    _remote_code_stubs(root, ("configuration_llada.py", "modeling_llada.py"))
    return root


def write_dream(root: str, variant: str = "Instruct", seed: int = 0, **tiny) -> str:
    """Dream-org/Dream-v0-{Instruct,Base}-7B's file set: config.json, generation_config.json,
    vocab.json + merges.txt (no tokenizer.json), tokenizer_config.json naming DreamTokenizer
    with an auto_map to tokenization_dream.py, its added tokens from 151643 and the chat
    template, special_tokens_map.json, 4 shards."""
    t = {**TINY, **tiny}
    os.makedirs(root, exist_ok=True)
    hf = dict(DREAM_CONFIG, hidden_size=t["hidden"], num_hidden_layers=t["layers"], num_attention_heads=t["heads"],
              num_key_value_heads=t["kv_heads"], intermediate_size=t["ffn"])
    _weights(root, hf, 4, seed)
    _dump(os.path.join(root, "config.json"), hf)
    _dump(os.path.join(root, "generation_config.json"), DREAM_GENERATION)
    _dump(os.path.join(root, "vocab.json"), bpe_vocab(QWEN_BASE_VOCAB))
    with open(os.path.join(root, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(MERGES) + "\n")
    added = {QWEN_BASE_VOCAB + i: s for i, s in enumerate(DREAM_ADDED)}
    specials = dict(bos_token="<|beginoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                    mask_token="<|mask|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    _dump(os.path.join(root, "tokenizer_config.json"), dict(
        specials, add_bos_token=False, add_prefix_space=False, auto_map={
            "AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
        added_tokens_decoder={str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": s not in DREAM_NOT_SPECIAL}
                              for i, s in added.items()},
        chat_template=DREAM_TEMPLATE, clean_up_tokenization_spaces=False, errors="replace",
        model_max_length=131072, split_special_tokens=False, tokenizer_class="DreamTokenizer", unk_token=None))
    _dump(os.path.join(root, "special_tokens_map.json"), specials)
    _remote_code_stubs(root, ("tokenization_dream.py", "configuration_dream.py", "modeling_dream.py",
                              "generation_utils.py"))
    return root


def write_llada_moe(root: str, variant: str = "Instruct", seed: int = 0, **tiny) -> str:
    """inclusionAI/LLaDA-MoE-7B-A1B-{Instruct,Base}'s file set: config.json (model_type
    'llada' with Hugging Face keys, every key of the published LLaDAMoEConfig; sizes shrunk
    to hidden 16, 2 layers of 4 experts, top-2), the real vocabulary 157184 with
    <|endoftext|> 156892 and <|mask|> 156895, tokenizer.json + tokenizer_config.json with
    a Ling-style chat template, 3 shards with the index, the remote-code files."""
    t = {**TINY, **tiny}
    os.makedirs(root, exist_ok=True)
    hf = dict(LLADA_MOE_CONFIG, hidden_size=t["hidden"], num_attention_heads=t["heads"], num_key_value_heads=t["heads"],
              dense_intermediate_size=t["ffn"], expert_intermediate_size=t["ffn"] // 2, num_hidden_layers=2,
              moe_layer_freq=[1, 1], num_experts=4, num_experts_per_tok=2)
    return _ling_checkpoint(root, hf, seed, ("configuration_lladamoe.py", "modeling_lladamoe.py"))


def write_llada2(root: str, variant: str = "2.0-mini", seed: int = 0, **tiny) -> str:
    """inclusionAI/LLaDA2.0-mini's (and LLaDA2.1-mini's) file set: config.json with every
    published key (sizes shrunk to hidden 16, layer 0 dense, layer 1 of 4 experts in 2
    groups, top-2, a shared expert), the real vocabulary 157184 (<|endoftext|> 156892,
    <|mask|> 156895 from the tokenizer), tokenizer files with the Ling chat template, 3
    shards with the index, the remote-code files."""
    t = {**TINY, **tiny}
    os.makedirs(root, exist_ok=True)
    hf = dict(LLADA2_CONFIG, hidden_size=t["hidden"], num_attention_heads=t["heads"], num_key_value_heads=t["kv_heads"],
              head_dim=t["hidden"] // t["heads"], intermediate_size=t["ffn"], moe_intermediate_size=t["ffn"] // 2,
              num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1)
    return _ling_checkpoint(root, hf, seed, ("configuration_llada2_moe.py", "modeling_llada2_moe.py"))


def _ling_checkpoint(root: str, hf: dict, seed: int, code_files) -> str:
    """The files LLaDA-MoE and LLaDA2 share beside config.json `hf`: 3 shards with the
    index, the Ling tokenizer (157184 tokens) and chat template, the remote-code files."""
    _weights(root, hf, 3, seed)
    _dump(os.path.join(root, "config.json"), hf)
    _fast_tokenizer(root, 157184, LING_SPECIAL, dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                                      mask_token="<|mask|>"), LING_TEMPLATE)
    _remote_code_stubs(root, code_files)
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


LAYOUTS = {"LLaDA-8B-Instruct": (write_llada, "Instruct"), "LLaDA-8B-Base": (write_llada, "Base"),
           "Dream-v0-Instruct-7B": (write_dream, "Instruct"), "Dream-v0-Base-7B": (write_dream, "Base")}
MOE_LAYOUTS = {"LLaDA-MoE-7B-A1B-Instruct": (write_llada_moe, "Instruct"), "LLaDA2.0-mini": (write_llada2, "2.0-mini")}


def write_layout(name: str, root: str, seed: int = 0) -> str:
    fn, variant = {**LAYOUTS, **MOE_LAYOUTS}[name]
    return fn(root, variant, seed=seed)
