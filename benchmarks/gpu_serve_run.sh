#!/usr/bin/env bash
# GPU serving on the fast step, in one prepared run of at most ~8 minutes (benchmarks/README.md,
# "GPU runs"): the embedded model served on the GPU -- ToolSpec and plain greedy, each with CUDA
# graphs (captured when the replica starts) and without -- one app at a time, without Ray (the
# replica's own app, benchmarks.studies.serve_noray), and `toolspec loadtest` against each on the
# same unique-prefix requests (no prefix cache helps), plain greedy without graphs the baseline.
#   0. gpu_prepare.sh: the embedded model from its GGUF pieces and the dev sets;
#   1. benchmarks.studies.loadtest_local --no-ray --one-at-a-time over APPS, under `timeout`.
# Files in $OUT: run.log, <NAME>.json/.md/.png (the merged report), <NAME>.outputs.json (outputs
# compared with the first app's), <NAME>.records.jsonl, <NAME>.apps/ (each app's log: its start-up
# line says how long the weights, the KV pool and the graphs took).
#     bash benchmarks/gpu_serve_run.sh PARTS      # PARTS: gguf.part-* and wheels; COMMIT=abc1234 names the report
# The settings below are environment variables. CPU dry run (the graphed apps fall back to eager
# steps, logged): DEVICE=auto MODEL_DIR=<tiny HF dir> LEVELS=1,2 REQUESTS=2 MAX_TOKENS=8 OUT=/tmp/dry
set -euo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
PARTS=${1:?directory with gguf.part-* and wheels (and data.tar where the checkout has no benchmarks/datasets)}
OUT=${OUT:-benchmarks/runs/gpu-serve}
DEVICE=${DEVICE:-cuda}          # auto: a CPU dry run (graphs off, one warning per replica)
DTYPE=${DTYPE:-float32}         # float32 keeps greedy output bit-identical across the apps
BUDGET_S=${BUDGET_S:-470}
APPS=${APPS:-greedy-graphs=ar+graphs,toolspec-graphs=toolspec+graphs,toolspec=toolspec,greedy=ar}
LEVELS=${LEVELS:-1,4,16}
REQUESTS=${REQUESTS:-24}        # a level
MAX_TOKENS=${MAX_TOKENS:-128}
PROMPT_CHARS=${PROMPT_CHARS:-2000:8000}
WARM_TOKENS=${WARM_TOKENS:-2048}  # cuda_graphs_warm_tokens: KV rows whose step shapes are captured at start
PORT=${PORT:-8000}
mkdir -p "$OUT"
source benchmarks/gpu_log.sh  # tee to $OUT/run.log, say, left

say "prepare (PARTS=$PARTS, DEVICE=$DEVICE, budget ${BUDGET_S}s)"
source benchmarks/gpu_prepare.sh
"$PY" - "$DEVICE" <<'PYEOF'
import sys, torch, transformers
if sys.argv[1].startswith("cuda"):
    assert torch.cuda.is_available(), "no CUDA device visible"
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB", flush=True)
print(f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
for mod in ("uvicorn", "fastapi", "httpx", "llguidance"):
    __import__(mod)  # the replica's app and the load tester (no Ray needed)
PYEOF
TAG=$("$PY" -c 'import sys; from benchmarks.cost import device_tag; print(device_tag(sys.argv[1]))' "$DEVICE")
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo dev)}
NAME=${NAME:-serve-graphs-unique-$TAG-$COMMIT}
DATASETS=()
for ((i = 1; i < ${#DATA[@]}; i += 2)); do DATASETS+=(--dataset "${DATA[$i]}"); done

limit=$(($(left) - 10))
say "stage 1: $APPS at c = $LEVELS, $REQUESTS requests a level, unique prefixes (limit ${limit}s)"
if [ "$limit" -gt 0 ]; then
  timeout -k 20 "$limit" "$PY" -m benchmarks.studies.loadtest_local --no-ray --one-at-a-time --apps "$APPS" \
    --set "model=\"$MODEL\"" --set "device=\"$DEVICE\"" --set "dtype=\"$DTYPE\"" \
    --set "cuda_graphs_warm_tokens=$WARM_TOKENS" --set "max_num_seqs=16" \
    "${DATASETS[@]}" --concurrency "$LEVELS" --num-requests "$REQUESTS" --max-tokens "$MAX_TOKENS" \
    --warmup 2 --max-seconds 120 --port "$PORT" --out "$OUT" \
    --prompt-chars "$PROMPT_CHARS" --unique-prefix --save-records --name "$NAME" --hardware "$TAG" \
    || say "stage 1 stopped with status $? (<NAME>.apps/ keeps every finished app's levels; rerun to resume)"
fi
for log in "$OUT/$NAME.apps"/*.serve.log; do
  [ -f "$log" ] && grep -h "ready in\|cuda_graphs off" "$log" | sed "s|^|$(basename "$log" .serve.log): |" || true
done
say "done; files in $OUT:"
ls -l "$OUT"
