#!/usr/bin/env bash
# Verify-cost curves c(k) of Qwen2.5-7B- and 32B-shaped models with random bf16 weights on one
# GPU (timing does not depend on weight values, so nothing is downloaded). Writes
# benchmarks/results/cost-<gpu>-qwen2.5-7b.json and ...-qwen2.5-32b.json, which the bench report
# picks up as projection curves (`toolspec bench report --out RUN`).
#
# Prepared to run in one short session (~3-6 min on an H100/H200 class GPU: building the 32B
# model takes most of it; it needs ~66 GB of GPU memory). Usage, from the repo root:
#     bash benchmarks/gpu_cost_probe.sh            # PYTHON=... to pick the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT="${OUT:-benchmarks/results}"
"$PY" - <<'EOF'
import torch
assert torch.cuda.is_available(), "no CUDA device visible"
p = torch.cuda.get_device_properties(0)
print(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}")
EOF
for shape in qwen2.5-7b qwen2.5-32b; do
  echo "== $shape"
  "$PY" -m benchmarks.cost --model "$shape" --device cuda --dtype bfloat16 --prefix-len 500 --repeats 10 \
        --ks 1,2,4,8,12,16,24,32,48,64 \
        --out "$OUT/cost-$("$PY" -c 'from benchmarks.cost import device_tag; print(device_tag("cuda"))')-$shape.json"
done
ls -l "$OUT"/cost-*.json
