"""blockray's engine: pure torch, no Ray. Models (LLaDA, Dream), decoding policies and
the BlockServe block-grained continuous-batching loop.

Names are imported lazily: the data side imports `engine.config` (dataclasses only) in
every CPU worker, and must not pay for importing torch there.
"""
from __future__ import annotations

from common.lazy import lazy_exports

_EXPORTS = {
    "EngineConfig": ".config",
    "SamplingParams": ".config",
    "Engine": ".engine",
    "EngineStats": ".stats",
    "BatchRecord": ".engine",
    "load_model": ".loader",
    "save_model": ".loader",
    "ModelConfig": ".models",
    "build_model": ".models",
    "RequestOutput": ".sequence",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
