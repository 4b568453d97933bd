"""Tiny loadable checkpoints built from the published metadata of the checkpoints people
run, vendored byte for byte under tests/published/<owner>__<name>/ (each folder's
SOURCE.md says where its files were copied from).

`build(folder, root)` writes: every published file verbatim except config.json (the
published dict with only its size keys shrunk, `vocab_size` and every other key kept, so
every special id sits where it does in the real model) and the shard index (the
published index restricted to the kept layers and experts, each tensor in the shard the
published index puts it in, `metadata.total_size` of the tiny tensors); random weights
under the names the engine's family writes, asserted to be exactly those published
names; a synthesized byte-level BPE tokenizer (the published tokenizer.json / vocab.json
are not vendored: too big) with every published added token at its published id (the
special tokens the vendored files name but number nowhere, LLaDA2's <|startoftext|>,
[CLS] and [gMASK], at the top free ids); the checkpoint's remote-code .py files, named
by its auto_map entries, as stubs that raise if imported."""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine import ModelConfig, build_model, save_model
from engine.structured.vocabulary import bytes_to_unicode  # byte-level BPE's alphabet, as the engine reads it

HERE = os.path.dirname(os.path.abspath(__file__))
VENDORED = os.path.join(HERE, "published")
# the shared copies the vendored ones are checked against (absent on a clean clone)
SHARED = os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared", "checkpoints")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"  # a set published without an index
REWRITTEN = ("config.json", INDEX)  # written for the tiny model; every other file is copied verbatim

HIDDEN, HEADS, FFN, LAYERS, EXPERTS, TOP_K, GROUPS = 16, 2, 32, 2, 4, 2, 2

# Token ids published outside the vendored files. LLaDA2's tokenizer_config.json names
# <|mask|> without an id and its config.json names no mask_token_id: 156895 is the
# mask_id default of the published modeling_llada2_moe.py generate() (the folder's SOURCE.md).
IDS_PUBLISHED_ELSEWHERE = {"llada2_moe": {"<|mask|>": 156895}}
# Mask tokens no tokenizer file names as such: Fast-dLLM v2's batch_sample mask_id 151665 is
# the added token |<MASK>| (tokenizer_config.json lists it as an additional special token only).
MASK_TOKENS_ELSEWHERE = {"Fast_dLLM_Qwen": "|<MASK>|"}

# Byte-level BPE merges of the synthesized tokenizers (a few, so "the" and "copy" merge).
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "e r", "o n", "Ġ c", "o p", "Ġc op", "Ġcop y"]


# --- the vendored folders --------------------------------------------------------------

def _with_config() -> List[str]:
    return sorted(d for d in os.listdir(VENDORED) if os.path.isfile(os.path.join(VENDORED, d, "config.json")))


def folders() -> List[str]:
    """The vendored folders holding a config.json (a published file set, byte for byte), sorted."""
    return [d for d in _with_config() if not rebuilt(d)]


def rebuilt_folders() -> List[str]:
    """The folders whose config.json is rebuilt from located values (no byte copy reachable:
    SOURCE.md says so), sorted; built with build_from_config (no tokenizer files)."""
    return [d for d in _with_config() if rebuilt(d)]


# what SOURCE.md says in a folder whose config.json is rebuilt from located values (no byte copy of
# it is reachable): tests/test_published.py builds it from config.json alone
REBUILT_MARK = "REBUILT FROM LOCATED VALUES"


def rebuilt(folder: str) -> bool:
    """Whether the folder's config.json is rebuilt from located values (its SOURCE.md says
    so), not a byte copy of the published file."""
    with open(path(folder, "SOURCE.md"), encoding="utf-8") as f:
        return REBUILT_MARK in f.read()


def path(folder: str, name: str = "") -> str:
    return os.path.join(VENDORED, folder, name)


def read_json(folder: str, name: str) -> Optional[Any]:
    """A vendored JSON file, or None where the published set has no such file."""
    p = path(folder, name)
    if not os.path.isfile(p):
        return None
    with open(p, encoding="utf-8") as f:
        return json.load(f)


def config(folder: str) -> Dict[str, Any]:
    return read_json(folder, "config.json")


def tokenizer_config(folder: str) -> Dict[str, Any]:
    return read_json(folder, "tokenizer_config.json") or {}


