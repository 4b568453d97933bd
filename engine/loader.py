"""Load and save models in the Hugging Face directory layout (config.json +
*.safetensors, optionally sharded with an index, + tokenizer files), from local disk
only: nothing is fetched from a hub."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .models import DLLM, ModelConfig, checkpoint_names

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _weight_files(root: Path) -> Dict[str, Path]:
    """{checkpoint key: file} from the shard index, or from every *.safetensors file."""
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: root / f for k, f in weight_map.items()}
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model directory {root}")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            out.update({k: f for k in fh.keys()})
    return out


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, device="cpu",
               tokenizer: bool = True) -> Tuple[DLLM, Optional[object]]:
    """(model, tokenizer) from a local HF-style directory; tokenizer is None when the
    directory has no tokenizer files. A missing or misshaped weight names its key."""
    root = Path(path)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"model directory {root} has no config.json")
    cfg = ModelConfig.from_hf(json.loads((root / "config.json").read_text()))
    with torch.device("meta"):
        model = DLLM(cfg)
    files = _weight_files(root)
    state = {}
    handles: Dict[Path, object] = {}
    try:
        for name, key in checkpoint_names(cfg, [n for n, _ in model.named_parameters()]).items():
            if key not in files:
                raise KeyError(f"weight {key!r} missing from checkpoint {root}")
            fh = handles.get(files[key]) or handles.setdefault(
                files[key], safe_open(str(files[key]), framework="pt", device="cpu"))
            t = fh.get_tensor(key)
            want = tuple(model.get_parameter(name).shape)
            if tuple(t.shape) != want:
                raise ValueError(f"weight {key!r} has shape {tuple(t.shape)}, expected {want} from config.json")
            state[name] = t.to(device=device, dtype=dtype)
    finally:
        handles.clear()
    model.load_state_dict(state, assign=True, strict=True)
    model.eval()
    tok = None
    if tokenizer and any((root / f).exists() for f in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(root), local_files_only=True, trust_remote_code=False)
    return model, tok


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
