"""The ids that end a row and the tokenizer facts config.json leaves out, from the
checkpoint's own files: config.json's and generation_config.json's `eos_token_id` (an
int or a list) and the chat template's end-of-turn token (`<|eot_id|>`, `<|im_end|>`)
where the tokenizer defines it; no rule on vocabulary sizes, so a re-exported or resized
checkpoint keeps its stops. Pure functions of the parsed files (engine.checkpoint reads
them once). Torch-free."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from common.model_source import SourceFiles
from common.tokenizer import TOKENIZER_FILES  # noqa: F401 - re-exported: the one list of tokenizer files

END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>")

# Where the default stop ids come from, for --help and the README.
STOP_IDS_HELP = ("config.json's and generation_config.json's eos_token_id (int or list) and the chat template's "
                 "end-of-turn token (<|eot_id|>, <|im_end|>) where the tokenizer defines it")


@dataclass(frozen=True)
class TokenizerFacts:
    """What the tokenizer files say without loading a tokenizer: whether there are any,
    tokenizer_config.json, the added tokens ({content: id}: tokenizer_config.json's
    added_tokens_decoder, added_tokens.json, tokenizer.json's added_tokens), every chat
    template (tokenizer_config.json's `chat_template`, a string or named templates, and
    chat_template.jinja), and the id of tokenizer_config.json's eos_token."""

    present: bool = False
    config: Dict[str, Any] = field(default_factory=dict)
    tokens: Dict[str, int] = field(default_factory=dict)
    chat_template: str = ""
    eos: Optional[int] = None

    @classmethod
    def read(cls, files: SourceFiles) -> "TokenizerFacts":
        tc = _dict(files.json("tokenizer_config.json"))
        tokens: Dict[str, int] = {}
        for i, tok in (_dict(tc.get("added_tokens_decoder"))).items():
            if isinstance(tok, dict) and "content" in tok:
                tokens[tok["content"]] = int(i)
        for content, i in _dict(files.json("added_tokens.json")).items():
            if isinstance(i, int):
                tokens.setdefault(content, i)
        if "tokenizer.json" in files.files:
            for tok in _dict(files.json("tokenizer.json")).get("added_tokens") or []:
                if isinstance(tok, dict) and "content" in tok and "id" in tok:
                    tokens.setdefault(tok["content"], int(tok["id"]))
        tpl = tc.get("chat_template")
        parts: List[str] = [tpl] if isinstance(tpl, str) else [t.get("template", "") for t in tpl or []
                                                              if isinstance(t, dict)]
        jinja = files.bytes("chat_template.jinja")
        if jinja is not None:
            parts.append(jinja.decode("utf-8", "replace"))
        eos = tc.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        return cls(present=any(f in files.files for f in TOKENIZER_FILES), config=tc, tokens=tokens,
                   chat_template="\n".join(parts), eos=tokens.get(eos) if isinstance(eos, str) else None)


def _dict(value: Any) -> Dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _ids(value: Any) -> List[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def stop_ids(hf: Mapping[str, Any], generation: Mapping[str, Any], tok: TokenizerFacts) -> Dict[int, str]:
    """{stop id: where it came from}, in the order found."""
    found: Dict[int, str] = {}
    for t in _ids(hf.get("eos_token_id")):
        found.setdefault(t, "config.json eos_token_id")
    for t in _ids(hf.get("eot_token_id")):
        found.setdefault(t, "config.json eot_token_id")
    for t in _ids(generation.get("eos_token_id")):
        found.setdefault(t, "generation_config.json eos_token_id")
    for name in END_OF_TURN if tok.chat_template else ():
        if name in tok.chat_template and name in tok.tokens:
            found.setdefault(tok.tokens[name], f"chat template end of turn {name}")
    if not found and tok.eos is not None:  # no eos_token_id anywhere (LLaDA2's config.json): the tokenizer's
        found[tok.eos] = "tokenizer_config.json eos_token"
    return found


def checkpoint_stop_ids(model_dir: str, hf: Optional[Mapping[str, Any]] = None) -> Dict[int, str]:
    """stop_ids of the checkpoint folder `model_dir` (its files read here: tests and tools;
    a run reads them once, in engine.checkpoint)."""
    files = SourceFiles(model_dir)
    return stop_ids(hf if hf is not None else _dict(files.json("config.json")),
                    _dict(files.json("generation_config.json")), TokenizerFacts.read(files))


def describe(stops: Mapping[int, str]) -> str:
    """One line: `126081 (config.json eos_token_id), 126348 (chat template end of turn <|eot_id|>)`."""
    return ", ".join(f"{t} ({src})" for t, src in stops.items()) or "none"


__all__ = ["TokenizerFacts", "stop_ids", "checkpoint_stop_ids", "describe", "END_OF_TURN", "STOP_IDS_HELP",
           "TOKENIZER_FILES"]
