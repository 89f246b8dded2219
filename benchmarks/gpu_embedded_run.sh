#!/usr/bin/env bash
# The benchmark with the real embedded model (Qwen2.5-Coder-0.5B-Instruct) on a GPU, float32.
#
# A GPU machine here has no network, so the GGUF travels in pieces (benchmarks/README.md, "GPU runs"
# says how they were sent); PARTS holds gguf.part-* (in order), the gguf wheel and data.tar
# (the dev JSONL files). The GGUF is assembled, its sha256 checked (toolspec_core.model.embedded), then
# dequantized once to a float32 HF directory, and `toolspec bench --device cuda` runs as on the CPU.
# The raw run (config.json, items.jsonl, prefill.jsonl, cost.json) goes to $OUT/gpu-embedded; build
# the report where the repo is: toolspec bench report --out DIR --name NAME.
#     bash benchmarks/gpu_embedded_run.sh PARTS [MAX_ITEMS]
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
"$PY" -m deployments.cli bench --device "${DEVICE:-cuda}" --dtype float32 --model "$WORK/Qwen2.5-Coder-0.5B-Instruct" \
    --data "$WORK/data/api_bank.dev.jsonl" --data "$WORK/data/bfcl_v3.dev.jsonl" --data "$WORK/data/toolalpaca.dev.jsonl" \
    --limit 60 --max-items "$MAX_ITEMS" --max-new-tokens 128 --library online \
    --methods ar,suffix,toolspec_schema,toolspec --out "$RUN" --no-report
ls -l "$RUN"
