"""PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors), merged into the
base weights once at load time: W += scale * B A, computed in float32 (float64 for a
float64 model) and cast to the model's dtype, so serving costs nothing extra and needs no
peft at run time. PEFT module names are the base checkpoint's own weight names (the
family's), so one mapping serves every family. Options that would change the result
and are not implemented (DoRA, modules_to_save, bias training, rank/alpha patterns, ...)
are refused, never ignored."""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Tuple, Union

if TYPE_CHECKING:
    import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# adapter_config.json keys that cannot change the merged weights (training, init, hub
# bookkeeping) or that PEFT itself ignores for nn.Linear layers
_IGNORED = {"peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode", "lora_dropout",
            "init_lora_weights", "loftq_config", "eva_config", "corda_config", "auto_mapping", "megatron_core",
            "megatron_config", "exclude_modules", "peft_version", "fan_in_fan_out"}
_HONOURED = {"r", "lora_alpha", "use_rslora", "target_modules"}
# options implemented only at their "off" value: key -> (accepted values, what it would need)
_OFF_ONLY = {
    "use_dora": ((False, None), "DoRA (weight-decomposed LoRA) is not implemented"),
    "modules_to_save": ((None, []), "modules_to_save (full copies of trained modules) is not implemented"),
    "bias": (("none",), "trained biases (bias != 'none') are not implemented"),
    "lora_bias": ((False, None), "trained LoRA biases are not implemented"),
    "rank_pattern": (({}, None), "per-module ranks (rank_pattern) are not implemented"),
    "alpha_pattern": (({}, None), "per-module alphas (alpha_pattern) are not implemented"),
    "layers_to_transform": ((None, []), "layers_to_transform is not implemented"),
    "layers_pattern": ((None, [], ""), "layers_pattern is not implemented"),
    "layer_replication": ((None, []), "layer_replication is not implemented"),
    "trainable_token_indices": ((None, {}, []), "trainable_token_indices is not implemented"),
    "target_parameters": ((None, []), "target_parameters (LoRA on parameters) is not implemented"),
    "use_qalora": ((False, None), "QALoRA is not implemented"),
}


class AdapterError(ValueError):
    """The adapter cannot be applied as it is; the message says why."""


@dataclass(frozen=True)
class LoraConfig:
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: Union[str, List[str]]

    @property
    def scale(self) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = ADAPTER_CONFIG) -> "LoraConfig":
        kind = d.get("peft_type", "LORA")
        if str(kind).upper() != "LORA":
            raise AdapterError(f"{where}: peft_type {kind!r} is not supported (blockray merges LoRA adapters only)")
        for key, value in d.items():
            if key in _HONOURED or key in _IGNORED:
                continue
            if key in _OFF_ONLY:
                ok, why = _OFF_ONLY[key]
                if value not in ok:
                    raise AdapterError(f"{where}: {key}={value!r}: {why} by blockray; refusing rather than serving a "
                                       "different model")
            elif value not in (None, False, {}, [], ""):
                raise AdapterError(f"{where}: option {key}={str(value)[:80]!r} is not one blockray knows; refusing "
                                   "rather than ignoring it")
        if "r" not in d or "target_modules" not in d:
            raise AdapterError(f"{where}: needs r and target_modules")
        targets = d["target_modules"]
        return cls(r=int(d["r"]), lora_alpha=float(d.get("lora_alpha", 8)), use_rslora=bool(d.get("use_rslora")),
                   target_modules=targets if isinstance(targets, str) else list(targets))

    def targets(self, module: str) -> bool:
        """PEFT's rule: a regex string must match the whole module name; a list names
        module-name suffixes ('all-linear': every linear layer but the output head)."""
        t = self.target_modules
        if t == "all-linear":
            return True
        if isinstance(t, str):
            return re.fullmatch(t, module) is not None
        return any(module == x or module.endswith("." + x) for x in t)


@dataclass
class Adapter:
    """{internal parameter name: (A [r, in], B [out, r])} and the scale."""

    config: LoraConfig
    pairs: Dict[str, Tuple[torch.Tensor, torch.Tensor]]
    path: str

    def delta(self, name: str, dtype: "torch.dtype") -> "torch.Tensor":
        a, b = self.pairs[name]
        return self.config.scale * (b.to(dtype) @ a.to(dtype))

    def merge(self, name: str, weight: "torch.Tensor", dtype: "torch.dtype") -> "torch.Tensor":
        """`weight` + scale * B A in float32 (float64 when `dtype` is), for the caller to cast."""
        import torch

        if name not in self.pairs:
            return weight
        cd = torch.float64 if dtype == torch.float64 else torch.float32
        return weight.to(cd) + self.delta(name, cd)

    def merge_shard(self, name: str, weight: "torch.Tensor", dtype: "torch.dtype", piece: Any) -> "torch.Tensor":
        """`merge` for a tensor-parallel rank's shard `weight` (engine.models.sharding.Piece:
        the rows or columns it holds): the rows of B (a split output) or the columns of A
        (a split input) of the shard only, never the whole delta."""
        import torch

        if name not in self.pairs:
            return weight
        cd = torch.float64 if dtype == torch.float64 else torch.float32
        a, b = (t.to(cd) for t in self.pairs[name])
        if piece.dim == 0:
            b = torch.cat([b[lo:hi] for lo, hi in piece.ranges] + [b.new_zeros(piece.pad, b.shape[1])])
        else:
            a = torch.cat([a[:, lo:hi] for lo, hi in piece.ranges], 1)
        return weight.to(cd) + self.config.scale * (b @ a)


