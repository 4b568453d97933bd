"""The checkpoint's tokenizer from local files, never with remote code.

A checkpoint whose tokenizer_config.json names a class transformers lacks (with an
`auto_map` to its own tokenization_*.py) is read with the transformers class it is a
copy of when its files are that class's format: Dream's DreamTokenizer is transformers'
Qwen2Tokenizer (same pre-tokenizer regex, NFC normalisation, byte-level BPE over
vocab.json + merges.txt), so those files load with Qwen2Tokenizer and keep
tokenizer_config.json's added tokens, special tokens and chat template. Anything else
that needs the checkpoint's code is refused with a message naming what is needed."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

# tokenizer_class shipped as remote code -> (the transformers class it copies, the files it reads)
COPIES: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "DreamTokenizer": ("Qwen2Tokenizer", ("vocab.json", "merges.txt")),
}


class NeedsRemoteCode(ValueError):
    """The tokenizer can only be built by code shipped with the checkpoint."""


def has_tokenizer(model_dir: str) -> bool:
    return any(os.path.exists(os.path.join(model_dir, f)) for f in TOKENIZER_FILES)


def _tokenizer_config(model_dir: str) -> Dict[str, Any]:
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def tokenizer_class(model_dir: str, config: Optional[Dict[str, Any]] = None,
                    tokenizer_config: Optional[Dict[str, Any]] = None) -> Tuple[Optional[str], Optional[str]]:
    """(the transformers class to load with, or None for AutoTokenizer; the remote class
    it stands in for). Raises NeedsRemoteCode when no transformers class reads the files.
    `tokenizer_config`: tokenizer_config.json as the caller parsed it (a run's Checkpoint:
    TokenizerFacts.config), else read here."""
    import transformers

    cfg = _tokenizer_config(model_dir) if tokenizer_config is None else tokenizer_config
    cls = cfg.get("tokenizer_class")
    if not cls or hasattr(transformers, cls) or hasattr(transformers, cls.removesuffix("Fast")):
        return ("TokenizersBackend" if plain_tokenizer(model_dir, config, cfg) else None), None
    base = cls.removesuffix("Fast")
    if base in COPIES:
        target, files = COPIES[base]
        missing = [f for f in files if not os.path.isfile(os.path.join(model_dir, f))]
        if not missing:
            return target, cls
        need = f"{base} is transformers' {target}, read from {' + '.join(files)}; {', '.join(missing)} missing"
    else:
        known = "; ".join(f"{k} (as {v[0]} over {' + '.join(v[1])})" for k, v in COPIES.items())
        need = (f"transformers has no {cls!r} and it is not a known copy of a transformers class (known: {known}); "
                "give the checkpoint a tokenizer.json with \"tokenizer_class\": \"PreTrainedTokenizerFast\", or name "
                "the transformers class its files are for")
    auto = cfg.get("auto_map")
    where = f"tokenizer_config.json tokenizer_class {cls!r}" + (f" (auto_map {json.dumps(auto)[:160]})" if auto else "")
    raise NeedsRemoteCode(f"{model_dir} needs remote code for its tokenizer ({where}), which blockray never runs: "
                          f"{need}")


# tokenizer_config.json classes that AutoTokenizer loads as TokenizersBackend from tokenizer.json
PLAIN_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def plain_tokenizer(model_dir: str, config: Optional[Dict[str, Any]] = None, cfg: Optional[Dict[str, Any]] = None
                    ) -> bool:
    """True when AutoTokenizer's choice is TokenizersBackend whatever the model's config
    says: tokenizer_config.json (`cfg`) names a plain class and no auto_map, there is a
    tokenizer.json, and config.json's (`config`, else read here) model_type is not a
    transformers model (AutoTokenizer then reads a bare PreTrainedConfig and decides by
    tokenizer_class alone). Loading that class directly skips AutoConfig, whose import
    pulls in torch: 3 CPU-s and ~250 MB in every process that only tokenizes (the tokenize
    and detokenize tasks, the driver's checks). tests/test_checkpoints.py checks it against
    AutoTokenizer on every layout."""
    cfg = _tokenizer_config(model_dir) if cfg is None else cfg
    if cfg.get("tokenizer_class") not in PLAIN_CLASSES or "auto_map" in cfg or not os.path.isfile(
            os.path.join(model_dir, "tokenizer.json")):
        return False
    model_type = _model_config(model_dir, config).get("model_type")
    from transformers.models.auto.auto_mappings import CONFIG_MAPPING_NAMES  # torch-free

    return isinstance(model_type, str) and bool(model_type) and model_type not in CONFIG_MAPPING_NAMES


def _model_config(model_dir: str, config: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """config.json as the caller read it (a run's Checkpoint: engine.checkpoint), else read here."""
    if config is not None:
        return config
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError):
        return {}  # no model_type: AutoConfig guesses one from the path
    return found if isinstance(found, dict) else {}


# Text longer than this is counted in pieces of this many characters before it is
# tokenized whole (encode_bounded): one piece costs ~25 MB in a fast tokenizer (offsets and
# alignments per character), a whole 5 MiB prompt ~2 GB.
PIECE_CHARS = 1 << 16


class PromptTooLong(ValueError):
    """A text already over the token limit within its first `chars` characters."""

    def __init__(self, tokens: int, chars: int, total: int, limit: int):
        super().__init__(f"its first {chars:,} of {total:,} characters are already {tokens:,} tokens, over the "
                         f"{limit:,} a request can hold")


def _cut(text: str, start: int) -> int:
    """The end of the piece starting at `start`: just before the last whitespace in its second
    half (where word-level pre-tokenizers split anyway), else PIECE_CHARS on."""
    end = start + PIECE_CHARS
    if end >= len(text):
        return len(text)
    at = max(text.rfind(" ", start + PIECE_CHARS // 2, end), text.rfind("\n", start + PIECE_CHARS // 2, end))
    return at if at > start else end


_LONGEST: Dict[int, int] = {}  # id(tokenizer) -> its longest token in characters


def encode_bounded(tok: Any, text: str, max_tokens: Optional[int], add_special_tokens: bool = False) -> List[int]:
    """The token ids of `text`, unless it is certainly more than `max_tokens` (None: no
    bound): a text over PIECE_CHARS characters is first counted piece by piece, stopping
    with PromptTooLong once over, so a prompt far longer than the context is never tokenized
    whole and memory stays flat. Why no character bound alone: a tokenizer guarantees no
    minimum of characters per token in the worst case (a normalizer may drop characters).
    The pieces' sum can exceed the whole's count only at the cuts (a token of the whole cut
    in two, at most its length in tokens; none where the pre-tokenizer splits before
    whitespace anyway), so each cut is allowed the longest token in the vocabulary."""
    if max_tokens is not None and len(text) > PIECE_CHARS:
        if id(tok) not in _LONGEST:
            _LONGEST[id(tok)] = max(map(len, tok.get_vocab()), default=1)
        count, start, cuts = 0, 0, 0
        while start < len(text):
            end = _cut(text, start)
            count += len(tok(text[start:end], add_special_tokens=False)["input_ids"])
            cuts += end < len(text)
            if count > max_tokens + cuts * _LONGEST[id(tok)]:
                raise PromptTooLong(count, end, len(text), max_tokens)
            start = end
    return list(tok(text, add_special_tokens=add_special_tokens)["input_ids"])


_LOADED: Dict[str, Any] = {}  # model_dir -> its tokenizer (or None): each process reads the files once


def load_tokenizer(model_dir: str, config: Optional[Dict[str, Any]] = None,
                   tokenizer_config: Optional[Dict[str, Any]] = None):
    """The tokenizer in `model_dir`, or None when it has no tokenizer files: the one
    loader of every layer (stages, preflight, the engine's stop strings), cached per
    process, so each actor reads the files once. `config` and `tokenizer_config`: the
    model's config.json and tokenizer_config.json as the caller parsed them (a run's
    Checkpoint: Checkpoint.load_tokenizer), so that only transformers' own load reads the
    folder (AutoTokenizer is given the config it would have loaded)."""
    if model_dir not in _LOADED:
        _LOADED[model_dir] = _load(model_dir, config, tokenizer_config) if has_tokenizer(model_dir) else None
    return _LOADED[model_dir]


def _load(model_dir: str, config: Optional[Dict[str, Any]], tokenizer_config: Optional[Dict[str, Any]]):
    import transformers
    from transformers.utils import logging as hf_logging

    target, _ = tokenizer_class(model_dir, config, tokenizer_config)
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # silence "model of type llada" noise from config.json
    try:
        if target is not None:
            return getattr(transformers, target).from_pretrained(model_dir, local_files_only=True)
        # trust_remote_code=False, explicitly: never run a model directory's code, and never
        # let transformers ask an interactive [y/N] question.
        kw: Dict[str, Any] = {}
        if config is not None and config.get("model_type") in _config_names():
            kw["config"] = transformers.AutoConfig.for_model(
                config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
        return transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False,
                                                          **kw)
    finally:
        hf_logging.set_verbosity(level)


def _config_names() -> Any:
    from transformers.models.auto.auto_mappings import CONFIG_MAPPING_NAMES  # torch-free

    return CONFIG_MAPPING_NAMES


__all__ = ["load_tokenizer", "has_tokenizer", "tokenizer_class", "plain_tokenizer", "NeedsRemoteCode", "COPIES",
           "TOKENIZER_FILES", "encode_bounded", "PromptTooLong", "PIECE_CHARS"]
