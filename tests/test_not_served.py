"""What the README says is not served yet is refused, naming the key that needs it, never
run with the math of an older version (issue 54). LLaDA2.2-flash's config.json is
2.1's plus the keys located in ../shared/checkpoints/inclusionAI__LLaDA2.2-flash/SOURCE.md
(no byte copy is reachable): block routing (`block_size`, `expert_capacity`) and the
Levenshtein edit tokens; running its weights with 2.1's grouped routing gives wrong output."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import ROOT
from engine.models.config import ModelConfig
from engine.models.families import ConfigRefused


def llada2_2_flash_config() -> dict:
    """LLaDA2.1-mini's published config.json with 2.2's located changes (SOURCE.md, section 3.1)."""
    cfg = json.loads(Path(ROOT, "tests/published/inclusionAI__LLaDA2.1-mini/config.json").read_text())
    cfg.pop("sliding_window", None)
    cfg.update(block_size=32, expert_capacity=48, delete_token_id=156930, split_token_id=156931,
               use_qk_norm=True, max_position_embeddings=131072, rope_theta=3000000)
    return cfg


@pytest.mark.parametrize("key", ["block_size", "expert_capacity", "delete_token_id", "split_token_id"])
def test_llada2_2_is_refused_naming_each_key_it_needs(key):
    cfg = llada2_2_flash_config()
    with pytest.raises(ConfigRefused, match=f"'{key}'"):  # the first one read: each, alone
        ModelConfig.from_hf({k: v for k, v in cfg.items()
                             if k == key or k not in ("block_size", "expert_capacity", "delete_token_id",
                                                      "split_token_id")})