def token_text(value: Any) -> Optional[str]:
    """A special token of tokenizer_config.json: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


# added_tokens.json entries that name a token other than tokenizer_config.json's at the same id
# (what the tokenizer has): the dense SDAR files' `<MASK>` for `<|MASK|>` 151669
ADDED_TOKENS_JSON_DIFFERS = {"<MASK>": "<|MASK|>"}


def added_tokens(folder: str) -> Dict[int, Dict[str, Any]]:
    """{id: AddedToken fields} of tokenizer_config.json's added_tokens_decoder, checked
    against added_tokens.json where the folder has one (same tokens at the same ids, but
    for ADDED_TOKENS_JSON_DIFFERS)."""
    decoder = {int(i): t for i, t in (tokenizer_config(folder).get("added_tokens_decoder") or {}).items()}
    listed = read_json(folder, "added_tokens.json")
    if listed is not None:
        listed = {ADDED_TOKENS_JSON_DIFFERS.get(t, t): i for t, i in listed.items()}
        assert {t["content"]: i for i, t in decoder.items()} == listed, f"{folder}: added_tokens.json disagrees"
    return decoder


def published_ids(folder: str) -> Dict[str, int]:
    """{token: published id} for every token the published files number: the added tokens,
    the pad token at config.json's pad_token_id where no added token numbers it (Fast-dLLM
    v2's config.json says 151645, <|im_end|>, for its tokenizer's pad <|endoftext|> 151643),
    and the ids published elsewhere."""
    hf, tc = config(folder), tokenizer_config(folder)
    ids = {t["content"]: i for i, t in added_tokens(folder).items()}
    pad = token_text(tc.get("pad_token"))
    if pad is not None and isinstance(hf.get("pad_token_id"), int):
        ids.setdefault(pad, hf["pad_token_id"])
    for token, i in IDS_PUBLISHED_ELSEWHERE.get(hf.get("model_type"), {}).items():
        assert ids.setdefault(token, i) == i, f"{folder}: {token} is not at {i}"
    return ids


def mask_token(folder: str) -> Tuple[str, int]:
    """(mask token, id): config.json mask_token_id (LLaDA 126336 <|mdm_mask|>, Dream 151666
    <|mask|>, named by the added tokens), else tokenizer_config.json mask_token at its
    published id (LLaDA2: <|mask|> 156895, IDS_PUBLISHED_ELSEWHERE), else the added token the
    published decoding code names (MASK_TOKENS_ELSEWHERE)."""
    hf = config(folder)
    if "mask_token_id" in hf:
        return added_tokens(folder)[hf["mask_token_id"]]["content"], hf["mask_token_id"]
    mask = token_text(tokenizer_config(folder).get("mask_token")) or MASK_TOKENS_ELSEWHERE[hf["model_type"]]
    return mask, published_ids(folder)[mask]


# --- config.json: the size keys shrunk --------------------------------------------------

def _kv_heads(heads: int, kv: Optional[int]) -> int:
    """Multi-head stays multi-head; grouped-query attention keeps one kv head."""
    return HEADS if kv in (None, heads) else 1


def _llada(hf: Dict[str, Any]) -> Dict[str, Any]:
    """LLaDA's OLMo keys."""
    return dict(d_model=HIDDEN, n_layers=LAYERS, n_heads=HEADS, mlp_hidden_size=FFN,
                n_kv_heads=_kv_heads(hf["n_heads"], hf.get("n_kv_heads")))


def _dream(hf: Dict[str, Any]) -> Dict[str, Any]:
    """Qwen2's keys."""
    return dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                num_key_value_heads=_kv_heads(hf["num_attention_heads"], hf.get("num_key_value_heads")),
                intermediate_size=FFN)


def _llada_moe(hf: Dict[str, Any]) -> Dict[str, Any]:
    """LLaDA-MoE: model_type 'llada' with Hugging Face keys and experts."""
    out = dict(_dream(hf), dense_intermediate_size=FFN, expert_intermediate_size=FFN // 2, num_experts=EXPERTS,
               num_experts_per_tok=TOP_K, moe_layer_freq=hf["moe_layer_freq"][:LAYERS])
    del out["intermediate_size"]
    if hf.get("shared_expert_intermediate_size"):
        out["shared_expert_intermediate_size"] = FFN // 2
    return out


