"""Character-level tokenizer of the embedded tiny diffusion LM.

Why: one token per character makes answer lengths in tokens equal answer lengths in
chars, so the tiny task family controls exactly how many 8-token blocks a request
needs. Specials come first with fixed ids (pad=0, eos=1, mask=2, unk=3) so model
configs never change when the character set grows. Saved in the Hugging Face layout
(tokenizer.json + tokenizer_config.json + special_tokens_map.json) so
`transformers.AutoTokenizer.from_pretrained(dir)` loads it offline as a fast
tokenizer that adds no BOS/EOS and decodes without inserting spaces.
"""
from __future__ import annotations

import json
import os
from typing import Union

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from tiny.tasks import CHARS

PAD, EOS, MASK, UNK = "<|pad|>", "<|eos|>", "<|mask|>", "<|unk|>"
SPECIALS: tuple[str, ...] = (PAD, EOS, MASK, UNK)  # ids 0..3, in this order
PAD_ID, EOS_ID, MASK_ID, UNK_ID = range(len(SPECIALS))


def vocab() -> dict[str, int]:
    """Token -> id: the specials, then every char of CHARS in order."""
    assert len(set(CHARS)) == len(CHARS), "CHARS must not repeat a character"
    return {tok: i for i, tok in enumerate(SPECIALS + tuple(CHARS))}


def build_tokenizer() -> Tokenizer:
    """A WordLevel model over single chars: the pre-tokenizer isolates every char
    (spaces included, so they stay tokens), the Fuse decoder concatenates tokens
    instead of joining them with spaces, and no post-processor adds BOS/EOS."""
    tok = Tokenizer(models.WordLevel(vocab=vocab(), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    return tok


def save_tokenizer(out_dir: Union[str, os.PathLike]) -> dict[str, int]:
    """Write the Hugging Face tokenizer files into `out_dir`; return the ids a model
    config needs: {pad, eos, mask, unk, vocab_size}."""
    os.makedirs(out_dir, exist_ok=True)
    tok = build_tokenizer()
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    specials = {"pad_token": PAD, "eos_token": EOS, "mask_token": MASK, "unk_token": UNK}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": False,
        "add_eos_token": False,
        # transformers' default clean-up would turn " ." into "." on decode.
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "padding_side": "left",  # the engine left-pads rows
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(specials, f, indent=2)
    return {
        "pad": PAD_ID, "eos": EOS_ID, "mask": MASK_ID, "unk": UNK_ID,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
    }
