"""DiffusionGemma-26B-A4B-shaped (random weights, bf16) on one GPU: the canvas engine
(blockserve) vs transformers' batched generate, same prompts and seeds.

    bash bench/gpu/run.sh                                       # runs it after the LLaDA bench
    python bench/gpu/diffusion_gemma_gpu.py --smoke --out /tmp/o  # CPU, tiny shape (checks it runs)

The shape is google/diffusiongemma-26B-A4B-it's (30 layers, hidden 2816, 16 heads / 8 KV
heads, head_dim 256, global head_dim 512 with 2 KV heads, sliding window 1024, 128 experts
top-8 of 704 plus a shared MLP of 2112, vocab 262144, canvas 256): ~52 GB in bf16, fits an
H200. Experts run through transformers' grouped_mm. The embeddings are sharpened like the
tiny CPU checkpoint's so canvases converge at different steps. Writes
$OUT/diffusion_gemma_gpu.json after every run (a killed job still leaves results)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

T0 = time.perf_counter()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench.diffusion_gemma_bench import run_engine, run_transformers, workload  # noqa: E402
from engine.canvas import CanvasParams  # noqa: E402

SHAPE_26B = dict(vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
                 num_global_key_value_heads=2, sliding_window=1024, enable_moe_block=True, num_experts=128,
                 top_k_experts=8, moe_intermediate_size=704, final_logit_softcapping=30.0)
SHAPE_SMOKE = dict(SHAPE_26B, vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                   num_global_key_value_heads=1, sliding_window=32, num_experts=8, top_k_experts=2,
                   moe_intermediate_size=32)


def build(shape, canvas, device, dtype):
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from tiny.diffusion_gemma import VISION  # a one-layer vision tower (None builds the 16-layer default)

    n = shape["num_hidden_layers"]
    types = ["full_attention" if (i + 1) % 6 == 0 or i == n - 1 else "sliding_attention" for i in range(n)]
    cfg = DiffusionGemmaConfig(text_config=dict(shape, layer_types=types, eos_token_id=1, pad_token_id=0,
                                                bos_token_id=2), canvas_length=canvas, vision_config=VISION)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    torch.set_default_dtype(old)
    with torch.no_grad():
        model.model.decoder.embed_tokens.weight.mul_(20.0)
    return model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="./out")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--deadline-s", type=float, default=280.0)
    a, _ = ap.parse_known_args(argv)
    dev = "cpu" if a.smoke or not torch.cuda.is_available() else "cuda"
    shape, canvas = (SHAPE_SMOKE, 16) if a.smoke else (SHAPE_26B, 256)
    model = build(shape, canvas, dev, torch.float32 if dev == "cpu" else torch.bfloat16)
    model.generation_config.eos_token_id = [1]
    model.generation_config.pad_token_id = 0
    steps = 8 if a.smoke else 48
    defaults = CanvasParams(max_denoising_steps=steps, entropy_bound=0.1, t_min=0.4, t_max=0.8,
                            stability_threshold=1, confidence_threshold=0.5)
    model.generation_config.max_denoising_steps = steps
    for k in ("t_min", "t_max", "stability_threshold", "confidence_threshold"):
        setattr(model.generation_config, k, getattr(defaults, k))
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig
    model.generation_config.sampler_config = EntropyBoundSamplerConfig(entropy_bound=defaults.entropy_bound)
    prompts, max_tokens, seeds = workload(a.requests if not a.smoke else 6)
    max_tokens = [n * canvas // 8 for n in max_tokens]  # 1-5 canvases
    out = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", shape=shape, canvas_length=canvas,
               defaults=vars(defaults), runs=[], skipped=[])
    path = os.path.join(a.out, "diffusion_gemma_gpu.json")
    os.makedirs(a.out, exist_ok=True)
    for name in ("blockserve", "transformers_generate"):
        if time.perf_counter() - T0 > a.deadline_s * 0.5 and out["runs"]:
            out["skipped"].append(name)
            continue
        if dev == "cuda":
            torch.cuda.synchronize()
        res = (run_transformers(model, prompts, max_tokens, seeds, a.batch) if name == "transformers_generate"
               else run_engine(model, defaults, prompts, max_tokens, seeds, name, a.batch))
        if dev == "cuda":
            res["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["runs"].append(res)
        print(json.dumps(res), flush=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    by = {r["scheduler"]: r for r in out["runs"]}
    if len(by) == 2:
        out["blockserve_vs_transformers_generate"] = by["blockserve"]["tokens_per_s"] / by["transformers_generate"][
            "tokens_per_s"]
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
