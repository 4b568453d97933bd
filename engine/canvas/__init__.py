"""DiffusionGemma's canvas decoding (block diffusion with an encoder K/V cache and a
bidirectional denoiser over a random canvas), served with canvas-grained continuous
batching. The network is transformers' own DiffusionGemmaForBlockDiffusion (native in
transformers, no remote code); this package owns the per-request state, the random
draws and the scheduling that transformers' lock-step `generate` does not have."""
from .engine import CanvasEngine, CanvasOutput
from .params import CanvasParams, load_diffusion_gemma
from .serve import CanvasServe

__all__ = ["CanvasEngine", "CanvasOutput", "CanvasServe", "CanvasParams", "load_diffusion_gemma"]
