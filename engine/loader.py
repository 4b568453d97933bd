"""Load and save models in the Hugging Face directory layout (config.json +
*.safetensors, optionally sharded with an index, + tokenizer files), from local disk
only: nothing is fetched from a hub. Parsing, weight names and shapes come from the
model's family (engine.models.families); a PEFT LoRA adapter is merged at load time
(engine.models.lora)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .models import DLLM, ModelConfig, checkpoint_names
from .models.checkpoint import check_weights
from .models.lora import read_adapter
from .models.stops import checkpoint_stop_ids
from common.tokenizer import load_tokenizer

ATTENTIONS = ("auto", "bidirectional", "block_causal")


def with_attention(cfg: ModelConfig, attention: str = "auto") -> ModelConfig:
    """`cfg` with its attention overridden: "auto" keeps what the checkpoint declares
    (bidirectional when it declares nothing); D2F adapters run "block_causal" on an
    unchanged LLaDA or Dream folder."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    if attention != "auto":
        cfg.dllm_attention = attention
    return cfg


def read_config(path: str | os.PathLike, attention: str = "auto") -> ModelConfig:
    """The ModelConfig of a model folder (parsed through its family), with its stop ids
    read from the checkpoint and `attention` applied. ValueError names any config.json key
    the engine would not honour."""
    root = Path(path)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"model directory {root} has no config.json")
    hf = json.loads((root / "config.json").read_text())
    cfg = with_attention(ModelConfig.from_hf(hf), attention)
    from .models.stops import defined_tokens, tokenizer_eos
    tokens = defined_tokens(str(root))
    for key, value in cfg.family.tokenizer_ids(hf, tokens, tokenizer_eos(str(root), tokens)).items():
        setattr(cfg, key, value)
    # none found (LLaDA2's config.json has no eos_token_id): config.json's, or the family's default
    cfg.stop_ids = list(checkpoint_stop_ids(str(root), hf)) or None
    return cfg


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, device="cpu",
               tokenizer: bool = True, adapter: Optional[str | os.PathLike] = None,
               attention: str = "auto") -> Tuple[DLLM, Optional[object]]:
    """(model, tokenizer) from a local HF-style directory; tokenizer is None when the
    directory has no tokenizer files. `adapter`: a local PEFT LoRA folder merged into the
    weights here; `attention`: "auto" | "bidirectional" | "block_causal". A config key or
    tensor the engine would not honour, a missing or misshaped weight, or an adapter that
    does not fit is refused (ValueError; KeyError for a missing weight) naming it."""
    root = Path(path)
    cfg = read_config(root, attention)
    infos = check_weights(str(root), cfg)
    with torch.device("meta"):
        model = DLLM(cfg)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes == cfg.family.param_shapes(cfg), "the family's param_shapes disagree with DLLM"
    lora = read_adapter(str(adapter), cfg, shapes) if adapter is not None else None
    state = {}
    handles: Dict[str, object] = {}
    try:
        for name, key in checkpoint_names(cfg, shapes).items():
            file = infos[key].file
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
    return model, (load_tokenizer(str(root)) if tokenizer else None)


def save_model(model: DLLM, path: str | os.PathLike, max_shard_bytes: Optional[int] = None) -> None:
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
