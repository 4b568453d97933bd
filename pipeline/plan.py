"""`blockray plan`: what a model needs per device on 1, 2, 4 and 8 GPUs (engine.budget's
tensor-parallel memory plan), from its config.json alone: no GPU, no weights, no Ray.

    blockray plan --model PATH --gpu h200 [--tensor-parallel-size N] [--dtype bfloat16]

prints the device memory it assumes (Ray's accelerator types, pipeline.resources, the
table the job's preflight refuses with), then per size: weights per device (of which
copies every rank holds), K/V bytes per cached token per device, the gathered logits of
one row, the token budget one engine would plan, and whether it fits; and the smallest
size that fits. Exit 0 when the size asked (default: the smallest of 1/2/4/8) fits, 2 when
it does not."""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

SIZES = (1, 2, 4, 8)


def build_parser() -> argparse.ArgumentParser:
    from .resources import ACCELERATOR_MEMORY_GIB

    p = argparse.ArgumentParser(prog="blockray plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a local model folder (only its config.json is read)")
    p.add_argument("--gpu", default="h200", help=f"GPU type, one of {', '.join(sorted(ACCELERATOR_MEMORY_GIB))} "
                   "(case-insensitive), or a memory size in GiB (e.g. 141)")
    p.add_argument("--tensor-parallel-size", type=int, default=None, help="the size to check (default: the smallest "
                   "of 1, 2, 4, 8 that fits)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--cache", default="refresh", choices=("none", "refresh", "dual", "persistent"))
    p.add_argument("--max-batch-size", type=int, default=256)
    return p


def device_bytes(gpu: str) -> "tuple[int, str]":
    """(bytes, what) of a GPU type or a size in GiB."""
    from .resources import ACCELERATOR_MEMORY_GIB

    table = {k.lower(): (k, v) for k, v in ACCELERATOR_MEMORY_GIB.items()}
    if gpu.lower() in table:
        name, gib = table[gpu.lower()]
        return gib << 30, f"{name}: {gib} GiB"
    try:
        gib = float(gpu)
    except ValueError:
        raise SystemExit(f"error: --gpu {gpu!r} is neither a known GPU type ({', '.join(sorted(ACCELERATOR_MEMORY_GIB))})"
                         " nor a size in GiB") from None
    return int(gib * (1 << 30)), f"{gib:g} GiB"


def main(argv: Optional[Sequence[str]] = None) -> int:
    import torch

    from engine.budget import GiB, parallel_plan
    from engine.config import EngineConfig
    from engine.loader import read_config

    args = build_parser().parse_args(argv)
    memory, what = device_bytes(args.gpu)
    dtype = getattr(torch, args.dtype)
    mcfg = read_config(args.model)
    config = EngineConfig(gpu_memory_utilization=args.gpu_memory_utilization, block_length=args.block_length,
                          cache=args.cache, max_batch_size=args.max_batch_size)
    sizes = sorted(set(SIZES) | ({args.tensor_parallel_size} if args.tensor_parallel_size else set()))
    print(f"model {args.model}: {mcfg.family.name}, {mcfg.num_params() / 1e9:.2f} B parameters "
          f"({mcfg.active_params() / 1e9:.2f} B active per token), {args.dtype}")
    print(f"device memory assumed: {what} per GPU, gpu_memory_utilization {args.gpu_memory_utilization:g} "
          f"-> {args.gpu_memory_utilization * memory / GiB:.1f} GiB per engine rank")
    print(f"{'GPUs':>4}  {'weights/GPU':>12}  {'replicated':>10}  {'K/V per token':>13}  {'logits/row':>10}  "
          f"{'token budget':>12}  fits")
    plans = {n: parallel_plan(mcfg, dtype, config, memory, n) for n in sizes}
    for n, p in plans.items():
        if p.why:
            print(f"{n:>4}  {'-':>12}  {'-':>10}  {'-':>13}  {'-':>10}  {'-':>12}  no: {p.why}")
            continue
        print(f"{n:>4}  {p.weights_bytes / GiB:>8.2f} GiB  {p.replicated_bytes / GiB:>6.2f} GiB  "
              f"{p.kv_bytes_per_token / 1024:>9.1f} KiB  {p.logits_bytes_per_row / 2**20:>6.1f} MiB  "
              f"{p.token_budget:>12,}  {'yes' if p.fits else 'no'}")
    smallest = next((n for n in sizes if plans[n].fits), None)
    print("smallest tensor_parallel_size that fits: " + (str(smallest) if smallest else f"none of {sizes}"))
    asked = args.tensor_parallel_size or smallest
    return 0 if asked is not None and plans[asked].fits else 2


__all__ = ["main", "build_parser", "device_bytes", "SIZES"]
