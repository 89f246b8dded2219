#!/usr/bin/env bash
# Study: H200 verify-cost curves of Qwen2.5 shapes. Result: benchmarks/results/curves/cost-h200-*.json.
# Verify-cost curves c(k) of Qwen2.5-0.5B-, 7B- and 32B-shaped models with random bf16 weights on
# one GPU (timing does not depend on weight values, so nothing is downloaded), plus the 7B shape
# over a 2,000-token prefix, each timed through the engine's own verify step (`toolspec bench-cost`).
# Writes cost-<gpu>-<shape>.json into $OUT (default benchmarks/results/curves), which every bench
# report picks up as projection curves. (The committed cost-h200-*.json were taken with the bare
# forward + lm_head, before bench-cost used the engine path; the engine path measured within 0.03 of
# them: results/measurements/engine-curve-h200-*.json.)
#
# Prepared to run in one short session (~3-5 min on an H100/H200 class GPU; the 32B shape needs
# ~66 GB of GPU memory). Runs under the GPU image's own torch/transformers (>= 5.0; the cache
# argument's name is looked up, see toolspec_core.model.target.cache_kwarg). From the repo root:
#     bash benchmarks/studies/gpu_cost_probe.sh            # PYTHON=... to pick the interpreter
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
OUT="${OUT:-benchmarks/results/curves}"
"$PY" - <<'PYEOF'
import torch, transformers
assert torch.cuda.is_available(), "no CUDA device visible"
p = torch.cuda.get_device_properties(0)
print(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, transformers {transformers.__version__}")
PYEOF
TAG=$("$PY" -c 'from benchmarks.cost import device_tag; print(device_tag("cuda"))')
KS=1,2,4,8,12,16,24,32,48,64
probe() {  # shape prefix_len out_name
  echo "== $1, prefix $2"
  "$PY" -m benchmarks.cost --model "$1" --device cuda --dtype bfloat16 --prefix-len "$2" --repeats 15 \
        --ks "$KS" --out "$OUT/$3"
}
probe qwen2.5-0.5b 500 "cost-$TAG-qwen2.5-0.5b.json"
probe qwen2.5-7b 500 "cost-$TAG-qwen2.5-7b.json"
probe qwen2.5-7b 2000 "prefix2000-$TAG-qwen2.5-7b.json"
probe qwen2.5-32b 500 "cost-$TAG-qwen2.5-32b.json"
ls -l "$OUT"
