"""The preflight's checkpoint checks, torch-free and in seconds: config.json parsed by the
model's family (every key honoured, known to be irrelevant, or refused), every safetensors
shard's header (names and shapes against what config.json implies, no weights read, a
truncated file refused), the adapter's config and tensor headers against the base model,
and where the stop ids come from. Called by pipeline.preflight.check_model; each problem is a
one-line message for JobError."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional, Tuple

from common.model_source import ModelSourceError, classify, resolve_model
from common.storage import StorageOptions
from engine.models.families.diffusion_gemma import checkpoint_config, is_diffusion_gemma

from .errors import CheckpointRefused


def _read_json(path: str) -> Dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def model_config(model_dir: str, attention: str = "auto") -> Any:
    """The engine's ModelConfig of `model_dir` (CheckpointRefused naming the key)."""
    from engine.models.config import ModelConfig

    path = os.path.join(model_dir, "config.json")
    try:
        hf = _read_json(path)
    except Exception as e:  # noqa: BLE001
        raise CheckpointRefused(f"{path} is not valid JSON: {e}") from e
    if is_diffusion_gemma(hf):
        return diffusion_gemma_config(path, hf, attention)
    try:
        cfg = ModelConfig.from_hf(hf)
    except KeyError as e:
        raise CheckpointRefused(f"{path} lacks {e}", "model") from e
    except Exception as e:  # noqa: BLE001
        raise CheckpointRefused(f"{path}: {e}", "model") from e
    if attention != "auto":
        cfg.dllm_attention = attention
    return cfg


def diffusion_gemma_config(path: str, hf: Dict[str, Any], attention: str) -> Any:
    """A DiffusionGemma checkpoint (served by engine.canvas with transformers' own class):
    its config checked, its approximate ModelConfig (the sorter's sizes); --attention does
    not apply to it and is refused."""
    from engine.models.families.base import ConfigRefused
    from engine.models.families.diffusion_gemma import approx_model_config

    if attention != "auto":
        raise CheckpointRefused(f"--attention {attention} applies to masked-diffusion models only; {path} is "
                                "DiffusionGemma (its attention is its own: causal encoder, bidirectional canvas)")
    try:
        return approx_model_config(hf)
    except (ConfigRefused, KeyError, TypeError, ValueError) as e:
        raise CheckpointRefused(f"{path}: {e}", "model") from e


class RemoteFiles:
    """engine.models.checkpoint's file operations on an fsspec filesystem: byte ranges only,
    so a remote model's shard headers are checked without downloading its weights."""

    def __init__(self, fs: Any):
        self.fs = fs

    def read(self, path: str, start: int, end: int) -> bytes:
        return self.fs.cat_file(path, start=start, end=end)

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def isfile(self, path: str) -> bool:
        return bool(self.fs.isfile(path))

    def names(self, path: str) -> list:
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(path, detail=False)]


def check_checkpoint(model_dir: str, *, model: Optional[str] = None, adapter: Optional[str] = None,
                     attention: str = "auto", storage: Optional[StorageOptions] = None) -> Any:
    """The ModelConfig the engines will build, after every check. `model`: what --model
    named when `model_dir` is a metadata-only copy of it: the shard headers of an
    object-storage model are then read remotely (byte ranges); a hub model's weights are
    checked by the engines that download them."""
    from engine.models.checkpoint import CheckpointError, LocalFiles, check_weights

    from common.storage import get_filesystem

    cfg = model_config(model_dir, attention)
    if checkpoint_config(model_dir) is not None:
        if adapter:
            raise CheckpointRefused("--adapter (a LoRA merged into a masked-diffusion model) does not apply to "
                                    f"DiffusionGemma ({model_dir}); drop --adapter")
        return cfg  # its weights are read by transformers' own from_pretrained in the engines
    where: Optional[Tuple[str, Any]] = (model_dir, LocalFiles)
    if model is not None and not classify(model).is_local:
        if classify(model).kind == "remote":
            fs, root = get_filesystem(model, storage)
            where = (root, RemoteFiles(fs))
        else:
            where = None
    if where is not None:
        try:
            check_weights(where[0], cfg, where[1])
        except (CheckpointError, FileNotFoundError) as e:
            raise CheckpointRefused(f"{e}", "model") from e
    if adapter:
        check_adapter(adapter, cfg, storage)
    return cfg


def check_canvas_options(model_dir: str, sampling: Any, engine: Any) -> None:
    """A DiffusionGemma run with a masked-diffusion-only option set (block_length, cache,
    policy, ...) is refused, naming them: they would otherwise be silently ignored."""
    from engine.models.families.diffusion_gemma import masked_only_settings

    if checkpoint_config(model_dir) is not None:
        bad = masked_only_settings(sampling, engine)
        if bad:
            raise CheckpointRefused(f"{', '.join(bad)}: masked-diffusion options, which do not apply to "
                                    f"DiffusionGemma ({model_dir}); leave them at their defaults")


def check_adapter(adapter: str, cfg: Any, storage: Optional[StorageOptions] = None) -> str:
    """The adapter fetched (a remote one into the node's cache, by --model's rules) and
    checked against the base model from its config and tensor headers; its local folder."""
    from engine.models.lora import AdapterError, plan_adapter

    try:
        local = resolve_model(adapter, storage, kind="adapter")
    except ModelSourceError as e:
        raise CheckpointRefused(f"{e}", "adapter") from e
    if classify(adapter).is_local and not os.path.isdir(local):
        raise CheckpointRefused(f"adapter {adapter} is not a directory", "adapter")
    try:
        plan_adapter(local, cfg, cfg.family.param_shapes(cfg))
    except AdapterError as e:
        raise CheckpointRefused(f"{e}", "adapter") from e
    return local


def stop_sources(model_dir: str, override: Optional[list] = None) -> Dict[str, str]:
    """{stop id: where it came from} for the job summary: the checkpoint's (config.json,
    generation_config.json, the chat template), or --stop-token-ids when given."""
    from engine.models.stops import checkpoint_stop_ids

    if override is not None:
        return {str(t): "--stop-token-ids" for t in override}
    return {str(t): src for t, src in checkpoint_stop_ids(model_dir).items()}


__all__ = ["check_checkpoint", "check_canvas_options", "check_adapter", "model_config", "stop_sources", "CheckpointRefused"]
