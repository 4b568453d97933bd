"""What the sorter knows about the model and the device: the engine's own `ModelConfig`
(one model description, one K/V-size formula: the run's Checkpoint's) and the dtype the
engine will load, read without importing torch, since the ordering runs in data-side
workers (a ModelConfig unpickles there without torch: engine.models exports lazily)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Union

# Bytes per element of the dtypes an engine may load (actors.engine_build.resolve_dtype
# resolves the config's name to a torch dtype: these are their itemsizes).
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8, "double": 8}


def model_config_class() -> type:
    """`engine.models.config.ModelConfig`, imported lazily (no torch: `engine` and
    `engine.models` import their torch modules only on first use)."""
    from engine.models.config import ModelConfig

    return ModelConfig


def read_model_config(model: Union[str, Mapping[str, Any], Any]) -> Any:
    """A ModelConfig from a model directory (its Checkpoint's, engine.checkpoint), a
    config.json dict, or a ModelConfig (returned as it is)."""
    cls = model_config_class()
    if isinstance(model, cls):
        return model
    if isinstance(model, Mapping):
        return cls.from_hf(dict(model))
    from engine.checkpoint import Checkpoint

    return Checkpoint.open(str(model), weights=False).config


def dtype_bytes(dtype: str = "auto", device: str = "cpu") -> int:
    """Bytes per weight and K/V element as the engine actor loads them: "auto" is
    bfloat16 on a GPU and float32 on the CPU (actors.engine_build.resolve_dtype)."""
    name = str(dtype).removeprefix("torch.")
    if name == "auto":
        return 2 if str(device).startswith("cuda") else 4
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r} (expected auto or one of {sorted(DTYPE_BYTES)})")
    return DTYPE_BYTES[name]


@dataclass(frozen=True)
class ModelProfile:
    """The engine's ModelConfig plus its element size: the FLOPs and K/V bytes that
    tell requests apart on the roofline."""

    config: Any  # engine.models.config.ModelConfig
    bytes_per_element: int = 2

    @classmethod
    def from_config(cls, model: Union[str, Mapping[str, Any], Any], dtype: str = "auto",
                    device: str = "cpu") -> "ModelProfile":
        """From a model directory, a config.json dict or a ModelConfig, with the element
        size of the dtype the engine will load on `device`."""
        return cls(read_model_config(model), dtype_bytes(dtype, device))

    def linear_flops_per_token(self) -> float:
        """Dense matmul FLOPs of one token through all layers (QKV, O, gated MLP; a MoE
        model's active experts and its router: the active parameters per token)."""
        c = self.config
        d, hd = c.hidden_size, c.head_dim
        per_layer = 2.0 * (d * c.n_heads * hd + 2 * d * c.n_kv_heads * hd + c.n_heads * hd * d
                           + 3 * d * c.active_intermediate_size)
        router = 0.0 if c.moe is None else 2.0 * d * c.moe.num_experts * sum(not x for x in c.moe.dense_layers)
        return per_layer * c.n_layers + router

    def attention_flops_per_pair(self) -> float:
        """FLOPs of one (query, key) pair over all layers: QK^T and AV, 2 per MAC."""
        return 4.0 * self.config.n_heads * self.config.head_dim * self.config.n_layers

    def head_flops_per_token(self) -> float:
        """LM-head FLOPs for one position (only block positions need logits)."""
        return 2.0 * self.config.hidden_size * self.config.vocab_size

    def kv_bytes_per_token(self) -> int:
        """K and V of one column over all layers: the engine's formula."""
        return self.config.kv_bytes_per_token(self.bytes_per_element)


@dataclass(frozen=True)
class DeviceProfile:
    """Roofline numbers of one accelerator: peak dense FLOP/s and memory bytes/s."""

    name: str
    peak_flops: float
    mem_bandwidth: float


#: NVIDIA H200 SXM: ~989 TFLOP/s dense bf16, 4.8 TB/s HBM3e.
H200 = DeviceProfile("H200", peak_flops=989e12, mem_bandwidth=4.8e12)
#: A generic multi-core server CPU (order of magnitude only: ~1 TFLOP/s, ~100 GB/s).
CPU = DeviceProfile("cpu", peak_flops=1.0e12, mem_bandwidth=1.0e11)


def device_profile(device: str) -> DeviceProfile:
    """The roofline of the engines' device ("cuda…" or "cpu")."""
    return H200 if str(device).startswith("cuda") else CPU
