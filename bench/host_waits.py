"""Host waits per engine step on the stand-in CUDA device (bench.counting.StandInCuda,
issue 51), per case: eight rows of published layouts shrunk (tests/published.py), and
DiffusionGemma's canvas engine on tiny's checkpoint. Prints, per step(), the waits and
EngineStats.syncs, and where the waits were made.

    python bench/host_waits.py [--steps 10] [--where]"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile

import torch

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")]

from bench.counting import StandInCuda  # noqa: E402
from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model  # noqa: E402

GREEDY = SamplingParams(max_new_tokens=32, policy="fixed", ignore_eos=True)
CASES = [  # name, published folder, sampling, engine config, prompt lengths (None: 40 each)
    ("llada step", "GSAI-ML__LLaDA-8B-Instruct", GREEDY, {}, None),
    ("llada block", "GSAI-ML__LLaDA-8B-Instruct", GREEDY, dict(advance="block"), None),
    ("llada mixed prompts", "GSAI-ML__LLaDA-8B-Instruct", GREEDY, {}, (8, 60)),
    ("dream top_p/top_k", "Dream-org__Dream-v0-Instruct-7B",
     SamplingParams(max_new_tokens=32, top_p=0.9, top_k=20, ignore_eos=True), {}, None),
    ("llada2", "inclusionAI__LLaDA2.0-mini", SamplingParams(max_new_tokens=32, ignore_eos=True), {}, None),
]


def _steps(step, s: StandInCuda, syncs, n: int):
    out = []
    for _ in range(n):
        w0, y0, before = s.waits, syncs(), s.where.copy()
        step()
        out.append((s.waits - w0, syncs() - y0, dict(s.where - before)))
    return out


def engine_case(folder, params, kw, lens, steps: int):
    import published
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_hf(published.shrink(published.config(folder))), dtype=torch.float32)
    with StandInCuda() as s:
        s.move(model)
        cfg = dict(block_length=8, steps_per_block=4, cache="refresh", canvas="block", advance="step",
                   token_budget=100000, max_batch_size=8)
        e = Engine(model, EngineConfig(**{**cfg, **kw}))
        rng = random.Random(0)
        for _ in range(8):
            n = 40 if lens is None else rng.randint(*lens)
            e.add_request([rng.randrange(10, model.config.vocab_size - 10) for _ in range(n)], params)
        return _steps(e.step, s, lambda: e.stats.syncs, steps)


def canvas_case(steps: int, same: bool):
    from engine.canvas import CanvasEngine, CanvasParams, load_diffusion_gemma
    from tiny.diffusion_gemma import build
    ckpt = build(tempfile.mkdtemp(prefix="dgemma"), layers=2)
    model = load_diffusion_gemma(ckpt, torch.float32)
    with StandInCuda() as s:
        s.move(model)
        eng = CanvasEngine(model, CanvasParams.from_generation_config(ckpt), max_batch_size=8)
        rng = random.Random(0)
        for i in range(8):
            eng.add_request(i, [2] + [rng.randrange(5, 59) for _ in range(10 if same else rng.randrange(1, 20))],
                            64, 1000 + i)
        return _steps(eng.step, s, lambda: eng.syncs, steps)


def measure(steps: int = 10):
    """{case: [(waits, syncs, where) per step()]} for every case."""
    runs = [(name, lambda f=f, p=p, kw=kw, lens=lens: engine_case(f, p, kw, lens, steps))
            for name, f, p, kw, lens in CASES]
    runs += [("canvas same prompts", lambda: canvas_case(steps, True)),
             ("canvas mixed prompts", lambda: canvas_case(steps, False))]
    return {name: run() for name, run in runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--where", action="store_true", help="where each step's waits were made")
    a = ap.parse_args()
    torch.set_num_threads(1)
    for name, per in measure(a.steps).items():
        print(f"{name}: waits per step() {[w for w, _, _ in per]}, syncs {[y for _, y, _ in per]}")
        if a.where:
            for i, (_, _, where) in enumerate(per):
                print(f"  step {i}: {where}")


if __name__ == "__main__":
    main()
