#!/usr/bin/env bash
# The benchmark with the real embedded model (Qwen2.5-Coder-0.5B-Instruct) on a GPU, float32: the
# GGUF pieces prepared by benchmarks/gpu_prepare.sh, then `toolspec bench --device cuda` as on the
# CPU. The raw run goes to $OUT/gpu-embedded; build the report where the repo is (toolspec bench
# report --out DIR --name NAME).  benchmarks/README.md, "GPU runs".
#     bash benchmarks/gpu_embedded_run.sh PARTS [MAX_ITEMS]
set -euo pipefail
cd "$(dirname "$0")/.."
PARTS=${1:?directory with gguf.part-*, wheels and data.tar}
MAX_ITEMS=${2:-24}
source benchmarks/gpu_prepare.sh
RUN=${OUT:-benchmarks/runs}/gpu-embedded
"$PY" -m deployments.cli bench --device "${DEVICE:-cuda}" --dtype float32 --model "$MODEL" \
    "${DATA[@]}" --limit 60 --max-items "$MAX_ITEMS" --max-new-tokens 128 --library online \
    --methods ar,suffix,toolspec_schema,toolspec --out "$RUN" --no-report
ls -l "$RUN"
