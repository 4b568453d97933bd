#!/usr/bin/env bash
# The skewed benchmark on one GPU (H200) with a random-weights LLaDA-8B-shaped model, then a
# DiffusionGemma-26B-A4B-shaped one (bench/gpu/diffusion_gemma_gpu.py).
# Run from the repo root with the image's Python (torch + CUDA; Ray is not needed):
#     bash bench/gpu/run.sh              # JSON in $OUT/gpu_bench.json ($OUT defaults to ./out)
#     bash bench/gpu/run.sh --smoke      # CPU, tiny shape (CI check)
#     bash bench/gpu/run.sh --shape llada-moe-7b   # LLaDA-MoE-7B-A1B-shaped (64 experts, top-8), random bf16
#     VARIANT=llada2 bash bench/gpu/run.sh         # LLaDA2.0-mini-shaped (256 experts, top-8), random bf16,
#                                                  # persistent cache on the block canvas; JSON in $OUT/llada2/
#     VARIANT=tp bash bench/gpu/run.sh             # tensor parallel vs one device, >= 2 GPUs (bench/gpu/tp_bench.py)
#     VARIANT=prefix bash bench/gpu/run.sh         # prefix caching on/off at LLaDA2.0-mini's shape (bench/gpu/prefix_gpu.py);
#                                                  # JSON in $OUT/prefix/, ~6 minutes
# Under the dual cache it also runs blockserve+step+compile (the block-only step through
# torch.compile mode="reduce-overhead": CUDA graphs) against blockserve+step (eager).
# The script keeps itself under ~7.5 minutes (priority-ordered runs under one deadline,
# JSON rewritten after each run); `timeout` is only the backstop for a hang.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OUT="${OUT:-./out}"
export BLOCKRAY_RUN_SH=1
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.max.sm,power.limit --format=csv > "$OUT/nvidia_smi.csv" || true
fi
# VARIANT=llada or VARIANT=diffusion_gemma runs one of the two; the default runs both.
# VARIANT=llada2 runs only the LLaDA2.0-mini-shaped one (its own ~7.5-minute slot).
VARIANT="${VARIANT:-all}"
# VARIANT=tp: tensor parallel against one device (bench/gpu/tp_bench.py; needs >= 2 GPUs,
# writes $OUT/tp_bench.json saying it was skipped otherwise)
if [ "$VARIANT" = tp ]; then
  exec timeout 475 "$PY" bench/gpu/tp_bench.py --out "$OUT" "$@"
fi
if [ "$VARIANT" = prefix ]; then
  mkdir -p "$OUT/prefix"
  exec timeout 475 "$PY" bench/gpu/prefix_gpu.py --out "$OUT/prefix" "$@"
fi
if [ "$VARIANT" = llada2 ]; then
  mkdir -p "$OUT/llada2"
  exec timeout 475 "$PY" bench/gpu/gpu_bench.py --out "$OUT/llada2" --shape llada2-mini --canvas block \
    --cache persistent "$@"
fi
if [ "$VARIANT" != diffusion_gemma ]; then
  timeout 475 "$PY" bench/gpu/gpu_bench.py --out "$OUT" "$@"
fi
# DiffusionGemma-26B-A4B-shaped (random bf16 weights): canvas engine vs transformers' batched generate
if [ "$VARIANT" != llada ]; then
  timeout 300 "$PY" bench/gpu/diffusion_gemma_gpu.py --out "$OUT" "$@"
fi
