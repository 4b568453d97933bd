"""Tensor-parallel sharding of blockray's transformer (see engine.parallel)."""
from __future__ import annotations

from typing import Any, Optional


def tensor_parallel_of(model: Any, config: Any) -> Optional[Any]:
    """The model's TensorParallel when it spans more than one rank (None on one device);
    ValueError when EngineConfig.tensor_parallel_size disagrees with the model's shards."""
    tp = getattr(model, "tp", None)
    size = 1 if tp is None else tp.size
    if config.tensor_parallel_size != size:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size}, but the model was loaded "
                         f"{'whole' if tp is None else f'as a shard of {size}'} (engine.load_model(..., tp=...) "
                         f"with a TensorParallel of that size, one per rank)")
    return tp if size > 1 else None
