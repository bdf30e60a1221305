#!/usr/bin/env bash
# MFU of the GPT recipe on one CUDA device (bf16; single, deepspeed_zero2/3, Lightning's deepspeed_stage_2).
# Sized for one H200 in under 8 minutes. Without CUDA it writes a report that says it was skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m benchmarks.run gpu=true 'sections=[]' "$@"
