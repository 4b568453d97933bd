"""DiffusionGemma's denoiser forward on the CPU: transformers' own modules vs the
hand-written forward over the same weights that the canvas engine's decoder steps run
(engine/canvas/denoiser.py), on the same batch the engine builds mid-run
(B rows' canvases over their left-padded K/V caches, self-conditioning logits, per-row
positions), in one run.

    python bench/diffusion_gemma_backbone_bench.py --out bench/results/cpu_diffusion_gemma_backbone.json

For each checkpoint shape: float64 agreement (max |logit difference|, equal argmax) and
the median seconds per forward of each, float32 and float64, at each batch size.
Writes JSON (command, per-case numbers, ratios)."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from engine.canvas.denoiser import Denoiser  # noqa: E402
from engine.canvas import CanvasEngine, CanvasParams, load_diffusion_gemma  # noqa: E402
from tiny.diffusion_gemma import build  # noqa: E402


def engine_batch(model, ckpt, B, steps=3):
    """The decoder inputs of a CanvasEngine step with B rows mid-run (prompts of mixed
    lengths, self-conditioning set on every row): at least `steps` steps, then until no
    row has just started a canvas."""
    eng = CanvasEngine(model, CanvasParams.from_generation_config(ckpt), max_batch_size=B)
    for i in range(B):
        eng.add_request(i, [2] + [5 + (7 * i + j) % 50 for j in range(3 + 5 * i)], 10_000, 100 + i)
    for n in range(100):
        eng.step()
        cache, masks, pos, canvas, sc = eng.decoder_inputs()
        if n + 1 >= steps and sc is not None and eng.has_unfinished() and not eng._fresh:
            return cache, masks, pos, canvas, sc
    raise RuntimeError("no step found where every row has self-conditioning logits")


def transformers_forward(model, cache, masks, pos, canvas, sc):
    return model(decoder_input_ids=canvas, cache=cache, self_conditioning_logits=sc, decoder_attention_mask=masks,
                 decoder_position_ids=pos).logits


def hand_forward(hand, cache, masks, pos, canvas, sc):
    return hand(canvas, [(l.keys, l.values) for l in cache.layers], masks, hand.rope(pos), sc)


def timed(fn, args, reps):
    ts = []
    with torch.no_grad():
        fn(*args)  # warm-up
        for _ in range(reps):
            t = time.perf_counter()
            fn(*args)
            ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/cpu_diffusion_gemma_backbone.json")
    ap.add_argument("--shapes", default="32x3,256x3,512x4", help="hidden x layers of the random checkpoints")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    cases = []
    for shape in a.shapes.split(","):
        hidden, layers = map(int, shape.split("x"))
        ckpt = build(tempfile.mkdtemp(prefix="dgemma_backbone_"), hidden=hidden, layers=layers, scale=1.0)
        for dtype in (torch.float64, torch.float32):
            model = load_diffusion_gemma(ckpt, dtype)
            hand = Denoiser(model)
            for B in map(int, a.batches.split(",")):
                args = engine_batch(model, ckpt, B)
                with torch.no_grad():
                    ref, got = transformers_forward(model, *args), hand_forward(hand, *args)
                case = dict(hidden=hidden, layers=layers, dtype=str(dtype).removeprefix("torch."), batch=B,
                            canvas=int(args[3].shape[1]), cached_columns=int(args[0].layers[-1].keys.shape[-2]),
                            max_abs_logit_diff=float((ref - got).abs().max()),
                            argmax_equal=bool(torch.equal(ref.argmax(-1), got.argmax(-1))),
                            transformers_s=timed(transformers_forward, (model, *args), a.reps),
                            hand_written_s=timed(hand_forward, (hand, *args), a.reps))
                case["transformers_over_hand_written"] = case["transformers_s"] / case["hand_written_s"]
                cases.append(case)
                print(json.dumps(case), flush=True)
    out = dict(command="python " + " ".join(map(shlex.quote, sys.argv)), args=vars(a),
               torch=torch.__version__, cases=cases)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
