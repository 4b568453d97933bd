"""Real checkpoint weight names for each layout (declared by its family,
engine.models.families), mapped to the internal DLLM names."""
from __future__ import annotations

from typing import Dict

from .config import ModelConfig


def checkpoint_names(cfg: ModelConfig, internal_names) -> Dict[str, str]:
    """{internal parameter name: checkpoint key} for every name in `internal_names`."""
    return {name: cfg.family.checkpoint_name(name) for name in internal_names}
