"""blockray's engine: pure torch, no Ray. Models (LLaDA, Dream), decoding policies and
the BlockServe block-grained continuous-batching loop."""
from .config import EngineConfig, SamplingParams
from .engine import BatchRecord, Engine, EngineStats
from .loader import load_model, save_model
from .models import ModelConfig, build_model
from .sequence import RequestOutput

__all__ = ["Engine", "EngineConfig", "EngineStats", "BatchRecord", "SamplingParams", "RequestOutput",
           "ModelConfig", "build_model", "load_model", "save_model"]
