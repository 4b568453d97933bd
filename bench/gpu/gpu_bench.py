"""The skewed benchmark on one GPU with a LLaDA-8B-shaped model, in under 8 minutes.

    bash bench/gpu/run.sh                                   # on an H200; JSON under $OUT (default ./out)
    python bench/gpu/gpu_bench.py --smoke --out /tmp/out    # CPU, tiny shape: checks it runs (CI)

Why random weights: the claim is about the serving loop, not the checkpoint; an 8B
model with LLaDA's exact shape (d_model 4096, 32 layers, 32 heads, MLP 12288, vocab
126464) costs what LLaDA-8B costs per forward, and `PlantedStops` gives it a skewed
difficulty mix and realistic tokens per step. Nothing is downloaded; the model is built
on the 'meta' device and materialised on the GPU (seconds, not the minutes of a CPU
init). Needs only torch (no Ray): it imports engine/ and bench/ only.

Measures per run: tokens/s, requests/s, p50/p99 latency, padding, host overhead
(1 - forward time / wall), peak GPU memory, and model FLOP/s as a fraction of the
bf16 matmul peak measured here (a big bf16 matmul timed in this process). Runs go in
priority order under one deadline (default 430 s after start, for an 8-minute slot):
a run that would overrun is cut and marked; runs that cannot start are listed as
skipped. The JSON is rewritten after every run, so a killed job still leaves results.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import platform
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

T_START = time.perf_counter()

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model  # noqa: E402
from engine.budget import plan_token_budget, weight_bytes  # noqa: E402
from engine.models import DLLM  # noqa: E402
from engine.models.families import BlockLayout  # noqa: E402
from engine.models.families.moe import MoESpec  # noqa: E402
from engine.models.transformer import init_weights_  # noqa: E402
from bench.engine_bench import git_state, variant_spec  # noqa: E402
from bench.runner import RunSpec, _sync as sync, _widest, run, warmup  # noqa: E402
from bench.workloads import SMOKE_SKEWED, SkewedSpec, skewed  # noqa: E402

LLADA_8B = dict(model_type="llada", vocab_size=126464, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                intermediate_size=12288, mask_token_id=126336, eos_token_id=126081, eot_token_id=126348,
                rope_theta=500000.0, max_seq_len=4096)
# inclusionAI/LLaDA-MoE-7B-A1B's shape (--shape llada-moe-7b): 16 layers of 64 experts, top-8 of width 1024
LLADA_MOE_7B = dict(model_type="llada_moe", vocab_size=157184, hidden_size=2048, n_layers=16, n_heads=16,
                    n_kv_heads=16, intermediate_size=8192, mask_token_id=156895, eos_token_id=156892,
                    rope_theta=50000.0, max_seq_len=8192, qk_norm=True,
                    moe=MoESpec(num_experts=64, top_k=8, expert_size=1024, dense_size=8192, dense_layers=(False,) * 16))
SMOKE_MOE = dict(model_type="llada_moe", vocab_size=2048, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=4,
                 intermediate_size=192, mask_token_id=2047, eos_token_id=1, max_seq_len=1024, qk_norm=True,
                 moe=MoESpec(num_experts=4, top_k=2, expert_size=32, dense_size=192, dense_layers=(True, False)))
# inclusionAI/LLaDA2.0-mini's shape (--shape llada2-mini; LLaDA2.1-mini's is the same): 20 layers, layer 0
# dense, then 256 sigmoid-routed experts of width 512, top-8 in 8 groups (4 kept), one shared expert
LLADA2_MINI = dict(model_type="llada2_moe", vocab_size=157184, hidden_size=2048, n_layers=20, n_heads=16,
                   n_kv_heads=4, intermediate_size=5120, mask_token_id=156895, eos_token_id=156892,
                   rope_theta=600000.0, rms_norm_eps=1e-6, max_seq_len=32768, qk_norm=True, partial_rotary_factor=0.5,
                   dllm_attention="block_causal",
                   moe=MoESpec(num_experts=256, top_k=8, expert_size=512, dense_size=5120,
                               dense_layers=(True,) + (False,) * 19, shared_size=512, score="sigmoid",
                               expert_bias=True, bias_in_weights=False, renormalize=True, scaling=2.5, n_group=8,
                               topk_group=4))
SMOKE_LLADA2 = dict(model_type="llada2_moe", vocab_size=2048, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                    intermediate_size=192, mask_token_id=2047, eos_token_id=1, max_seq_len=1024, qk_norm=True,
                    partial_rotary_factor=0.5, dllm_attention="block_causal",
                    moe=MoESpec(num_experts=8, top_k=2, expert_size=32, dense_size=192, dense_layers=(True, False),
                                shared_size=32, score="sigmoid", expert_bias=True, bias_in_weights=False,
                                renormalize=True, scaling=2.5, n_group=4, topk_group=2))
SHAPES = ("llada-8b", "llada-moe-7b", "llada2-mini")
# (smoke shape, full shape) per --shape
SHAPE_CONFIGS = {"llada-8b": ("SMOKE_SHAPE", "LLADA_8B"), "llada-moe-7b": ("SMOKE_MOE", "LLADA_MOE_7B"),
                 "llada2-mini": ("SMOKE_LLADA2", "LLADA2_MINI")}
SMOKE_SHAPE = dict(model_type="llada", vocab_size=2048, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=4,
                   intermediate_size=192, mask_token_id=2047, eos_token_id=1, max_seq_len=1024)


def target(smoke: bool) -> Tuple[str, torch.dtype]:
    """(device, dtype) of a run: the CPU in float32 for --smoke, else CUDA in bf16 (exits without one)."""
    if smoke:
        return "cpu", torch.float32
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke for the CPU check")
    return "cuda", torch.bfloat16


def build_on_device(cfg: ModelConfig, dtype: torch.dtype, device: str, seed: int = 0) -> DLLM:
    """Random weights created in place on `device`: construct on 'meta' (no memory),
    `to_empty`, then fill as engine.build_model does, without a CPU copy of 16 GB."""
    with torch.device("meta"):
        model = DLLM(cfg).to(dtype)  # meta tensors: no memory, no init
    model = model.to_empty(device=device)
    return init_weights_(model, torch.Generator(device=device).manual_seed(seed)).eval()


def matmul_peak(device: str, dtype: torch.dtype, n: int, iters: int = 20) -> Dict[str, float]:
    """FLOP/s of an n x n x n matmul in `dtype`: the attainable dense peak of this chip."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    dt = (time.perf_counter() - t) / iters
    return {"n": n, "seconds_per_matmul": dt, "flops_per_s": 2.0 * n ** 3 / dt}


