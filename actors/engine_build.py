"""How an engine is built in a Ray process: the device and dtype an EngineSpec names, the
model and its engine factory (`load_engine`), the warm-up. Shared by the engine actor
(actors/engine_actor.py, rank 0) and the other ranks of a tensor-parallel engine
(actors/tensor_parallel.py), which both import it (so neither imports the other).
torch loads when these run, not at import."""
from __future__ import annotations

import logging
from typing import Any, Callable

from engine.engines import engine_for  # torch-free at import

from .spec import EngineSpec

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> Any:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: Any, device: Any) -> Any:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def load_engine(spec: EngineSpec, ckpt: Any, device: Any, weights_dir: str, tokenizer: Callable[[], Any],
                tp: Any = None) -> "tuple[Any, Any, Any, Callable[[], Any]]":
    """(model, its Budget, the engine config with its token budget, a factory of engines)
    of `ckpt` on `device`: what an engine actor (and each other rank of a tensor-parallel
    engine, given its `tp`: engine.parallel) loads. `tokenizer`: the tokenizer an engine is
    built with, read when one is built (loaded at the first row with stop strings)."""
    dtype = resolve_dtype(spec.dtype, device)
    built = engine_for(ckpt.serving).build(ckpt, spec.engine, dtype=dtype, device=device, weights_dir=weights_dir,
                                           tokenizer=tokenizer, record_batches=spec.record_batches, tp=tp)
    return built.model, built.budget, built.config, built.factory


def warm_up(model: Any, engine_config: Any) -> None:
    """One throwaway request on a throwaway engine: the first forwards of a process are slow
    (lazy kernel setup), which would otherwise land in the first batch's latencies and
    metrics (every rank of a tensor-parallel engine makes the same one)."""
    from engine import Engine, SamplingParams

    try:
        cfg = model.config
        token = next(t for t in range(cfg.vocab_size) if t not in (cfg.mask_token_id, *cfg.stop_token_ids))
        Engine(model, engine_config).generate([[token]], SamplingParams(max_new_tokens=engine_config.block_length))
    except Exception:  # noqa: BLE001 - warm-up is best effort
        logger.warning("engine warm-up failed", exc_info=True)
