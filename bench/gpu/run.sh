#!/usr/bin/env bash
# The first GPU run in one command (issue 51), under 10 minutes on one H100/H200:
#     bash bench/gpu/run.sh              # JSON in $OUT ($OUT defaults to ./out), rewritten after every part
#   1. bench/gpu/first_run.py ($OUT/first_run.json, ~6 min): the attention backend per family (predicted by
#      engine/models/attention.py, and torch's own choice for the engine's calls); tokens/s of LLaDA-8B- and
#      LLaDA2.0-mini-shaped random bf16 models at B = 1, 16, 64, eager and compile_decode, each run under
#      torch.cuda.set_sync_debug_mode("warn") with the warnings and CUDA-graph replays counted;
#   2. bench/gpu/diffusion_gemma_gpu.py ($OUT/diffusion_gemma_gpu.json, ~2.5 min): the canvas engine on a
#      DiffusionGemma-26B-A4B-shaped model against transformers' batched generate.
#     bash bench/gpu/run.sh --fake-cuda  # CI (tests/test_gpu_run.py): step 1 on fake CUDA, step 2 --smoke, on a CPU
#
# The earlier runs, one slot each (~7.5 minutes):
#     VARIANT=llada bash bench/gpu/run.sh          # the skewed benchmark, LLaDA-8B-shaped (bench/gpu/gpu_bench.py);
#                                                  # --smoke: CPU, tiny shape; --shape llada-moe-7b: LLaDA-MoE-shaped
#     VARIANT=llada2 bash bench/gpu/run.sh         # the same, LLaDA2.0-mini-shaped, persistent cache on the block
#                                                  # canvas; JSON in $OUT/llada2/
#     VARIANT=diffusion_gemma bash bench/gpu/run.sh  # step 2 alone
#     VARIANT=tp bash bench/gpu/run.sh             # tensor parallel vs one device, >= 2 GPUs (bench/gpu/tp_bench.py)
#     VARIANT=prefix bash bench/gpu/run.sh         # prefix caching on/off at LLaDA2.0-mini's shape
#                                                  # (bench/gpu/prefix_gpu.py); JSON in $OUT/prefix/, ~6 minutes
# Run from the repo root with the image's Python (torch + CUDA; Ray is not needed). Each script keeps
# itself to its deadline; `timeout` is only the backstop for a hang.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OUT="${OUT:-./out}"
export BLOCKRAY_RUN_SH=1
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.max.sm,power.limit --format=csv > "$OUT/nvidia_smi.csv" || true
fi
VARIANT="${VARIANT:-first}"
case "$VARIANT" in
  first)
    dg=()
    for a in "$@"; do if [ "$a" = --fake-cuda ] || [ "$a" = --smoke ]; then dg=(--smoke); fi; done
    status=0
    timeout 400 "$PY" bench/gpu/first_run.py --out "$OUT" "$@" || status=$?
    # what is left of the 10 minutes (the canvas engine's part stops starting runs at half its deadline)
    timeout 190 "$PY" bench/gpu/diffusion_gemma_gpu.py --out "$OUT" --requests 16 --deadline-s 150 "$@" "${dg[@]}" \
      || status=$?
    exit "$status" ;;
  llada) exec timeout 475 "$PY" bench/gpu/gpu_bench.py --out "$OUT" "$@" ;;
  llada2)
    mkdir -p "$OUT/llada2"
    exec timeout 475 "$PY" bench/gpu/gpu_bench.py --out "$OUT/llada2" --shape llada2-mini --canvas block \
      --cache persistent "$@" ;;
  diffusion_gemma) exec timeout 300 "$PY" bench/gpu/diffusion_gemma_gpu.py --out "$OUT" "$@" ;;
  tp) exec timeout 475 "$PY" bench/gpu/tp_bench.py --out "$OUT" "$@" ;;
  prefix)
    mkdir -p "$OUT/prefix"
    exec timeout 475 "$PY" bench/gpu/prefix_gpu.py --out "$OUT/prefix" "$@" ;;
  *) echo "unknown VARIANT=$VARIANT (first, llada, llada2, diffusion_gemma, tp, prefix)" >&2; exit 2 ;;
esac
