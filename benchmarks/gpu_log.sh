# Sourced by the GPU scripts once OUT, START and BUDGET_S are set: everything the script prints also
# goes to $OUT/run.log (complete before the script ends); say() stamps a line, left() is the budget left.
exec > >(tee -a "$OUT/run.log") 2>&1
TEE=$!
trap 'exec >&- 2>&-; wait "$TEE" 2>/dev/null || true' EXIT  # run.log complete before the script ends
say() { echo "=== $(date -u +%H:%M:%S) +$(($(date +%s) - START))s: $*"; }
left() { echo $((BUDGET_S - ($(date +%s) - START))); }