def unsupported_modes(modes: Dict[str, Tuple[str, str]]) -> Dict[str, str]:
    """{name: reason} for the (cache, advance) `modes` this engine does not serve with
    the same tokens as refresh/block on a tiny float64 block-causal model (where the
    persistent cache is exact): an older engine without the mode, or one that gets it
    wrong, is skipped."""
    m = build_model(ModelConfig.tiny("llada", dllm_attention="block_causal"), dtype=torch.float64, seed=0)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13] * 9]
    sp = SamplingParams(max_new_tokens=12, threshold=0.3, stop_token_ids=[12])

    def gen(c, a):
        eng = Engine(m, EngineConfig(block_length=4, steps_per_block=4, cache=c, token_budget=200, advance=a))
        return [(o.token_ids, o.finish_reason, o.error) for o in eng.generate(prompts, sp)]

    want = gen("refresh", "block")
    out: Dict[str, str] = {}
    for name, (cache, advance) in modes.items():
        try:
            if gen(cache, advance) != want:
                out[name] = f"cache={cache} advance={advance} changes the generated tokens"
        except Exception as e:  # noqa: BLE001 - an engine without the mode
            out[name] = f"{type(e).__name__}: {e}"
    return out


class Report:
    """The JSON under $OUT, rewritten after every step so a killed job keeps its results."""

    def __init__(self, path: str, data: Dict[str, Any]):
        self.path, self.data = path, data
        self.data.setdefault("runs", [])
        self.data.setdefault("skipped", [])
        self.save()

    def save(self) -> None:
        self.data["elapsed_s"] = time.perf_counter() - T_START
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=2)
        os.replace(tmp, self.path)


D2F_TAU_ADD = 0.7  # d2f-gsm8k (engine/presets.py)


def d2f_workload(w, tau_add: Optional[float]):
    """`w` on the same weights read as block-causal (the attention mask is the engine's, from
    the config; the weights do not change), decoded by D2F at `tau_add` with D2F-LLaDA's
    other settings, or semi-AR when None."""
    import copy

    from bench.d2f_bench import with_d2f

    inner = copy.copy(w.model.model)  # shares every parameter; only its config differs
    inner.config = dataclasses.replace(inner.config, dllm_attention="block_causal")
    wrapped = copy.copy(w.model)
    wrapped._modules = dict(wrapped._modules)  # its own module table, so the original keeps its model
    wrapped.model, wrapped.config = inner, inner.config
    return with_d2f(dataclasses.replace(w, model=wrapped), tau_add)


