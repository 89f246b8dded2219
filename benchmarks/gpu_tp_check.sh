#!/usr/bin/env bash
# The tensor-parallel worker path on one GPU (TP = 1: DeepSpeed init_inference, the sharded loader,
# the step protocol; the rank runs in-process, no Ray) against the plain single-process engine, float32,
# the embedded model, 30 dev items alone and 4 at a time (benchmarks/tp_check.py).
#     bash benchmarks/gpu_tp_check.sh PARTS      # PARTS: see benchmarks/gpu_prepare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PARTS=${1:?directory with gguf.part-*, wheels and data.tar}
source benchmarks/gpu_prepare.sh
TAG=$("$PY" -c 'from benchmarks.cost import device_tag; print(device_tag("cuda"))')
"$PY" -m benchmarks.tp_check --workers local --device cuda --dtype float32 --model "$WORK/Qwen2.5-Coder-0.5B-Instruct" \
    --items 30 --max-tokens 128 --batch 4 --out "${OUT:-benchmarks/runs}/tp1-deepspeed-$TAG.json"
