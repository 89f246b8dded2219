#!/usr/bin/env bash
# Second prepared GPU script (after gpu_cost_probe.sh): greedy equality of every tree drafter vs
# plain greedy on the GPU in float32 and bfloat16 (random-weight models; benchmarks/gpu_engine_check.py
# says why). Writes into $OUT (default benchmarks/runs/gpu-checks). ~2-3 min on an H200.
# (Its first version also timed the 7B / 32B curves through the engine's verify step, now what
# gpu_cost_probe.sh does: results/measurements/engine-curve-h200-*.json.)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
OUT="${OUT:-benchmarks/runs/gpu-checks}"
TAG=$("$PY" -c 'from benchmarks.cost import device_tag; print(device_tag("cuda"))')
"$PY" -m benchmarks.gpu_engine_check --device cuda --dtypes float32,bfloat16 --prompts 32 --new-tokens 64 \
      --out "$OUT/gpu-$TAG-engine-check.json"
ls -l "$OUT"
