"""The ids that end a row, read from the checkpoint itself: config.json's and
generation_config.json's `eos_token_id` (an int or a list) and the chat template's
end-of-turn token (`<|eot_id|>`, `<|im_end|>`) where the tokenizer defines it. No rule
on vocabulary sizes: a re-exported or resized checkpoint keeps its stops. Torch-free
(the preflight and the job summary read it)."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>")

# Where the default stop ids come from, for --help and the README.
STOP_IDS_HELP = ("config.json's and generation_config.json's eos_token_id (int or list) and the chat template's "
                 "end-of-turn token (<|eot_id|>, <|im_end|>) where the tokenizer defines it")


def _read(path: str) -> Optional[Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _ids(value: Any) -> List[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def chat_template_text(model_dir: str) -> str:
    """Every chat template the tokenizer files carry, concatenated (tokenizer_config.json's
    `chat_template`, a string or a list of named templates, and chat_template.jinja)."""
    parts: List[str] = []
    tc = _read(os.path.join(model_dir, "tokenizer_config.json")) or {}
    tpl = tc.get("chat_template") if isinstance(tc, dict) else None
    if isinstance(tpl, str):
        parts.append(tpl)
    elif isinstance(tpl, list):
        parts += [t.get("template", "") for t in tpl if isinstance(t, dict)]
    try:
        with open(os.path.join(model_dir, "chat_template.jinja"), encoding="utf-8") as f:
            parts.append(f.read())
    except OSError:
        pass
    return "\n".join(parts)


def defined_tokens(model_dir: str) -> Dict[str, int]:
    """{content: id} of the tokenizer's added tokens (tokenizer_config.json's
    added_tokens_decoder, tokenizer.json's added_tokens)."""
    out: Dict[str, int] = {}
    tc = _read(os.path.join(model_dir, "tokenizer_config.json")) or {}
    for i, tok in ((tc.get("added_tokens_decoder") or {}) if isinstance(tc, dict) else {}).items():
        if isinstance(tok, dict) and "content" in tok:
            out[tok["content"]] = int(i)
    tj = _read(os.path.join(model_dir, "tokenizer.json")) or {}
    for tok in (tj.get("added_tokens") or []) if isinstance(tj, dict) else []:
        if isinstance(tok, dict) and "content" in tok and "id" in tok:
            out.setdefault(tok["content"], int(tok["id"]))
    return out


def checkpoint_stop_ids(model_dir: str, hf: Optional[Dict[str, Any]] = None) -> Dict[int, str]:
    """{stop id: where it came from}, in the order found."""
    found: Dict[int, str] = {}
    hf = hf if hf is not None else (_read(os.path.join(model_dir, "config.json")) or {})
    for t in _ids(hf.get("eos_token_id")):
        found.setdefault(t, "config.json eos_token_id")
    for t in _ids(hf.get("eot_token_id")):
        found.setdefault(t, "config.json eot_token_id")
    gen = _read(os.path.join(model_dir, "generation_config.json")) or {}
    for t in _ids(gen.get("eos_token_id") if isinstance(gen, dict) else None):
        found.setdefault(t, "generation_config.json eos_token_id")
    template = chat_template_text(model_dir)
    tokens = defined_tokens(model_dir) if template or not found else {}
    for name in END_OF_TURN if template else ():
        if name in template and name in tokens:
            found.setdefault(tokens[name], f"chat template end of turn {name}")
    eos = tokenizer_eos(model_dir, tokens) if not found else None
    if eos is not None:  # no eos_token_id anywhere (LLaDA2's config.json): the tokenizer's eos_token
        found[eos] = "tokenizer_config.json eos_token"
    return found


def tokenizer_eos(model_dir: str, tokens: Optional[Dict[str, int]] = None) -> Optional[int]:
    """The id of tokenizer_config.json's eos_token among the added tokens, or None."""
    eos = (_read(os.path.join(model_dir, "tokenizer_config.json")) or {}).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    tokens = defined_tokens(model_dir) if tokens is None else tokens
    return tokens.get(eos) if isinstance(eos, str) else None


def describe(stops: Dict[int, str]) -> str:
    """One line: `126081 (config.json eos_token_id), 126348 (chat template end of turn <|eot_id|>)`."""
    return ", ".join(f"{t} ({src})" for t, src in stops.items()) or "none"


__all__ = ["checkpoint_stop_ids", "tokenizer_eos", "describe", "chat_template_text", "defined_tokens", "END_OF_TURN",
           "STOP_IDS_HELP"]
