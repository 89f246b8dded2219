#!/usr/bin/env bash
# Study: greedy equality of every tree drafter vs plain greedy on the GPU in float32 and bfloat16
# (random-weight models; benchmarks/studies/gpu_engine_check.py says why). Result:
# benchmarks/results/measurements/engine-check-h200-68ef764.json. Writes into $OUT (default
# benchmarks/runs/gpu-checks). ~2-3 min on an H200.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
OUT="${OUT:-benchmarks/runs/gpu-checks}"
TAG=$("$PY" -c 'from benchmarks.cost import device_tag; print(device_tag("cuda"))')
"$PY" -m benchmarks.studies.gpu_engine_check --device cuda --dtypes float32,bfloat16 --prompts 32 --new-tokens 64 \
      --out "$OUT/gpu-$TAG-engine-check.json"
ls -l "$OUT"
