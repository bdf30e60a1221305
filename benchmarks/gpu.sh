#!/usr/bin/env bash
# One CUDA device, one step at a time (without CUDA a step writes a note that it skipped):
#   mfu     MFU of the GPT recipe in bf16: single, hybrid eager/compiled, deepspeed_zero2/3, Lightning's
#           deepspeed_stage_2 (benchmarks/gpu.py; options: Hydra overrides of benchmarks/conf/config.yaml); sized for
#           under 8 minutes on one H200
#   float8  tokens/s and MFU of a 1.5B Llama-shaped decoder in bf16 eager, bf16 compiled, FP8 tensorwise and FP8
#           rowwise against the device's bf16 and FP8 peaks (benchmarks/float8_mfu.py; needs torchao; options:
#           --variants, --steps, --model, --dry-run: CPU, tiny model). Estimated 5-7 minutes on one H100/H200 (4
#           processes: a 1.5B model built and materialised, 3 of them compiled, 4 + 12 steps); not yet run on a GPU.
#
#   benchmarks/gpu.sh float8            benchmarks/gpu.sh mfu            benchmarks/gpu.sh (both: about 15 minutes)
# Results: benchmarks/results/<date>/ (results.json of benchmarks.run; float8_mfu.json and .md).
set -euo pipefail
cd "$(dirname "$0")/.."
step="all"
if [[ $# -gt 0 && "$1" != *=* ]]; then step="$1"; shift; fi  # key=value alone: the mfu step's overrides, as before
case "$step" in
  mfu) exec python -m benchmarks.run gpu=true 'sections=[]' "$@" ;;
  float8) exec python -m benchmarks.float8_mfu "$@" ;;
  all) python -m benchmarks.run gpu=true 'sections=[]' "$@"; exec python -m benchmarks.float8_mfu ;;
  *) echo "benchmarks/gpu.sh: unknown step '$step': use mfu, float8 or nothing (both)" >&2; exit 2 ;;
esac
