#!/usr/bin/env bash
# Second prepared GPU script (after gpu_cost_probe.sh): (1) the verify-cost curve of the 7B and
# 32B shapes through the engine's own verify step (host-built inputs, tree mask, argmax, KV commit)
# next to the bare forward's; (2) greedy equality of every tree drafter vs plain greedy on the GPU
# in float32 and bfloat16 (random-weight models; benchmarks/gpu_engine_check.py says why).
# Writes into $OUT (default benchmarks/results/measurements). ~3-4 min on an H200.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
OUT="${OUT:-benchmarks/results/measurements}"
TAG=$("$PY" -c 'from benchmarks.cost import device_tag; print(device_tag("cuda"))')
"$PY" -m benchmarks.gpu_engine_check --device cuda --dtypes float32,bfloat16 --prompts 32 --new-tokens 64 \
      --out "$OUT/gpu-$TAG-engine-check.json"
for shape in qwen2.5-7b qwen2.5-32b; do
  echo "== $shape via the engine's verify step"
  "$PY" -m benchmarks.cost --model "$shape" --device cuda --dtype bfloat16 --prefix-len 500 --repeats 15 \
        --ks 1,2,4,8,12,16,24,32,48,64 --via engine --out "$OUT/gpu-$TAG-$shape-engine-curve.json"
done
ls -l "$OUT"