def _llada2(hf: Dict[str, Any]) -> Dict[str, Any]:
    """LLaDA2.x: the dense layers first_k_dense_replace keeps, then one MoE layer; expert
    groups shrunk in proportion (top-2 sum per group needs 2 experts a group)."""
    head_dim = HIDDEN // HEADS
    out = dict(_dream(hf), num_hidden_layers=max(LAYERS, hf.get("first_k_dense_replace", 0) + 1),
               moe_intermediate_size=FFN // 2, num_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=GROUPS,
               topk_group=max(1, hf["topk_group"] * GROUPS // hf["n_group"]), head_dim=head_dim,
               rotary_dim=int(head_dim * hf.get("partial_rotary_factor", 0.5)))
    if hf.get("expert_capacity"):  # LLaDA2.2's block routing: the admitted experts scaled with the expert count
        out["expert_capacity"] = max(TOP_K, hf["expert_capacity"] * EXPERTS // hf["num_experts"])
    return {k: v for k, v in out.items() if k in hf or k not in ("head_dim", "rotary_dim")}


def _sdar(hf: Dict[str, Any]) -> Dict[str, Any]:
    """SDAR: Qwen2's size keys and an explicit head_dim that is not hidden / heads (as
    published: 128 with 2048 / 16); SDAR-MoE: its experts too."""
    out = dict(_dream(hf), head_dim=HIDDEN // HEADS + 4)
    if "num_experts" in hf:
        out.update(num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=FFN // 2)
    return out


def _illada(hf: Dict[str, Any]) -> Dict[str, Any]:
    """iLLaDA: Llama's size keys (GQA: one kv head)."""
    return _dream(hf)


def _fast_dllm_v2(hf: Dict[str, Any]) -> Dict[str, Any]:
    """Qwen2's size keys and one layer_types entry per kept layer."""
    return dict(_dream(hf), layer_types=hf["layer_types"][:LAYERS])


def _nemotron_labs_diffusion(hf: Dict[str, Any]) -> Dict[str, Any]:
    """Nemotron-Labs-Diffusion: Ministral3's size keys (Qwen2's) and its explicit head_dim
    (GQA: one kv head); rope_parameters kept as published."""
    return dict(_dream(hf), head_dim=HIDDEN // HEADS)


# "Dream" covers DreamReasoner's config.json too (Qwen's size keys; its head_dim null stays null);
# "llama": Stable-DiffCoder's (Llama's size keys are Qwen2's)
SHRINK: Dict[str, Callable[[Dict[str, Any]], Dict[str, Any]]] = {"llada": _llada, "Dream": _dream,
                                                                 "llada2_moe": _llada2, "sdar": _sdar,
                                                                 "sdar_moe": _sdar, "Fast_dLLM_Qwen": _fast_dllm_v2,
                                                                 "llama": _dream, "illada": _illada,
                                                                 "nemotron_labs_diffusion": _nemotron_labs_diffusion}


def _rule(hf: Dict[str, Any]) -> Callable[[Dict[str, Any]], Dict[str, Any]]:
    mt = hf.get("model_type")
    if mt in ("llada", "LLaDA") and "d_model" not in hf and "num_experts" in hf:
        return _llada_moe  # LLaDA-MoE says 'llada' too: recognised from its keys, as the engine does
    if mt not in SHRINK:
        raise KeyError(f"tests/published.py has no shrink rule for model_type {mt!r}: add one when blockray "
                       "serves that family")
    return SHRINK[mt]


def shrink(hf: Dict[str, Any]) -> Dict[str, Any]:
    """The published config.json with only its size keys changed (same keys, same order)."""
    sizes = _rule(hf)(hf)
    assert set(sizes) <= set(hf), f"shrink rule adds keys {sorted(set(sizes) - set(hf))}"
    return {k: sizes.get(k, v) for k, v in hf.items()}


# --- weights under the published names ------------------------------------------------

def kept_names(index: Dict[str, Any], cfg: ModelConfig) -> Dict[str, str]:
    """The published weight_map restricted to the layers and experts the tiny model keeps."""
    n_experts = cfg.moe.num_experts if cfg.moe is not None else 0

    def kept(name: str) -> bool:
        layer = re.search(r"\.(?:layers|blocks)\.(\d+)\.", name)
        expert = re.search(r"\.experts\.(\d+)\.", name)
        return (layer is None or int(layer.group(1)) < cfg.n_layers) and (
            expert is None or int(expert.group(1)) < n_experts)

    return {k: v for k, v in index["weight_map"].items() if kept(k)}


def _family_tensors(root: str, cfg: ModelConfig, seed: int) -> Dict[str, torch.Tensor]:
    """Random weights of `cfg` under the names the engine's family writes (save_model's
    shards, read back and removed)."""
    model = build_model(cfg, dtype=torch.float32, seed=seed)
    save_model(model, root, max_shard_bytes=sum(p.numel() * 4 for p in model.parameters()) // 2 + 1)
    with open(os.path.join(root, INDEX), encoding="utf-8") as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    tensors: Dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(os.path.join(root, shard), "pt") as fh:
            tensors.update({k: fh.get_tensor(k) for k in fh.keys()})
        os.remove(os.path.join(root, shard))
    return tensors


def _write_weights(root: str, hf: Dict[str, Any], published_index: Optional[Dict[str, Any]], seed: int
                   ) -> ModelConfig:
    """The family's tensors, asserted to carry exactly the published names of the kept
    layers and experts, each written to the shard the published index puts it in; a set
    published as one model.safetensors (no index: SDAR-1.7B-Chat) is written so."""
    cfg = ModelConfig.from_hf(hf)
    tensors = _family_tensors(root, cfg, seed)
    if published_index is None:
        os.remove(os.path.join(root, INDEX))
        save_file(tensors, os.path.join(root, SINGLE), metadata={"format": "pt"})
        return cfg
    want = kept_names(published_index, cfg)
    extra, missing = sorted(set(tensors) - set(want)), sorted(set(want) - set(tensors))
    assert not extra and not missing, f"not the published tensor names: extra {extra[:5]}, missing {missing[:5]}"
    assert {k: tuple(t.shape) for k, t in tensors.items()} == cfg.family.checkpoint_shapes(cfg)
    for shard in dict.fromkeys(want.values()):
        save_file({k: tensors[k] for k, s in want.items() if s == shard}, os.path.join(root, shard),
                  metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _dump(os.path.join(root, INDEX), {"metadata": {**published_index.get("metadata", {}), "total_size": total},
                                      "weight_map": want})
    return cfg


# --- the tokenizer --------------------------------------------------------------------

def bpe_vocab(size: int, fixed: Optional[Dict[int, str]] = None) -> Dict[str, int]:
    """A valid byte-level BPE vocabulary of exactly `size` ids: the 256 byte symbols, the
    MERGES results, `fixed` tokens at their ids, unreachable fillers elsewhere."""
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: i for i, b in enumerate(range(256))}
    for m in MERGES:
        vocab.setdefault(m.replace(" ", ""), len(vocab))
    fixed = fixed or {}
    assert min(fixed, default=size) >= len(vocab), "a published id falls among the byte symbols"
    for i in range(len(vocab), size):
        vocab[fixed.get(i, f"<|filler_{i}|>")] = i
    return vocab


def _tokens(folder: str, vocab_size: int) -> Dict[int, Dict[str, Any]]:
    """{id: AddedToken fields}: every published added token at its published id, the
    special tokens tokenizer_config.json / special_tokens_map.json name without an id
    anywhere in the vendored files at the top free ids of the vocabulary."""
    tokens = {i: dict(t) for i, t in added_tokens(folder).items()}
    ids = published_ids(folder)
    flags = dict(lstrip=False, normalized=False, rstrip=False, single_word=False, special=True)
    for content, i in ids.items():
        tokens.setdefault(i, dict(flags, content=content))
    named = [token_text(v) for m in (tokenizer_config(folder), read_json(folder, "special_tokens_map.json") or {})
             for k, v in m.items() if k.endswith("_token") and k != "added_tokens_decoder"]
    free = (i for i in range(vocab_size - 1, -1, -1) if i not in tokens)
    for content in dict.fromkeys(t for t in named if isinstance(t, str) and t not in ids):
        tokens[next(free)] = dict(flags, content=content)
    return tokens


def _fast_tokenizer(root: str, vocab_size: int, tokens: Dict[int, Dict[str, Any]]) -> None:
    """tokenizer.json (what PreTrainedTokenizerFast reads): `vocab_size` ids, `tokens` at theirs."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=bpe_vocab(vocab_size, {i: t["content"] for i, t in tokens.items()}),
                               merges=[tuple(m.split()) for m in MERGES]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    for i in sorted(tokens):
        t = tokens[i]
        added = AddedToken(t["content"], single_word=t["single_word"], lstrip=t["lstrip"], rstrip=t["rstrip"],
                           normalized=t["normalized"], special=t["special"])
        (tok.add_special_tokens if t["special"] else tok.add_tokens)([added])
    tok.save(os.path.join(root, "tokenizer.json"))


def _bpe_files(root: str, tokens: Dict[int, Dict[str, Any]]) -> None:
    """vocab.json + merges.txt (what Qwen2Tokenizer reads): the byte-level vocabulary below
    the first added token; the added tokens come from tokenizer_config.json."""
    _dump(os.path.join(root, "vocab.json"), bpe_vocab(min(tokens)))
    with open(os.path.join(root, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(MERGES) + "\n")


def _write_tokenizer(root: str, folder: str, cfg: ModelConfig) -> None:
    """The files the checkpoint's tokenizer_config.json names a reader for, checked through
    common.tokenizer.load_tokenizer: mask token, eos and chat template as published."""
    from common.tokenizer import load_tokenizer

    tc = tokenizer_config(folder)
    tokens = _tokens(folder, cfg.vocab_size)
    if tc.get("tokenizer_class") in ("DreamTokenizer", "Qwen2Tokenizer"):  # read as transformers' Qwen2Tokenizer
        _bpe_files(root, tokens)
    else:
        assert tc.get("tokenizer_class") == "PreTrainedTokenizerFast", tc.get("tokenizer_class")
        _fast_tokenizer(root, cfg.vocab_size, tokens)
    tok = load_tokenizer(root)
    ids = published_ids(folder)
    assert {t: tok.convert_tokens_to_ids(t) for t in ids} == ids, "a token is not at its published id"
    eos, (mask, mask_id) = token_text(tc["eos_token"]), mask_token(folder)
    assert (tok.eos_token, tok.eos_token_id) == (eos, ids[eos]) and tok.convert_tokens_to_ids(mask) == mask_id
    assert tok.chat_template == chat_template(folder)


def chat_template(folder: str) -> Optional[str]:
    """The published chat template: chat_template.jinja, else tokenizer_config.json's."""
    if os.path.isfile(path(folder, "chat_template.jinja")):
        with open(path(folder, "chat_template.jinja"), encoding="utf-8") as f:
            return f.read()
    return tokenizer_config(folder).get("chat_template")


# --- the checkpoint -------------------------------------------------------------------

def remote_code_files(folder: str) -> List[str]:
    """The .py files the published auto_map entries name (config.json's, tokenizer_config.json's)."""
    refs: List[str] = []
    for m in (config(folder).get("auto_map") or {}, tokenizer_config(folder).get("auto_map") or {}):
        for v in m.values():
            refs += [r for r in (v if isinstance(v, list) else [v]) if r]
    return sorted({r.split(".", 1)[0].split("--")[-1] + ".py" for r in refs})


def _remote_code_stubs(root: str, names: List[str]) -> None:
    """The checkpoint's own .py files: they fail loudly if anything imports them."""
    for name in names:
        with open(os.path.join(root, name), "w") as f:
            f.write(f"raise RuntimeError('remote code {name} ran')\n")


def _dump(file: str, obj: Any) -> None:
    with open(file, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)


def build(folder_name: str, root: str, seed: int = 0) -> str:
    """A loadable tiny checkpoint of the vendored published set `folder_name` in `root`."""
    os.makedirs(root, exist_ok=True)
    hf = shrink(config(folder_name))
    cfg = _write_weights(root, hf, read_json(folder_name, INDEX), seed)
    _dump(os.path.join(root, "config.json"), hf)  # over save_model's own config.json
    for name in os.listdir(path(folder_name)):
        if name not in REWRITTEN and name != "SOURCE.md":
            shutil.copyfile(path(folder_name, name), os.path.join(root, name))
    _write_tokenizer(root, folder_name, cfg)
    _remote_code_stubs(root, remote_code_files(folder_name))
    return root


def build_from_config(hf: Dict[str, Any], root: str, seed: int = 0) -> str:
    """A loadable tiny checkpoint from a published config.json alone, for a set whose other
    files no stored source holds (Fast-dLLM v2): `hf` shrunk as `build` shrinks, weights
    as one model.safetensors under the family's names, no tokenizer files."""
    os.makedirs(root, exist_ok=True)
    hf = shrink(hf)
    _write_weights(root, hf, None, seed)
    _dump(os.path.join(root, "config.json"), hf)
    return root


__all__ = ["build", "build_from_config", "folders", "rebuilt", "rebuilt_folders", "REBUILT_MARK",
           "shrink", "config", "tokenizer_config", "added_tokens", "published_ids", "mask_token",
           "chat_template", "remote_code_files", "kept_names", "bpe_vocab", "token_text", "VENDORED", "SHARED",
           "IDS_PUBLISHED_ELSEWHERE", "MASK_TOKENS_ELSEWHERE", "ADDED_TOKENS_JSON_DIFFERS", "MERGES", "SHRINK"]
