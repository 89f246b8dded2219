#!/usr/bin/env bash
# Sourced by the GPU scripts on a machine without network. PARTS holds gguf.part-* (in order), the
# wheels the image lacks (*.whl, installed to $WORK/site on PYTHONPATH) and, for a checkout without
# benchmarks/datasets, data.tar (the dev JSONL files). The GGUF is assembled, its sha256 checked and
# dequantized once. Sets MODEL (the float32 HF directory; MODEL_DIR=DIR: DIR instead, no GGUF, e.g. a
# tiny model for a CPU dry run) and DATA (--data arguments of the API-Bank, BFCL v3, ToolAlpaca dev sets).
PARTS=${PARTS:?directory with gguf.part-*, wheels and data.tar}
WORK=${WORK:-/root/toolspec-gpu}
PY=${PYTHON:-$(command -v python3 || command -v python)}
mkdir -p "$WORK/site" "$WORK/data"
export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
shopt -s nullglob
_wheels=("$PARTS"/*.whl)
_tars=("$PARTS"/data.tar*)
shopt -u nullglob
if [ ${#_wheels[@]} -gt 0 ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "${_wheels[@]}"
fi
MODEL=${MODEL_DIR:-$WORK/Qwen2.5-Coder-0.5B-Instruct}
if [ -z "${MODEL_DIR:-}" ]; then
  if [ ! -f "$MODEL/config.json" ]; then
    cat "$PARTS"/gguf.part-* > "$WORK/qwen2.5-coder-0.5b-instruct-q4.gguf"
  fi
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
fi
DATA=()
for _set in api_bank bfcl_v3 toolalpaca; do
  if [ -f "benchmarks/datasets/$_set.dev.jsonl.gz" ]; then
    DATA+=(--data "benchmarks/datasets/$_set.dev.jsonl.gz")
  else
    if [ ! -f "$WORK/data/$_set.dev.jsonl" ]; then
      [ ${#_tars[@]} -gt 0 ] || { echo "no benchmarks/datasets and no $PARTS/data.tar: no dev sets" >&2; exit 2; }
      tar xf "${_tars[0]}" -C "$WORK/data"
    fi
    DATA+=(--data "$WORK/data/$_set.dev.jsonl")
  fi
done
