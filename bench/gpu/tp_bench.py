"""Tensor parallel on GPUs: the engine-level comparison of tests/test_tensor_parallel.py
(bench/tp_parity: every family's case, 12 mixed prompts, persistent and dual caches) run
over NCCL when the machine has >= 2 GPUs: ranks on GPUs [0, 1] (and [2, 3]) for N = 2,
all four for N = 4 where there are four, the one-device tokens computed meanwhile on
GPU 0. Writes $OUT/tp_bench.json: per case and N, the rows whose tokens equal one
device's and each rank's seconds (load + generate), weights held and bytes read.

Tokens are compared, not asserted: in float32 on GPUs the row-parallel sums change
summation order (and cuBLAS picks kernels per shape), so a near-tie between two tokens
may flip where float64 on CPU never did; the JSON says how many rows differ.

    python bench/gpu/tp_bench.py --out OUT [--dtype float32|bfloat16|float64]"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench.tp_parity import CASES, baseline, run_sharded, write_checkpoints  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float64"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    result = {"gpus": gpus, "dtype": args.dtype}
    if gpus < 2:
        result["skipped"] = f"{gpus} GPU(s): the tensor-parallel variant needs >= 2"
        print(result["skipped"])
        with open(os.path.join(args.out, "tp_bench.json"), "w") as f:
            json.dump(result, f, indent=2)
        return 0
    world = 4 if gpus >= 4 else 2
    dtype = getattr(torch, args.dtype)
    root = tempfile.mkdtemp(prefix="tp-bench-")
    write_checkpoints(root)
    t0 = time.perf_counter()

    def one_device():
        t = time.perf_counter()
        out = baseline(root, dtype, "cuda:0")
        return out, time.perf_counter() - t

    (want, base_s), got = run_sharded(root, world=world, dtype=dtype, backend="nccl", while_waiting=one_device)
    result.update(world=world, wall_s=time.perf_counter() - t0, one_device_s=base_s, cases={})
    for case in CASES:
        for size, ranks in sorted(got.get(case.name, {}).items()):
            equal = sum(a == b for a, b in zip(ranks[0]["tokens"], want[case.name]))
            result["cases"][f"{case.name}/tp{size}"] = dict(
                rows=len(want[case.name]), rows_equal=equal, ranks_agree=all(r["tokens"] == ranks[0]["tokens"] for r in ranks),
                seconds=[round(r["seconds"], 3) for r in ranks], resident_bytes=[r["resident_bytes"] for r in ranks],
                read_bytes=[r["read_bytes"] for r in ranks])
    with open(os.path.join(args.out, "tp_bench.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result["cases"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
