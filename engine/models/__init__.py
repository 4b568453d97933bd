"""Model definitions. Names are imported lazily, as in `engine`: the data side reads
`ModelConfig` (engine.models.config, no torch) in CPU workers that must not import torch."""
from __future__ import annotations

from common.lazy import lazy_exports

_EXPORTS = {"ModelConfig": ".config", "DLLM": ".transformer", "KVCache": ".transformer",
            "build_model": ".transformer", "checkpoint_names": ".weights"}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