@dataclass(frozen=True)
class AdapterPlan:
    """An adapter checked against its base model, from its config and tensor headers only
    (torch-free: the preflight makes it, the engine loads by it): where it comes from,
    a fingerprint of its files (common.model_source), its LoraConfig and, per internal
    parameter name, the keys of its lora_A and lora_B."""

    source: str  # a local folder (absolute: workers' working directories differ), an fsspec URL or a hub id
    fingerprint: str
    config: LoraConfig
    pairs: Dict[str, Dict[str, str]]


def plan_adapter(files, cfg, shapes: Mapping[str, Tuple[int, ...]]) -> AdapterPlan:
    """The plan of the LoRA adapter whose files are `files` (common.model_source.SourceFiles)
    on a model `cfg` (a ModelConfig) whose parameters have `shapes`. Every tensor must be a
    lora_A / lora_B of one targeted linear weight of the base model, with the adapter's
    rank and the base's shapes."""
    from .headers import read_header

    root = files.model
    if ADAPTER_CONFIG not in files.files:
        raise AdapterError(f"adapter {root} has no {ADAPTER_CONFIG} (a PEFT LoRA adapter folder is expected)")
    if ADAPTER_WEIGHTS not in files.files:
        bins = [f for f in files.files if f.endswith(".bin")]
        raise AdapterError(f"adapter {root} has no {ADAPTER_WEIGHTS}" + (
            f" ({bins[0]} is a pickle, which blockray never loads: convert it to safetensors)" if bins else ""))
    lcfg = LoraConfig.from_dict(files.json(ADAPTER_CONFIG), f"{root}/{ADAPTER_CONFIG}")
    family = cfg.family
    by_key = {family.checkpoint_name(n): n for n in shapes}
    found: Dict[str, Dict[str, str]] = {}
    have = read_header(f"{files.root}/{ADAPTER_WEIGHTS}", files)
    for key in have:
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)(?:\.[\w-]+)?\.weight", key)
        if m is None:
            what = ("a DoRA magnitude (not implemented)" if "lora_magnitude_vector" in key else
                    "LoRA on an embedding (not implemented)" if "lora_embedding" in key else
                    "not a lora_A / lora_B weight (modules_to_save or trained biases are not implemented)")
            raise AdapterError(f"adapter {root}: tensor {key!r} is {what}")
        module, part = m.group(1), m.group(2)
        name = by_key.get(module + ".weight")
        if name is None or len(shapes[name]) != 2 or name.startswith("embed"):
            raise AdapterError(f"adapter {root}: {key!r} targets {module!r}, which is not a linear weight of the "
                               f"{family.name} base model (its weights are named like "
                               f"{family.checkpoint_name('layers.0.o.weight')!r}): a different base model?")
        if not lcfg.targets(module):
            raise AdapterError(f"adapter {root}: {key!r} is for {module!r}, which target_modules "
                               f"{lcfg.target_modules!r} does not name")
        found.setdefault(name, {})[part] = key
    for name, parts in found.items():
        module = family.checkpoint_name(name).removesuffix(".weight")
        if set(parts) != {"lora_A", "lora_B"}:
            raise AdapterError(f"adapter {root}: {module!r} has {sorted(parts)} but not both lora_A and lora_B")
        a, b = have[parts["lora_A"]].shape, have[parts["lora_B"]].shape
        out, inp = shapes[name]
        if a != (lcfg.r, inp) or b != (out, lcfg.r):
            raise AdapterError(f"adapter {root}: {module!r} has lora_A {a} and lora_B {b}, expected "
                               f"({lcfg.r}, {inp}) and ({out}, {lcfg.r}) for r={lcfg.r} and the base weight "
                               f"{(out, inp)}: the adapter was trained for a different base model")
    if not found:
        raise AdapterError(f"adapter {root} holds no LoRA weights")
    return AdapterPlan(files.root if files.source.is_local else root, files.fingerprint(), lcfg, found)


def read_adapter(path: str, plan: AdapterPlan) -> Adapter:
    """The adapter of `plan`, its tensors read from its local folder `path`."""
    from safetensors import safe_open

    with safe_open(os.path.join(str(path), ADAPTER_WEIGHTS), framework="pt") as fh:
        pairs = {name: (fh.get_tensor(p["lora_A"]), fh.get_tensor(p["lora_B"])) for name, p in plan.pairs.items()}
    return Adapter(plan.config, pairs, str(path))


__all__ = ["LoraConfig", "Adapter", "AdapterPlan", "AdapterError", "read_adapter", "plan_adapter", "ADAPTER_CONFIG",
           "ADAPTER_WEIGHTS"]
