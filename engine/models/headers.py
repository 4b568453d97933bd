"""What a checkpoint's shards hold, read from their safetensors headers only (no weights):
every tensor's name, dtype and shape, per shard, checked against the tensors the family
says config.json implies. engine.checkpoint calls `check_weights` once, when the job's
preflight opens the checkpoint, so a missing, misshaped, unused or truncated tensor is
refused in seconds rather than by the engine after minutes of loading. The file
operations (`files`: read a byte range, size, isfile, names) are those of
common.model_source.SourceFiles, for a local folder and object storage alike. Torch-free."""
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
    file: str  # the shard's path (engine.checkpoint keeps its name relative to the model folder)
    dtype: str
    shape: Tuple[int, ...]


def read_header(path: str, files) -> Dict[str, TensorInfo]:
    """{name: TensorInfo} from a .safetensors file's header; CheckpointError when the file is
    not a whole safetensors file (truncated, or not one at all)."""
    size = files.size(path)
    head = files.read(path, 0, 8) if size >= 8 else b""
    if len(head) < 8:
        raise CheckpointError(f"{path} is {size} bytes: not a safetensors file (truncated?)")
    (n,) = struct.unpack("<Q", head)
    if n > _MAX_HEADER or 8 + n > size:
        raise CheckpointError(f"{path} is truncated or not a safetensors file: its header says {n} bytes of "
                              f"metadata, the file has {size} bytes")
    try:
        meta = json.loads(files.read(path, 8, 8 + n))
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


def read_tensors(model_dir: str, files) -> Dict[str, TensorInfo]:
    """Every tensor of the checkpoint, from the shard index (each shard it names, which must
    hold the tensors the index assigns it) or from every *.safetensors file."""
    index = f"{model_dir.rstrip('/')}/{INDEX_FILE}"
    if files.isfile(index):
        weight_map = json.loads(files.read(index, 0, files.size(index)))["weight_map"]
        out: Dict[str, TensorInfo] = {}
        for shard in sorted(set(weight_map.values())):
            path = f"{model_dir.rstrip('/')}/{shard}"
            if not files.isfile(path):
                raise CheckpointError(f"{INDEX_FILE} in {model_dir} names shard {shard}, which is missing")
            out.update(read_header(path, files))
        lost = sorted(k for k, shard in weight_map.items() if k not in out or os.path.basename(out[k].file) != shard)
        if lost:
            raise CheckpointError(f"{INDEX_FILE} in {model_dir} places {lost[0]!r} in {weight_map[lost[0]]}, which "
                                  f"does not hold it ({len(lost)} such tensor(s))")
        return out
    shards = sorted(f for f in files.names(model_dir) if f.endswith(".safetensors"))
    if not shards:
        raise FileNotFoundError(f"{model_dir} holds no weights (no *.safetensors files)")
    out = {}
    for name in shards:
        out.update(read_header(f"{model_dir.rstrip('/')}/{name}", files))
    return out


def check_weights(model_dir: str, cfg, files) -> Dict[str, TensorInfo]:
    """The checkpoint's tensors, refused (CheckpointError, MissingWeight) unless they are
    exactly the ones `cfg` (a ModelConfig) implies, with its shapes. `files`: where they
    are read (common.model_source.SourceFiles)."""
    family = cfg.family
    have = read_tensors(str(model_dir), files)
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
