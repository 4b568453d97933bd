"""What the README says is not served yet is refused, naming the key that needs it, never
run with the math of an older version (issue 54). LLaDA2.2-flash's config.json is
2.1's plus the keys located in ../shared/checkpoints/inclusionAI__LLaDA2.2-flash/SOURCE.md
(no byte copy is reachable). Its block routing (`block_size`, `expert_capacity`) is built
(tests/test_block_routing.py); its Levenshtein edit loop is not: the edit tokens
(`delete_token_id`, `split_token_id`) are refused, so a 2.2 config is never decoded with
2.1's loop, which never deletes or inserts a position."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import ROOT
from engine.models.config import ModelConfig
from engine.models.families import ConfigRefused

EDIT_TOKENS = ("delete_token_id", "split_token_id")


def llada2_2_flash_config() -> dict:
    """LLaDA2.1-mini's published config.json with 2.2's located changes (SOURCE.md, section 3.1)."""
    cfg = json.loads(Path(ROOT, "tests/published/inclusionAI__LLaDA2.1-mini/config.json").read_text())
    cfg.pop("sliding_window", None)
    cfg.update(block_size=32, expert_capacity=48, delete_token_id=156930, split_token_id=156931,
               use_qk_norm=True, max_position_embeddings=131072, rope_theta=3000000)
    return cfg


@pytest.mark.parametrize("key", EDIT_TOKENS)
def test_llada2_2_is_refused_naming_each_edit_token(key):
    """Each edit token alone (the rest of 2.2's config accepted) is refused, saying why."""
    cfg = llada2_2_flash_config()
    with pytest.raises(ConfigRefused, match=f"'{key}'.*Levenshtein edit token.*deletes positions"):
        ModelConfig.from_hf({k: v for k, v in cfg.items() if k == key or k not in EDIT_TOKENS})


def test_llada2_2_whole_config_is_refused():
    with pytest.raises(ConfigRefused, match="'delete_token_id'"):
        ModelConfig.from_hf(llada2_2_flash_config())


def test_block_routing_keys_are_honoured_not_refused():
    """2.2's config without the edit tokens: block routing, 48 of 256 experts per 32 tokens."""
    cfg = ModelConfig.from_hf({k: v for k, v in llada2_2_flash_config().items() if k not in EDIT_TOKENS})
    assert (cfg.moe.expert_capacity, cfg.moe.block_size, cfg.moe.block_routed) == (48, 32, True)
    assert cfg.to_hf()["expert_capacity"] == 48 and cfg.to_hf()["block_size"] == 32
