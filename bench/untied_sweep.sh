#!/usr/bin/env bash
# bench/untied_sweep.sh - Untied Ulysses' trade-off (the talk, 11:43): Llama 3.1 8B as rank 0 of
# eight GPUs (--sim-world 8) at SEQ tokens (1M by default), the full ladder stack of stage 5
# (plain Ulysses) against --untied=K for K = 1, 2, 4 (4 = all of a GPU's 32/8 query heads).
# Each run: 2 steps (the second is reported; STEPS_LARGER_K=1 runs one for K > 1) of LAYERS layers; memory is the arena's,
# per category, at full depth from the plan beside it. Logs to $OUT (or ./gpu_logs).
set -u
FINAL=${OUT:-gpu_logs}; mkdir -p "$FINAL"
OUT=$(mktemp -d)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
SEQ=${SEQ:-1M}; LAYERS=${LAYERS:-1}; STEPS=${STEPS:-2}
BASE="--config llama3.1-8b --sim-world 8 --seq-len $SEQ --task random --mem-cap-gib 80"
run() { local name=$1; shift; echo "--- $name: ./train $*"; timeout ${RUN_TIMEOUT:-200} ./train "$@" --log "$OUT/$name.jsonl" > "$OUT/$name.log" 2>&1; echo "exit $?"; grep -E "^step|out of memory|error" "$OUT/$name.log" | tail -n 2; }
run plain $BASE --layers $LAYERS --steps $STEPS --stage 5
for k in ${KS:-1 2 4}; do
  steps=$STEPS; [ $k -gt 1 ] && steps=${STEPS_LARGER_K:-$STEPS}
  run untied$k $BASE --layers $LAYERS --steps $steps --stage 5 --untied=$k
done
python3 bench/summarize.py "stage 5 (plain Ulysses)=$OUT/plain.jsonl" \
  $(for k in ${KS:-1 2 4}; do echo "--untied=$k=$OUT/untied$k.jsonl"; done) | tee "$OUT/sweep.md"
echo "full depth (32 layers), planned:"
for flags in "" $(for k in ${KS:-1 2 4}; do echo "--untied=$k"; done); do
  echo "[stage 5 $flags]"; ./train $BASE --stage 5 $flags --plan | grep -E "^  (model|attention|other|comm|total)|longest"
done | tee "$OUT/plan.txt"
(cd "$OUT" && tar czf "$FINAL/sweep_logs.tar.gz" . && cp sweep.md plan.txt "$FINAL"/ 2>/dev/null); true
