#!/usr/bin/env bash
# The benchmark with the real embedded model (Qwen2.5-Coder-0.5B-Instruct) on a GPU, float32.
#
# A GPU machine here has no network, so the GGUF travels in pieces (benchmarks/README.md, "GPU runs"
# says how they were sent); PARTS holds gguf.part-* (in order), the gguf wheel and data.tar
# (the dev JSONL files). The GGUF is assembled, its sha256 checked (toolspec_core.model.embedded), then
# dequantized once to a float32 HF directory, and `toolspec bench --device cuda` runs as on the CPU.
# The raw run (config.json, items.jsonl, prefill.jsonl, cost.json) goes to $OUT/gpu-embedded; build
# the report where the repo is: toolspec bench report --out DIR --name NAME.
# MODE=batch runs the batched measurement instead (toolspec bench --batch up to B = 64, 48 items of
# each dev set, to $OUT/gpu-batch; report: toolspec bench --batch ... --report-only), then the step
# time of a 7B-shaped random-weight model by batch size (benchmarks.batch_timing, $OUT/batch-timing-7b.json).
#     bash benchmarks/gpu_embedded_run.sh PARTS [MAX_ITEMS]
#     MODE=batch bash benchmarks/gpu_embedded_run.sh PARTS
set -euo pipefail
cd "$(dirname "$0")/.."
PARTS=${1:?directory with gguf.part-*, the gguf wheel and data.tar}
MAX_ITEMS=${2:-24}
WORK=${WORK:-/root/toolspec-gpu}
RUN=${OUT:-benchmarks/runs}/gpu-embedded
PY=${PYTHON:-$(command -v python3 || command -v python)}
mkdir -p "$WORK/site" "$WORK/data"
if [ ! -f "$WORK/Qwen2.5-Coder-0.5B-Instruct/config.json" ]; then
  cat "$PARTS"/gguf.part-* > "$WORK/qwen2.5-coder-0.5b-instruct-q4.gguf"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$PARTS"/*.whl
fi
export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
tar xf "$PARTS"/data.tar* -C "$WORK/data"
"$PY" - "$WORK" <<'PYEOF'
import sys, time
from pathlib import Path
from toolspec_core.model.embedded import convert_gguf, verify_gguf
work = Path(sys.argv[1])
if not (work / "Qwen2.5-Coder-0.5B-Instruct" / "config.json").is_file():
    t = time.perf_counter()
    gguf = work / "qwen2.5-coder-0.5b-instruct-q4.gguf"
    verify_gguf(gguf)  # sha256 of the assembled pieces
    convert_gguf(gguf, work / "Qwen2.5-Coder-0.5B-Instruct")
    print(f"verified and dequantized in {time.perf_counter() - t:.0f}s", flush=True)
PYEOF
DATA=(--data "$WORK/data/api_bank.dev.jsonl" --data "$WORK/data/bfcl_v3.dev.jsonl" --data "$WORK/data/toolalpaca.dev.jsonl")
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
