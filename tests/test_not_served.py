"""What the README says is not served yet is refused, naming the key that needs it, never
run with the math of an older version (issue 54). LLaDA2.2-flash's config.json is
2.1's plus the keys located in ../shared/checkpoints/inclusionAI__LLaDA2.2-flash/SOURCE.md
(no byte copy is reachable). Its block routing (`block_size`, `expert_capacity`) is built
(tests/test_block_routing.py), and so is its Levenshtein edit loop (engine.indel,
tests/test_llada2_2.py): the edit tokens (`delete_token_id`, `split_token_id`) are read into
the config, both or neither; a row asking for the loop on a checkpoint without them is
refused (test_llada2_2.test_edit_ops_is_refused_where_it_cannot_apply)."""
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
def test_llada2_2_is_refused_naming_a_lone_edit_token(key):
    """One edit token without the other (the rest of 2.2's config accepted) is refused, saying why."""
    cfg = llada2_2_flash_config()
    with pytest.raises(ConfigRefused, match=f"names {key}=.*Levenshtein edit loop needs both"):
        ModelConfig.from_hf({k: v for k, v in cfg.items() if k == key or k not in EDIT_TOKENS})


def test_llada2_2_whole_config_is_honoured():
    """2.2's whole config: block routing and the two edit tokens, written back by to_hf."""
    cfg = ModelConfig.from_hf(llada2_2_flash_config())
    assert (cfg.delete_token_id, cfg.split_token_id) == (156930, 156931)
    assert {k: cfg.to_hf()[k] for k in EDIT_TOKENS} == {"delete_token_id": 156930, "split_token_id": 156931}
    with pytest.raises(ConfigRefused, match="delete_token_id"):
        ModelConfig.from_hf({**llada2_2_flash_config(), "delete_token_id": 10**6})


def test_block_routing_keys_are_honoured_not_refused():
    """2.2's config without the edit tokens: block routing, 48 of 256 experts per 32 tokens."""
    cfg = ModelConfig.from_hf({k: v for k, v in llada2_2_flash_config().items() if k not in EDIT_TOKENS})
    assert (cfg.moe.expert_capacity, cfg.moe.block_size, cfg.moe.block_routed) == (48, 32, True)
    assert cfg.to_hf()["expert_capacity"] == 48 and cfg.to_hf()["block_size"] == 32