def run_one(w, spec: RunSpec, peak: float, deadline: float, rep: Report) -> Optional[Dict[str, Any]]:
    left = deadline - time.perf_counter()
    if left < 15:
        rep.data["skipped"].append({"label": spec.label, "why": f"only {left:.0f} s left before the deadline"})
        rep.save()
        return None
    try:  # no single run may take more than 40% of what is left (static at large B is the slow one)
        res = run(w, spec, deadline_s=min(left, max(45.0, 0.4 * left)))
    except torch.cuda.OutOfMemoryError as e:  # report it, keep going with the other runs
        torch.cuda.empty_cache()
        rep.data["skipped"].append({"label": spec.label, "why": f"out of memory: {e}"[:300]})
        rep.save()
        return None
    d = res.summary()
    d["latencies_s_sorted"] = sorted(res.latencies_s)
    d["mfu_forward"] = res.model_flops / res.forward_s / peak if res.forward_s else None
    d["mfu_wall"] = res.model_flops / res.wall_s / peak
    d["model_flops_per_s"] = res.model_flops / res.wall_s
    d["seconds_per_request"] = res.wall_s / max(1, res.requests)
    rep.data["runs"].append(d)
    rep.save()
    mem = f"{(res.max_memory_bytes or 0) / 2**30:6.1f} GiB" if res.max_memory_bytes else ""
    print(f"{res.label:32s} {res.tokens_per_s:9.1f} tok/s {res.requests_per_s:7.2f} req/s  wall {res.wall_s:6.1f}s  "
          f"MFU {d['mfu_wall']:5.1%}  host {res.host_overhead:5.1%}  pad {res.padding_fraction:5.1%} {mem}"
          f"  host/step {res.host_ms_per_step or 0:.2f} ms (cpu {res.host_cpu_ms_per_step or 0:.2f})"
          f"  device busy {res.device_busy_share or 0:5.1%}"
          + (f"  [{res.error}]" if res.error else ""), flush=True)
    return d


def ratios(runs: List[Dict[str, Any]]) -> Dict[str, float]:
    by = {r["label"]: r for r in runs if r.get("requests")}
    out = {}
    seq = by.get("sequential")
    for label, r in by.items():
        if not label.startswith("blockserve"):
            continue
        if seq:
            out[f"{label}/sequential"] = r["tokens_per_s"] / seq["tokens_per_s"]
        b = label.split("@B")[-1] if "@B" in label else None
        if b and f"static-B{b}" in by:
            out[f"{label}/static-B{b}"] = r["tokens_per_s"] / by[f"static-B{b}"]["tokens_per_s"]
        if b and label.startswith("blockserve+") and "d2f" not in label and "block-causal" not in label \
                and f"blockserve@B{b}" in by:
            out[f"blockserve@B{b}/{label}"] = by[f"blockserve@B{b}"]["tokens_per_s"] / r["tokens_per_s"]
        eager = by.get(label.replace("+compile", ""))
        if "+compile" in label and eager:  # graphed against eager, the same runs otherwise
            out[f"{label}/{eager['label']}"] = r["tokens_per_s"] / eager["tokens_per_s"]
        semi = by.get(f"blockserve+block-causal@B{b}")
        if b and "+d2f-" in label and semi:  # D2F against semi-AR on the same block-causal model
            out[f"{label}/semi-AR"] = r["tokens_per_s"] / semi["tokens_per_s"]
            out[f"{label}/semi-AR tokens per step"] = r["tokens_per_step"] / semi["tokens_per_step"]
            if by.get("d2f-sequential"):
                out[f"{label}/d2f-sequential requests/s"] = (r["requests_per_s"]
                                                             / by["d2f-sequential"]["requests_per_s"])
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "./out"), help="output folder (default $OUT or ./out)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, a few requests: checks the script runs")
    ap.add_argument("--deadline-s", type=float, default=None, help="stop starting runs this long after start")
    ap.add_argument("--n-requests", type=int, default=None)
    ap.add_argument("--sequential-requests", type=int, default=None)
    ap.add_argument("--static-batch-sizes", default=None, help="comma list (default 32,8; smoke 2)")
    ap.add_argument("--max-rows", type=int, default=None, help="blockserve's cap on active rows (logits memory)")
    ap.add_argument("--canvas", default="full", choices=["auto", "block", "full"],
                    help="every run's canvas (default full: what LLaDA's and Fast-dLLM's users decode)")
    ap.add_argument("--cache", default="dual", choices=["none", "refresh", "persistent", "dual"],
                    help="every run's cache (default dual: Fast-dLLM's fastest)")
    ap.add_argument("--shape", default="llada-8b", choices=SHAPES,
                    help="model shape (random weights): LLaDA-8B, LLaDA-MoE-7B-A1B's experts, or LLaDA2.0-mini's "
                         "(block-causal at absolute blocks: run it with --canvas block --cache persistent)")
    return ap.parse_args(argv)


