# bench/seeds.sh - sourced by learning.sh and learning_text.sh: run the script's one_seed SEED
# STAGES for each seed of SEEDS, PARALLEL at a time on the GPU; the first seed under every stage
# of STAGES, the others under stage 0 alone. Returns when every seed is done.
run_seeds() {
  local seed first=1 running=0
  for seed in $SEEDS; do
    if [ $first = 1 ]; then one_seed "$seed" "$STAGES" & first=0; else one_seed "$seed" 0 & fi
    running=$((running + 1))
    if [ "$running" -ge "$PARALLEL" ]; then wait -n; running=$((running - 1)); fi
  done
  wait
}
