#!/usr/bin/env bash
# The batched GPU step in one prepared run of at most ~8 minutes (benchmarks/README.md, "GPU runs"):
#   0. gpu_prepare.sh: the embedded model from its GGUF pieces and the dev sets;
#   1. the 7B-shaped step curve for each attention mode in MODES (benchmarks.batch_timing);
#   2. toolspec bench --batch --same-batch-reference with the real embedded model, in the mode
#      fastest in (1) (ATTENTION=MODE: that one);
#   3. its report, also from a stopped run (unfinished runs marked partial).
# Every stage runs under `timeout` within one budget (BUDGET_S), so a slow stage cannot eat the next
# one's time. Files in $OUT: run.log, step-curve-<gpu>-<shape>.json, <NAME>.json/.md/.png, raw/.
#     bash benchmarks/gpu_step_run.sh PARTS          # PARTS: gguf.part-* and wheels; COMMIT=abc1234 names the report
# The settings below are environment variables; README's "GPU runs" gives a CPU dry run of them.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
PARTS=${1:?directory with gguf.part-* and wheels (and data.tar where the checkout has no benchmarks/datasets)}
OUT=${OUT:-benchmarks/runs/gpu-step}
DEVICE=${DEVICE:-cuda}
BUDGET_S=${BUDGET_S:-470}
STEP_S=${STEP_S:-100}          # stage 1's limit
REPORT_S=${REPORT_S:-30}       # kept for stage 3
STEP_MODEL=${STEP_MODEL:-qwen2.5-7b}
STEP_BATCHES=${STEP_BATCHES:-1,4,16,64}
STEP_CONTEXT=${STEP_CONTEXT:-500}
STEP_REPEATS=${STEP_REPEATS:-5}
MODES=${MODES:-per_sequence,ragged,ragged+graphs}
BATCHES=${BATCHES:-4,16,64}
ITEMS=${ITEMS:-48}
MAX_NEW=${MAX_NEW:-128}
COST=${COST:-measured}
mkdir -p "$OUT/raw"
source benchmarks/gpu_log.sh  # tee to $OUT/run.log, say, left

say "prepare (PARTS=$PARTS, DEVICE=$DEVICE, budget ${BUDGET_S}s)"
source benchmarks/gpu_prepare.sh
"$PY" - "$DEVICE" <<'PYEOF'
import sys, torch, transformers
dev = sys.argv[1]
if dev.startswith("cuda"):
    assert torch.cuda.is_available(), "no CUDA device visible"
    p = torch.cuda.get_device_properties(0)
    print(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB", flush=True)
print(f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
PYEOF
TAG=$("$PY" -c 'import sys; from benchmarks.cost import device_tag; print(device_tag(sys.argv[1]))' "$DEVICE")
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo dev)}
NAME=${NAME:-batch-3bench-$TAG-$COMMIT}
CURVE="$OUT/step-curve-$TAG-$STEP_MODEL.json"

limit=$(($(left) - REPORT_S - 60))
limit=$((limit < STEP_S ? limit : STEP_S))
say "stage 1: step curve of $STEP_MODEL, B = $STEP_BATCHES, modes $MODES (limit ${limit}s)"
if [ "$limit" -gt 0 ]; then
  timeout -k 10 "$limit" "$PY" -m benchmarks.batch_timing --model "$STEP_MODEL" --device "$DEVICE" \
    --batches "$STEP_BATCHES" --drafts 0,3,15 --context "$STEP_CONTEXT" --repeats "$STEP_REPEATS" \
    --modes "$MODES" --out "$CURVE" || say "stage 1 stopped with status $? (its file keeps what it measured)"
fi

BEST=${ATTENTION:-$("$PY" -m benchmarks.batch_timing --best "$CURVE" || true)}
ENGINE=()
case "$BEST" in
  "" | default) ;;
  *+graphs) ENGINE=(--attention "${BEST%+graphs}" --cuda-graphs) ;;
  *) ENGINE=(--attention "$BEST") ;;
esac
say "stage 2 runs in mode '${BEST:-the target default}' (${ENGINE[*]-no engine flags})"

BENCH=(--batch "$BATCHES" --same-batch-reference --device "$DEVICE" --dtype float32 "${DATA[@]}" --limit "$ITEMS"
  --max-new-tokens "$MAX_NEW" --methods ar,suffix,toolspec --cost "$COST" --calibrate
  --out "$OUT/raw" --results-dir "$OUT" --name "$NAME")
limit=$(($(left) - REPORT_S))
say "stage 2: toolspec bench --batch $BATCHES, $ITEMS items of each dev set, $MAX_NEW new tokens (limit ${limit}s)"
rm -f "$OUT/$NAME.json"  # a report from an earlier run is rebuilt
if [ "$limit" -gt 0 ]; then
  timeout -k 10 "$limit" "$PY" -m deployments.cli bench "${BENCH[@]}" --model "$MODEL" ${ENGINE[@]+"${ENGINE[@]}"} \
    || say "stage 2 stopped with status $? (the report below keeps its finished groups)"
fi

if [ ! -f "$OUT/$NAME.json" ] && [ -s "$OUT/raw/batch.jsonl" ]; then  # a finished stage 2 wrote its report
  say "stage 3: the report of what stage 2 finished"
  timeout -k 5 "$((REPORT_S > 10 ? REPORT_S - 5 : 5))" "$PY" -m deployments.cli bench "${BENCH[@]}" \
    --model "$(basename "$MODEL")" --report-only || say "report: status $?"
fi
say "done; files in $OUT:"
ls -l "$OUT" "$OUT/raw"
