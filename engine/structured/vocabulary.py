"""The tokenizer's vocabulary as bytes per token id, what outlines-core's index is built
over: byte-level BPE tokens (GPT-2's printable alphabet, Qwen2 / Dream) mapped back to
their bytes, SentencePiece's '▁' as a space and <0xNN> as its byte, anything else as its
UTF-8 text. Special and added tokens are left out (they never appear in constrained text;
the stop ids are added by the automaton)."""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Dict, List


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


@lru_cache(maxsize=1)
def unicode_to_bytes() -> Dict[str, int]:
    """The same table, inverted: a token's characters back to its bytes."""
    return {c: b for b, c in bytes_to_unicode().items()}


def byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer's decoder is byte-level BPE's."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in type(decoder).__name__ + repr(decoder)[:40]


def token_bytes(tokenizer: Any) -> Dict[bytes, List[int]]:
    """{token's bytes: its ids} of every non-special, non-added token."""
    skip = set(getattr(tokenizer, "all_special_ids", []) or []) | set(
        (getattr(tokenizer, "added_tokens_decoder", None) or {}).keys())
    vocab = tokenizer.get_vocab()
    u2b = unicode_to_bytes() if byte_level(tokenizer) else None
    out: Dict[bytes, List[int]] = {}
    for text, i in vocab.items():
        if i in skip or not text:
            continue
        if u2b is not None:
            if not all(c in u2b for c in text):
                continue  # not a byte-level token (an added one under another name)
            b = bytes(u2b[c] for c in text)
        elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            b = bytes([int(text[3:5], 16)])
        else:
            b = text.replace("\u2581", " ").encode("utf-8")
        out.setdefault(b, []).append(int(i))
    return out
