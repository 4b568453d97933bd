"""sort="blendserve": what a request costs (cost, model), which prompts share a prefix
(prefix) and the lazy windowed ordering stage built from them (order).

Names are imported lazily, so that `import pipeline.sorting` costs nothing and no
torch is pulled into a data worker by any of them (the model description is the
engine's ModelConfig, loaded without its torch-importing package init).
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CACHE_MODES": ".cost", "CostModel": ".cost", "Roofline": ".cost", "Work": ".cost", "blocks": ".cost",
    "work": ".cost",
    "CPU": ".model", "H200": ".model", "DeviceProfile": ".model", "ModelProfile": ".model",
    "device_profile": ".model", "dtype_bytes": ".model", "model_config_class": ".model",
    "read_model_config": ".model",
    "PREFIX_CHUNK": ".prefix", "prefix_key": ".prefix",
    "COST_BUCKET_RATIO": ".order", "SortWindowUDF": ".order", "cost_model": ".order", "full_canvas": ".order",
    "order_dataset": ".order", "with_remote_args": ".order",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pipeline.sorting' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
