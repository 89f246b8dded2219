#!/usr/bin/env bash
# The benchmark with the real embedded model (Qwen2.5-Coder-0.5B-Instruct) on a GPU, float32.
#
# A GPU machine here has no network, so the GGUF travels in pieces (benchmarks/README.md, "GPU runs"
# says how they were sent); benchmarks/gpu_prepare.sh assembles, checks and dequantizes it, and
# `toolspec bench --device cuda` runs as on the CPU.
# The raw run (config.json, items.jsonl, prefill.jsonl, cost.json) goes to $OUT/gpu-embedded; build
# the report where the repo is: toolspec bench report --out DIR --name NAME.
# MODE=batch runs the batched measurement instead (toolspec bench --batch up to B = 64, 48 items of
# each dev set, to $OUT/gpu-batch; report: toolspec bench --batch ... --report-only), then the step
# time of a 7B-shaped random-weight model by batch size (benchmarks.batch_timing, $OUT/batch-timing-7b.json).
#     bash benchmarks/gpu_embedded_run.sh PARTS [MAX_ITEMS]
#     MODE=batch bash benchmarks/gpu_embedded_run.sh PARTS
set -euo pipefail
cd "$(dirname "$0")/.."
PARTS=${1:?directory with gguf.part-*, wheels and data.tar}
MAX_ITEMS=${2:-24}
source benchmarks/gpu_prepare.sh
RUN=${OUT:-benchmarks/runs}/gpu-embedded
if [ "${MODE:-}" = batch ]; then
  "$PY" -m deployments.cli bench --batch 1,2,4,8,16,32,64 --device "${DEVICE:-cuda}" --dtype float32 \
      --model "$WORK/Qwen2.5-Coder-0.5B-Instruct" "${DATA[@]}" --limit 48 --max-new-tokens 128 \
      --methods ar,suffix,toolspec --calibrate --out "${OUT:-benchmarks/runs}/gpu-batch" --results-dir "${OUT:-benchmarks/runs}/gpu-batch/report"
  "$PY" -m benchmarks.batch_timing --model qwen2.5-7b --device "${DEVICE:-cuda}" --batches 1,2,4,8,16,32,64 \
      --out "${OUT:-benchmarks/runs}/batch-timing-7b.json"
  exit 0
fi
"$PY" -m deployments.cli bench --device "${DEVICE:-cuda}" --dtype float32 --model "$WORK/Qwen2.5-Coder-0.5B-Instruct" \
    "${DATA[@]}" --limit 60 --max-items "$MAX_ITEMS" --max-new-tokens 128 --library online \
    --methods ar,suffix,toolspec_schema,toolspec --out "$RUN" --no-report
ls -l "$RUN"
