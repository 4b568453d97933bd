"""The first GPU run, in one command (issue 51 item 7): `bash bench/gpu/run.sh`.

Each part rewrites $OUT/first_run.json as it ends, so a killed run keeps what it measured:

1. `attention`: for every family (published layout, two layers, random bf16), the backend
   engine.models.attention says its calls get. Beside it, the backend torch's own dispatch
   picks for the engine's real calls (`torch._fused_sdp_choice`), and what would keep the
   memory-efficient kernel off them (expected: nothing).
2. `throughput`: tokens/s of LLaDA-8B-shaped and LLaDA2.0-mini-shaped random bf16 models at
   B = 1, 16 and 64, eager and with `compile_decode`. Each run goes under
   `torch.cuda.set_sync_debug_mode("warn")` with its synchronizing-op warnings counted (one
   per step is the designed read), and counts its CUDA-graph replays (`CUDAGraph.replay`).
   The workload: prompts of 64-512 tokens, 128 new tokens in blocks of 32, 8 steps a block
   (4 tokens a step, fixed), block canvas, dual cache, rows joining at any step. Every run of
   a shape does the same work.

run.sh then runs bench/gpu/diffusion_gemma_gpu.py (the canvas engine against transformers'
DiffusionGemma `generate`).

    python bench/gpu/first_run.py --out out            # on a GPU (~6 minutes)
    python bench/gpu/first_run.py --fake-cuda --out o  # CI: the same path on fake CUDA on a CPU

With `--fake-cuda`, the models are FakeTensors on cuda, two layers deep. Engines run their
device work faked and their host work for real; each step's read returns harness tokens
(bench/gpu/fake_cuda.py). Nothing is timed. The compile_decode runs are listed as skipped,
since inductor needs a GPU to compile for one.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import os
import platform
import random
import sys
import time
import warnings
from collections import Counter
from typing import Any, Dict, Iterator, List, Tuple
from unittest import mock

T0 = time.perf_counter()
if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from bench.engine_bench import git_state  # noqa: E402
from bench.gpu.fake_cuda import SdpaCalls, fake_engines, fake_model, published_layout  # noqa: E402
from bench.gpu.gpu_bench import LLADA2_MINI, LLADA_8B, Report, build_on_device  # noqa: E402
from bench.gpu_shape import FAMILIES  # noqa: E402
from bench.runner import RunSpec, run  # noqa: E402
from bench.workloads import Workload  # noqa: E402
from engine import Engine, EngineConfig, ModelConfig, SamplingParams  # noqa: E402
from engine.models import DLLM, attention  # noqa: E402

SHAPES = {"llada-8b": LLADA_8B, "llada2-mini": LLADA2_MINI}
BATCHES = (16, 64, 1)  # in priority order
FAKE_BATCHES = (4,)  # fake CUDA: the same code path, at a size a CPU steps through in seconds
BLOCK, STEPS, NEW_TOKENS = 32, 8, 128
FAKE_LAYERS = 2


@dataclasses.dataclass
class Target:
    """Where the run goes: a real GPU, or fake CUDA on this CPU (`fake`)."""

    fake: bool

    @contextlib.contextmanager
    def serving(self, cfg: ModelConfig) -> Iterator[DLLM]:
        """Yields `cfg`'s model, random bf16 weights made on the GPU, or fake ones
        `FAKE_LAYERS` deep, with engines running on fake CUDA until the block ends."""
        if not self.fake:
            yield build_on_device(cfg, torch.bfloat16, "cuda")
            return
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        moe = cfg.moe and dataclasses.replace(cfg.moe, dense_layers=cfg.moe.dense_layers[:FAKE_LAYERS])
        model = fake_model(dataclasses.replace(cfg, n_layers=min(cfg.n_layers, FAKE_LAYERS), moe=moe), mode)
        with fake_engines(mode, synchronize=lambda device=None: None):  # a bench may synchronize
            yield model


# --- what a run counts ------------------------------------------------------------------

@contextlib.contextmanager
def sync_warnings() -> Iterator[Dict[str, Any]]:
    """Runs the block under `torch.cuda.set_sync_debug_mode("warn")`; the yielded dict gets
    `count` (the synchronizing operations CUDA warned about) and `where` (the five most
    frequent Python locations) when the block ends."""
    box: Dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield box
        finally:
            torch.cuda.set_sync_debug_mode(before)
    syncs = [w for w in got if "synchroniz" in str(w.message)]
    box["count"] = len(syncs)
    box["where"] = Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in syncs).most_common(5)


@contextlib.contextmanager
def graph_replays() -> Iterator[Dict[str, int]]:
    """Counts `torch.cuda.CUDAGraph.replay` calls inside the block (inductor's CUDA-graph
    trees replay through it), and inductor's cudagraph skips."""
    from torch._dynamo.utils import counters

    box = {"replays": 0, "cudagraph_skips": 0}
    replay = torch.cuda.CUDAGraph.replay
    skips = counters["inductor"]["cudagraph_skips"]

    def counted(self, *args, **kwargs):
        box["replays"] += 1
        return replay(self, *args, **kwargs)

    with mock.patch.object(torch.cuda.CUDAGraph, "replay", counted):
        yield box
    box["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips


# --- the parts ---------------------------------------------------------------------------

def attention_part(target: Target, families: List[str]) -> Dict[str, Any]:
    """Per family: predicted backend, torch's choice (GPU only), refusals, calls."""
    out: Dict[str, Any] = {}
    prompts = [list(range(40, 40 + n)) for n in (9, 14, 20, 2600)]  # two runs of slots; widths not multiples of 8
    for family in families:
        cfg = published_layout(family)
        calls = SdpaCalls()
        with target.serving(cfg) as model:
            e = Engine(model, EngineConfig(block_length=32, steps_per_block=4, canvas="block",
                                                              advance="step", token_budget=16384, max_batch_size=4))
            for p in prompts:
                e.add_request(p, SamplingParams(max_new_tokens=32, policy="fixed", ignore_eos=True))
            with calls:
                while e.has_unfinished():
                    e.step()
        out[family] = {"heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
                       "predicted": attention.backend(cfg.n_heads, cfg.n_kv_heads, "cuda"),
                       "torch_chose": dict(Counter(c.chosen for c in calls.calls if c.chosen)),
                       "refusals": sorted({r for c in calls.calls for r in c.refusals}), "calls": len(calls.calls)}
        print(f"attention {family:13s} {out[family]['predicted']:28s} torch: {out[family]['torch_chose'] or '-'}"
              f"  refusals: {out[family]['refusals'] or 'none'}", flush=True)
    return out


def workload(model: DLLM, name: str, n: int, new_tokens: int = NEW_TOKENS, seed: int = 0) -> Workload:
    """`n` prompts of 64-512 random tokens; each decodes `new_tokens` tokens, 4 per step."""
    rng = random.Random(seed)
    V = model.config.vocab_size
    prompts = [[rng.randrange(10, V - 10) for _ in range(rng.randint(64, 512))] for _ in range(n)]
    params = [SamplingParams(max_new_tokens=new_tokens, policy="fixed", ignore_eos=True)] * n
    return Workload(name, model, prompts, params, BLOCK, STEPS)


def one_run(w: Workload, spec: RunSpec, deadline_s: float, timed: bool = True) -> Dict[str, Any]:
    """One run with its syncs and graph replays counted (`timed`: its times mean something)."""
    with sync_warnings() as sw, graph_replays() as gr:
        res = run(w, spec, deadline_s=deadline_s)
    d = {k: getattr(res, k) for k in ("label", "requests", "tokens", "wall_s", "tokens_per_s", "steps", "forwards",
                                      "syncs_per_step", "host_ms_per_step", "compiled_forwards", "compile_fallbacks",
                                      "max_memory_bytes", "error")}
    d.update(sync_warnings=sw["count"], sync_warnings_per_step=sw["count"] / res.steps if res.steps else None,
             sync_where=sw["where"], graph_replays=gr["replays"], cudagraph_skips=gr["cudagraph_skips"])
    if not timed:
        d.update(wall_s=None, tokens_per_s=None, host_ms_per_step=None)
    return d


def throughput_part(target: Target, shape: str, deadline: float, rep: Report) -> None:
    """The shape's runs at every B, eager then compiled, until `deadline` (perf_counter)."""
    cfg = ModelConfig(**SHAPES[shape])
    runs: List[Dict[str, Any]] = rep.data["throughput"].setdefault(shape, [])
    t = time.perf_counter()
    with target.serving(cfg) as model:
        rep.data.setdefault("build_s", {})[shape] = time.perf_counter() - t
        for B in FAKE_BATCHES if target.fake else BATCHES:
            w = workload(model, f"{shape}@B{B}", B, BLOCK) if target.fake else workload(
                model, f"{shape}@B{B}", max(4, 2 * B))
            budget = B * (512 + NEW_TOKENS + BLOCK)
            for compiled in (False, True):
                label = f"{shape}@B{B}" + ("+compile" if compiled else "")
                left = deadline - time.perf_counter()
                if compiled and target.fake:
                    rep.data["skipped"].append({"label": label, "why": "fake CUDA: inductor compiles for a real GPU"})
                    continue
                if left < 15:
                    rep.data["skipped"].append({"label": label, "why": f"only {left:.0f} s left"})
                    continue
                spec = RunSpec(label, "blockserve", budget, max_batch_size=B, cache="dual", advance="step",
                               canvas="block", compile_decode=compiled, profile=False)
                if compiled and not any(r["label"].endswith("+compile") for r in runs):  # compile outside the timing
                    run(w.subset(min(4, len(w.prompts))), dataclasses.replace(spec, label="compile-warmup"),
                        deadline_s=min(left / 2, 120))
                    left = deadline - time.perf_counter()
                d = one_run(w, spec, deadline_s=max(10.0, min(60.0, 0.4 * left)), timed=not target.fake)
                runs.append(d)
                rep.save()
                rate = "  (untimed)" if d["tokens_per_s"] is None else f"{d['tokens_per_s']:9.1f} tok/s"
                print(f"{label:26s} {rate}  steps {d['steps']:4d}  "
                      f"sync warnings/step {d['sync_warnings_per_step'] or 0:.2f}  syncs/step {d['syncs_per_step']}  "
                      f"graph replays {d['graph_replays']}  compiled fwd {d['compiled_forwards']}"
                      + (f"  [{d['error']}]" if d["error"] else ""), flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="./out")
    ap.add_argument("--fake-cuda", "--smoke", dest="fake_cuda", action="store_true",
                    help="the whole path on fake CUDA on a CPU (CI)")
    ap.add_argument("--deadline-s", type=float, default=None, help="default 360 on a GPU, 120 on fake CUDA")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--families", default=",".join(sorted(FAMILIES)), help="the attention part's (comma list)")
    return ap.parse_known_args(argv)[0]  # run.sh passes its own arguments to every script


def main(argv=None) -> Dict[str, Any]:
    global T0
    T0 = time.perf_counter()
    a = parse_args(argv)
    target = Target(fake=a.fake_cuda)
    if not target.fake and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --fake-cuda for the CPU check")
    deadline = T0 + (a.deadline_s if a.deadline_s is not None else (120.0 if target.fake else 360.0))
    os.makedirs(a.out, exist_ok=True)
    rep = Report(os.path.join(a.out, "first_run.json"), {
        "command": "bash bench/gpu/run.sh" if os.environ.get("BLOCKRAY_RUN_SH") else
        "python bench/gpu/first_run.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "git": git_state(),
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "gpu": "fake cuda" if target.fake else torch.cuda.get_device_name(0),
                    "cudnn": None if target.fake else torch.backends.cudnn.version()},
        "fake_cuda": target.fake, "throughput": {}, "skipped": [],
        "workload": {"prompt_tokens": [64, 512], "new_tokens": NEW_TOKENS, "block_length": BLOCK,
                     "steps_per_block": STEPS, "cache": "dual", "canvas": "block", "advance": "step"}})
    failed: List[Tuple[str, str]] = []
    families = a.families.split(",")
    parts = [("attention", lambda: rep.data.__setitem__("attention", attention_part(target, families)))]
    parts += [(f"throughput {s}", lambda s=s: throughput_part(target, s, deadline, rep)) for s in a.shapes.split(",")]
    for part, fn in parts:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a part that fails is reported; the others still run
            import traceback

            traceback.print_exc()
            failed.append((part, f"{type(e).__name__}: {e}"[:500]))
            rep.data["failed"] = [{"part": p, "error": m} for p, m in failed]
        rep.save()
    rep.data["done"] = True
    rep.save()
    print(f"wrote {rep.path} in {time.perf_counter() - T0:.0f} s")
    if failed:
        raise SystemExit(f"{len(failed)} part(s) failed: {failed}")
    return rep.data


if __name__ == "__main__":
    main()
