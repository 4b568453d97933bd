from .config import ModelConfig
from .transformer import DLLM, KVCache, build_model
from .weights import checkpoint_names

__all__ = ["ModelConfig", "DLLM", "KVCache", "build_model", "checkpoint_names"]