def main(argv=None) -> Dict[str, Any]:
    global T_START
    T_START = time.perf_counter()  # the deadline counts from this call (a test imports the module long before)
    args = parse_args(argv)
    smoke = args.smoke
    device, dtype = target(smoke)
    deadline = T_START + (args.deadline_s if args.deadline_s is not None else (60.0 if smoke else 430.0))
    sizes = [int(x) for x in (args.static_batch_sizes or ("2" if smoke else "32,8")).split(",")]
    n_req = args.n_requests or (8 if smoke else 160)
    n_seq = args.sequential_requests if args.sequential_requests is not None else (2 if smoke else 16)
    max_rows = args.max_rows or (64 if smoke else 128)
    os.makedirs(args.out, exist_ok=True)
    rep = Report(os.path.join(args.out, "gpu_bench.json"), {
        "command": "bash bench/gpu/run.sh" if os.environ.get("BLOCKRAY_RUN_SH") else
        "python bench/gpu/gpu_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git": git_state(),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "cpu_count": os.cpu_count(),
                    "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
                    "gpu_total_bytes": torch.cuda.get_device_properties(0).total_memory if device == "cuda" else None},
        "smoke": smoke})

    t = time.perf_counter()
    peak = matmul_peak(device, dtype, 512 if smoke else 8192)
    rep.data["matmul_peak"] = peak
    cfg = ModelConfig(**globals()[SHAPE_CONFIGS[args.shape][0 if smoke else 1]])
    model = build_on_device(cfg, dtype, device)
    sync(device)
    rep.data["model"] = {"config": cfg.to_hf(), "params": cfg.num_params(), "active_params": cfg.active_params(),
                         "shape": args.shape, "dtype": str(dtype),
                         "build_s": time.perf_counter() - t}
    print(f"peak {peak['flops_per_s'] / 1e12:.1f} TFLOP/s; model {cfg.num_params() / 1e9:.2f}B params built in "
          f"{rep.data['model']['build_s']:.1f}s", flush=True)

    spec = dataclasses.replace(SMOKE_SKEWED if smoke else SkewedSpec(), n_requests=n_req)  # the model: `model`
    w = skewed(spec, model=model)
    rep.data["workload"] = {"name": w.name, "n_requests": len(w.prompts), **w.info}
    rep.data["decoding"] = {"block_length": w.block_length, "steps_per_block": w.steps_per_block,
                            "policy": "threshold", "threshold": spec.threshold,
                            "max_new_tokens": w.params[0].max_new_tokens, "canvas": args.canvas,
                            "cache": args.cache}
    free = torch.cuda.mem_get_info()[0] if device == "cuda" else 64 << 30
    plan = plan_token_budget(free, cfg, dtype, args.cache, w.block_length, weights_loaded=True,
                             min_prompt_len=spec.prompt_min, max_batch_size=max_rows)
    rep.data["auto_budget"] = plan.as_dict()
    rep.data["modes_unsupported"] = unsupported_modes({"persistent": ("persistent", "block"),
                                                       "persistent+step": ("persistent", "step"),
                                                       "step": ("refresh", "step"), "dual": ("dual", "block")})
    warmup(w, n=2)
    rep.save()

    widest = _widest(w)
    pk = peak["flops_per_s"]
    budgets: Dict[int, int] = {}
    main_b = sizes[0]
    same = dict(cache=args.cache, canvas=args.canvas)  # the baselines decode exactly as blockserve does
    # issue 41: blockserve again with the loop running ahead of the device (no synchronizing per forward:
    # the host plans the next forward while the device runs): host ms per step and the device's busy share
    # (not in the CPU smoke run: on a CPU nothing runs ahead of the host)
    queue: List[tuple] = [("static", main_b), ("blockserve", main_b)] + ([] if smoke else [("overlap", main_b)]) + [
        ("sequential", None)]
    # step advance first among the variants: on CPU it is blockserve's best mode at equal decoding;
    # then the cost of the full canvas (the same cache on the block canvas)
    # then eager against graphed: the dual cache's block-only step through torch.compile (reduce-overhead;
    # not in the CPU smoke run, where inductor would compile for minutes: tests/test_compiled_decode.py)
    variants = ["step"] + (["step+compile"] if args.cache == "dual" and not smoke else []) + ["canvas-block"] + (
        ["persistent", "persistent+step"] if args.canvas == "block" else [])
    queue += [("variant", v) for v in variants if v not in rep.data["modes_unsupported"]]
    # D2F (issue 25): the same weights read as block-causal, semi-AR against D2F at the budget of
    # static-B, and D2F one request at a time (the characterisation's batching gain)
    if cfg.family.blocks == BlockLayout.AFTER_PROMPT:  # D2F is not implemented on LLaDA2's absolute blocks
        queue += [("d2f", None), ("d2f", D2F_TAU_ADD), ("d2f-sequential", D2F_TAU_ADD)]
    for b in sizes[1:]:
        queue += [("static", b), ("blockserve", b)]
    queue.append(("auto", None))
    for kind, arg in queue:
        if kind == "static":
            spec_r = RunSpec(f"static-B{arg}", "static", widest, max_batch_size=arg, **same)
        elif kind == "blockserve":
            if arg not in budgets:
                rep.data["skipped"].append({"label": f"blockserve@B{arg}", "why": "static run did not finish"})
                continue
            spec_r = RunSpec(f"blockserve@B{arg}", "blockserve", budgets[arg], max_batch_size=max_rows, **same)
        elif kind == "overlap":
            if arg not in budgets:
                continue
            spec_r = RunSpec(f"blockserve+overlap@B{arg}", "blockserve", budgets[arg], max_batch_size=max_rows,
                             profile=False, **same)
        elif kind == "sequential":
            spec_r = RunSpec("sequential", "sequential", widest, max_batch_size=1, n_requests=n_seq, **same)
        elif kind == "variant":
            if main_b not in budgets:
                continue
            spec_r = dataclasses.replace(variant_spec(arg, budgets[main_b], args.cache, f"B{main_b}", args.canvas),
                                         max_batch_size=max_rows)
        elif kind in ("d2f", "d2f-sequential"):
            if main_b not in budgets:
                continue
            w_run = d2f_workload(w, arg)
            label = "d2f-sequential" if kind == "d2f-sequential" else (
                f"blockserve+block-causal@B{main_b}" if arg is None else f"blockserve+d2f-{arg}@B{main_b}")
            spec_r = RunSpec(label, "sequential" if kind == "d2f-sequential" else "blockserve", budgets[main_b],
                             max_batch_size=1 if kind == "d2f-sequential" else max_rows, cache="persistent",
                             advance="step", canvas="block", n_requests=n_seq if kind == "d2f-sequential" else None)
            run_one(w_run, spec_r, pk, deadline, rep)
            rep.data["ratios"] = ratios(rep.data["runs"])
            rep.save()
            continue
        else:
            if plan.token_budget < widest:
                rep.data["skipped"].append({"label": "blockserve@auto", "why": "auto budget below the widest request"})
                continue
            spec_r = RunSpec("blockserve@auto", "blockserve", plan.token_budget, max_batch_size=max_rows, **same)
        d = run_one(w, spec_r, pk, deadline, rep)
        if d and kind == "static":  # a static run cut by its deadline still saw its widest groups' area
            budgets[arg] = max(d["peak_cost"], widest)
        if d and kind == "auto":
            rep.data["auto_budget"]["predicted_bytes_incl_weights"] = (
                plan.bytes_for(plan.token_budget) - plan.margin_bytes + weight_bytes(cfg, dtype))
            rep.data["auto_budget"]["measured_max_memory_bytes"] = d.get("max_memory_bytes")
        rep.data["ratios"] = ratios(rep.data["runs"])
        rep.save()
    rep.data["done"] = True
    rep.save()
    print(json.dumps(rep.data["ratios"], indent=2))
    print(f"wrote {rep.path} in {time.perf_counter() - T_START:.0f} s")
    return rep.data


if __name__ == "__main__":
    main()
