"""Model definitions. Names are imported lazily, as in `engine`: the data side reads
`ModelConfig` (engine.models.config, no torch) in CPU workers that must not import torch."""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"ModelConfig": ".config", "DLLM": ".transformer", "KVCache": ".transformer",
            "build_model": ".transformer", "checkpoint_names": ".weights"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
