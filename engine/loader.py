"""Load and save models in the Hugging Face directory layout (config.json +
*.safetensors, optionally sharded with an index, + tokenizer files), from local disk
only: nothing is fetched from a hub. What a checkpoint holds is its Checkpoint's
(engine.checkpoint: config.json parsed by the model's family, the shard headers checked,
the adapter planned), so loading reads only weights; a PEFT LoRA adapter is merged at
load time (engine.models.lora)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Tuple, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .checkpoint import Checkpoint
from .config import Attention
from .models import DLLM, ModelConfig, checkpoint_names
from .models.families.base import ConfigRefused
from .models.lora import read_adapter
from .models.sharding import ShardPlan, shard_model
from .parallel import TensorParallel
from common.tokenizer import load_tokenizer


def read_config(path: Union[str, os.PathLike], attention: str = "auto") -> ModelConfig:
    """The ModelConfig of a model folder (engine.checkpoint, without its shard headers)."""
    return Checkpoint.open(str(path), attention=attention, weights=False).config


def load_model(source: Union[str, os.PathLike, Checkpoint], dtype: torch.dtype = torch.bfloat16, device="cpu",
               tokenizer: bool = True, adapter: Optional[Union[str, os.PathLike]] = None,
               attention: str = "auto", weights_dir: Optional[str] = None,
               tp: Optional[TensorParallel] = None) -> Tuple[DLLM, Optional[object]]:
    """(model, tokenizer) of a checkpoint: a local HF-style directory (opened as a
    Checkpoint here, with `adapter` and `attention`), or a Checkpoint the job's preflight
    opened (its adapter and attention already in it), whose weights are in `weights_dir`
    (default: Checkpoint.weights_dir(), a remote model's node-local copy). tokenizer is None
    when the model has no tokenizer files. A config key or tensor the engine would not
    honour, a missing or misshaped weight, or an adapter that does not fit is refused
    (ValueError; KeyError for a missing weight) naming it. `tp` (engine.parallel): this
    rank's shard only (engine.models.sharding), each tensor read by its shard's byte ranges."""
    ckpt = source if isinstance(source, Checkpoint) else Checkpoint.open(
        str(source), adapter=None if adapter is None else str(adapter), attention=attention)
    refusal = ckpt.serving.weights_refusal(ckpt.family)
    if refusal:
        raise ConfigRefused(f"{ckpt.model}: {refusal}")
    root = weights_dir or ckpt.weights_dir()
    cfg = ckpt.config
    with torch.device("meta"):
        model = DLLM(cfg)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes == cfg.family.param_shapes(cfg), "the family's param_shapes disagree with DLLM"
    lora = read_adapter(ckpt.adapter_dir(), ckpt.adapter) if ckpt.adapter is not None else None
    if tp is not None and tp.size > 1:
        model = _load_shard(ckpt, root, dtype, device, lora, tp)
        return model, (load_tokenizer(root, ckpt.hf, ckpt.tokenizer.config) if tokenizer else None)
    state = {}
    handles: Dict[str, object] = {}
    try:
        for name, key in checkpoint_names(cfg, shapes).items():
            file = os.path.join(root, ckpt.tensors[key].file)
            fh = handles.get(file) or handles.setdefault(file, safe_open(file, framework="pt", device="cpu"))
            t = fh.get_tensor(key)
            if lora is not None:
                t = lora.merge(name, t, dtype)
            keep = cfg.family.keeps_float32(name) and dtype.itemsize < 4  # routers stay float32
            state[name] = t.to(device=device, dtype=torch.float32 if keep else dtype)
    finally:
        handles.clear()
    model.load_state_dict(state, assign=True, strict=True)
    model.eval()
    return model, (load_tokenizer(root, ckpt.hf, ckpt.tokenizer.config) if tokenizer else None)


@dataclass
class ShardReads:
    """What a tensor-parallel rank read of the checkpoint: per tensor, the ranges along
    one dimension (`dim`, [(start, stop), ...]) and the bytes they hold (what
    tests/test_tensor_parallel.py checks: no rank reads a range that is not its own)."""

    ranges: Dict[str, Tuple[int, Tuple[Tuple[int, int], ...]]] = field(default_factory=dict)
    bytes: int = 0


_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "BOOL": 1,
                      "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "I8": 1}


def _load_shard(ckpt: Checkpoint, root: str, dtype: torch.dtype, device, lora, tp: TensorParallel) -> DLLM:
    """Rank tp.rank's shard (engine.models.sharding): each tensor read by safetensors'
    get_slice over the shard's ranges only (rows, or columns of every row), the LoRA delta
    merged per shard. The model's `shard_reads` records what was read."""
    cfg = ckpt.config
    plan = ShardPlan(cfg, tp.rank, tp.size)
    with torch.device("meta"):
        model = shard_model(DLLM(plan.local_config()), plan, tp)
    full = cfg.family.param_shapes(cfg)
    reads = ShardReads()
    state = {}
    handles: Dict[str, object] = {}
    try:
        for name, p in model.named_parameters():
            key = cfg.family.checkpoint_name(name)
            piece = plan.piece(name, full[name])
            info = ckpt.tensors[key]
            file = os.path.join(root, info.file)
            fh = handles.get(file) or handles.setdefault(file, safe_open(file, framework="pt", device="cpu"))
            sl = fh.get_slice(key)
            if piece.dim == 0:
                parts = [sl[a:b] for a, b in piece.ranges]
            else:
                parts = [sl[:, a:b] for a, b in piece.ranges]
            item = _SAFETENSORS_BYTES.get(info.dtype, 0)
            reads.ranges[key] = (piece.dim, piece.ranges)
            reads.bytes += sum(t.numel() for t in parts) * item
            if piece.pad:
                parts.append(parts[0].new_zeros((piece.pad, *parts[0].shape[1:])))
            t = torch.cat(parts, piece.dim) if len(parts) > 1 else parts[0]
            if lora is not None:
                t = lora.merge_shard(name, t, dtype, piece)
            if tuple(t.shape) != tuple(p.shape):
                raise AssertionError(f"shard of {key}: {tuple(t.shape)} read, the rank's model holds {tuple(p.shape)}")
            keep = cfg.family.keeps_float32(name) and dtype.itemsize < 4
            state[name] = t.to(device=device, dtype=torch.float32 if keep else dtype)
    finally:
        handles.clear()
    model.load_state_dict(state, assign=True, strict=True)
    model.shard_reads = reads
    return model.eval()


def save_model(model: DLLM, path: Union[str, os.PathLike], max_shard_bytes: Optional[int] = None) -> None:
    """Write config.json and safetensors under the real checkpoint names (sharded with an
    index when `max_shard_bytes` is set), so load_model and other tools read it back."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    (root / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    names = checkpoint_names(cfg, [n for n, _ in model.named_parameters()])
    tensors = {names[n]: p.detach().to("cpu").contiguous() for n, p in model.named_parameters()}
    if max_shard_bytes is None:
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
        return
    shards, cur, size = [], {}, 0
    for k, t in tensors.items():
        if cur and size + t.numel() * t.element_size() > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = t
        size += t.numel() * t.element_size()
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(root / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


__all__ = ["load_model", "save_model", "read_config", "Attention"]
