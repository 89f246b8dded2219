#!/usr/bin/env bash
# Sourced by the GPU scripts: the embedded model as a float32 HF directory on a GPU machine that
# has no network. PARTS holds gguf.part-* (in order), the wheels the machine's image lacks (*.whl)
# and data.tar (the dev JSONL files). The GGUF is assembled, its sha256 checked
# (toolspec_core.model.embedded), dequantized once to $WORK/Qwen2.5-Coder-0.5B-Instruct; the wheels
# go to $WORK/site (on PYTHONPATH), the data to $WORK/data.
PARTS=${PARTS:?directory with gguf.part-*, wheels and data.tar}
WORK=${WORK:-/root/toolspec-gpu}
PY=${PYTHON:-$(command -v python3 || command -v python)}
mkdir -p "$WORK/site" "$WORK/data"
if [ ! -f "$WORK/Qwen2.5-Coder-0.5B-Instruct/config.json" ]; then
  cat "$PARTS"/gguf.part-* > "$WORK/qwen2.5-coder-0.5b-instruct-q4.gguf"
fi
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$PARTS"/*.whl
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
DATA=(--data benchmarks/datasets/api_bank.dev.jsonl.gz --data benchmarks/datasets/bfcl_v3.dev.jsonl.gz --data benchmarks/datasets/toolalpaca.dev.jsonl.gz)
