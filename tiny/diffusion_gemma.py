"""A tiny random DiffusionGemma checkpoint written by transformers' own save_pretrained
(config.json with text_config, safetensors, generation_config.json) plus a word-level
tokenizer with a Gemma-style chat template. Its logits are sharpened (embedding scale)
so canvases stop at different steps and EOS ends rows at different canvases."""
from __future__ import annotations

import copy

import torch

VOCAB = 64
CANVAS = 8
IMAGE = 61  # image_token_id (boi/eoi just below it); prompts use ids 5..58
GENERATION = dict(max_denoising_steps=6, t_min=0.4, t_max=0.8, stability_threshold=0, confidence_threshold=1.2,
                  sampler_config={"entropy_bound": 0.5, "_cls_name": "EntropyBoundSamplerConfig"},
                  eos_token_id=[1], pad_token_id=0, bos_token_id=2)
# transformers always builds the vision tower (vision_config=None means its 16-layer default,
# seconds to initialise, save and load): a one-layer one, never run (text only).
VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=2, head_dim=8, position_embedding_size=64)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }} {{ m['content'] }}"
                 "<end_of_turn>{% endfor %}{% if add_generation_prompt %}<start_of_turn>model {% endif %}")


def build(path: str, scale: float = 20.0, hidden: int = 32, layers: int = 3, vocab: int = VOCAB,
          canvas: int = CANVAS, **generation) -> str:
    """`generation`: generation_config.json entries replacing GENERATION's; `vocab` (> IMAGE)
    and `canvas` (canvas_length) size the overhead-bound bench model."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    types = (["sliding_attention", "sliding_attention", "full_attention"] * layers)[:layers - 1] + ["full_attention"]
    tc = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3 // 2, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
              num_global_key_value_heads=1, sliding_window=12, layer_types=types, enable_moe_block=True,
              num_experts=4, top_k_experts=2, moe_intermediate_size=hidden // 2, eos_token_id=1, pad_token_id=0,
              bos_token_id=2)
    cfg = DiffusionGemmaConfig(text_config=tc, canvas_length=canvas, vision_config=VISION, image_token_id=IMAGE,
                               boi_token_id=IMAGE - 1, eoi_token_id=IMAGE - 2)
    torch.manual_seed(0)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    with torch.no_grad():
        model.model.decoder.embed_tokens.weight.mul_(scale)
    # a deep copy: the config pops sampler_config's "_cls_name" from the dict it is given
    model.generation_config = DiffusionGemmaGenerationConfig(**copy.deepcopy({**GENERATION, **generation}))
    model.save_pretrained(path)
    _tokenizer(path, vocab)
    return path


def _tokenizer(path: str, vocab: int = VOCAB) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
    words = specials + [f"w{i}" for i in range(vocab - len(specials) - 2)] + ["user", "model"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="w0", additional_special_tokens=specials[3:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
