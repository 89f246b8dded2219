#!/usr/bin/env bash
# Study: the tensor-parallel worker path on one GPU vs the plain engine. Result:
# benchmarks/results/measurements/tp1-deepspeed-embedded-h200{,-bf16}-abc81c2.json.
# The tensor-parallel worker path on one GPU (TP = 1: DeepSpeed init_inference, the sharded loader,
# the step protocol; the rank runs in-process, no Ray) against the plain single-process engine, float32,
# the embedded model, 30 dev items alone and 4 at a time (tests/deployments/tp_run.py).
#     bash benchmarks/studies/gpu_tp_check.sh PARTS      # PARTS: see benchmarks/gpu_prepare.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PARTS=${1:?directory with gguf.part-*, wheels and data.tar}
source benchmarks/gpu_prepare.sh
TAG=$("$PY" -c 'from benchmarks.cost import device_tag; print(device_tag("cuda"))')
PYTHONPATH=. "$PY" tests/deployments/tp_run.py --workers local --device cuda --dtype float32 --model "$WORK/Qwen2.5-Coder-0.5B-Instruct" \
    --items 30 --max-tokens 128 --batch 4 --out "${OUT:-benchmarks/runs}/tp1-deepspeed-$TAG.json"
