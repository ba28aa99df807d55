#!/usr/bin/env bash
# bench/untied_sweep.sh - Untied Ulysses' memory/time trade-off (the talk, 11:43), as recorded in
# results/memory/untied_sweep_*_h200.json; logs, a markdown table and the plans go to $OUT (gpu_logs/untied_sweep).
#
# Llama 3.1 8B as rank 0 of eight GPUs (--sim-world 8) at SEQ tokens (1M), the ladder's stage 5
# (plain Ulysses) against --untied=K for K in KS (1 2 4; 4 = all of a GPU's 32/8 query heads):
# STEPS steps (2; the second is reported) of LAYERS layers (1), STEPS_LARGER_K steps for K > 1;
# memory per category at full depth comes from --plan. The committed run used STEPS_LARGER_K=1.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
L=${OUT:-gpu_logs/untied_sweep}; mkdir -p "$L"
SEQ=${SEQ:-1M}; LAYERS=${LAYERS:-1}; STEPS=${STEPS:-2}; KS=${KS:-1 2 4}
BASE="--config llama3.1-8b --sim-world 8 --seq-len $SEQ --task random --mem-cap-gib 80"
run() {  # run NAME ARGS...: ./train ARGS --log NAME.jsonl, its output to NAME.log
  local name=$1; shift; echo "--- $name: ./train $*"
  timeout ${RUN_TIMEOUT:-200} ./train "$@" --log "$L/$name.jsonl" > "$L/$name.log" 2>&1; echo "exit $?"
  grep -E "^step|out of memory|error" "$L/$name.log" | tail -n 2
}
run plain $BASE --layers $LAYERS --steps $STEPS --stage 5
for k in $KS; do
  steps=$STEPS; [ $k -gt 1 ] && steps=${STEPS_LARGER_K:-$STEPS}
  run untied$k $BASE --layers $LAYERS --steps $steps --stage 5 --untied=$k
done
python3 bench/summarize.py "stage 5 (plain Ulysses)=$L/plain.jsonl" \
  $(for k in $KS; do echo "--untied=$k=$L/untied$k.jsonl"; done) | tee "$L/sweep.md"
echo "full depth (32 layers), planned:"
for flags in "" $(for k in $KS; do echo "--untied=$k"; done); do
  echo "[stage 5 $flags]"; ./train $BASE --stage 5 $flags --plan | grep -E "^  (model|attention|other|comm|total)|longest"
done | tee "$L/plan.txt"
