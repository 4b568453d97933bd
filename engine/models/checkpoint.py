"""What a checkpoint folder holds, read from the safetensors headers only (no weights):
every tensor's name, dtype and shape, per shard, checked against the tensors the family
says config.json implies. The loader and the job's preflight both call
`check_weights`, so a missing, misshaped, unused or truncated tensor is refused in the
preflight (seconds) rather than by the engine after minutes of loading. Torch-free."""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Dict, Tuple

INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


class CheckpointError(ValueError):
    """The checkpoint's files do not hold what config.json implies."""


class MissingWeight(CheckpointError, KeyError):
    """A tensor config.json implies is absent (a KeyError too, as the loader always raised)."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: str
    shape: Tuple[int, ...]


def read_header(path: str) -> Dict[str, TensorInfo]:
    """{name: TensorInfo} from a .safetensors file's header; CheckpointError when the file is
    not a whole safetensors file (truncated, or not one at all)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is {size} bytes: not a safetensors file (truncated?)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path} is truncated or not a safetensors file: its header says {n} bytes of "
                                  f"metadata, the file has {size} bytes")
        try:
            meta = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"{path}: its safetensors header is not valid JSON ({e}); truncated?") from e
    out, end = {}, 0
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        out[name] = TensorInfo(path, str(info.get("dtype")), tuple(int(s) for s in info.get("shape", ())))
        end = max(end, int(info.get("data_offsets", (0, 0))[1]))
    if 8 + n + end > size:
        raise CheckpointError(f"{path} is truncated: its tensors need {8 + n + end} bytes, the file has {size} "
                              f"(an interrupted download or copy?)")
    return out


def read_tensors(model_dir: str) -> Dict[str, TensorInfo]:
    """Every tensor of the checkpoint, from the shard index (each shard it names, which must
    hold the tensors the index assigns it) or from every *.safetensors file."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        out: Dict[str, TensorInfo] = {}
        for shard in sorted(set(weight_map.values())):
            path = os.path.join(model_dir, shard)
            if not os.path.isfile(path):
                raise CheckpointError(f"{INDEX_FILE} in {model_dir} names shard {shard}, which is missing")
            out.update(read_header(path))
        lost = sorted(k for k, shard in weight_map.items() if k not in out or os.path.basename(out[k].file) != shard)
        if lost:
            raise CheckpointError(f"{INDEX_FILE} in {model_dir} places {lost[0]!r} in {weight_map[lost[0]]}, which "
                                  f"does not hold it ({len(lost)} such tensor(s))")
        return out
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no weights (no *.safetensors files)")
    out = {}
    for name in files:
        out.update(read_header(os.path.join(model_dir, name)))
    return out


def check_weights(model_dir: str, cfg) -> Dict[str, TensorInfo]:
    """The checkpoint's tensors, refused (CheckpointError, MissingWeight) unless they are
    exactly the ones `cfg` (a ModelConfig) implies, with its shapes."""
    family = cfg.family
    have = read_tensors(str(model_dir))
    want = family.checkpoint_shapes(cfg)
    for key, shape in want.items():
        if key not in have:
            raise MissingWeight(f"weight {key!r} missing from checkpoint {model_dir} (config.json implies it)")
        if have[key].shape != shape:
            raise CheckpointError(f"weight {key!r} has shape {have[key].shape}, expected {shape} from config.json "
                                  f"({os.path.basename(have[key].file)})")
    unused = set(have) - set(want)
    if unused:
        raise CheckpointError(family.unused_tensors_message(unused, str(model_dir)))
    return have


__all__ = ["check_weights", "read_tensors", "read_header", "CheckpointError", "MissingWeight", "TensorInfo"]
