#!/usr/bin/env bash
# bench/core_runs.sh - the one-GPU training runs behind results/steps/core_*_h200.json, run from the
# repository root after make; each run's log and --log JSON lines go to $OUT (default gpu_logs/core).
#
#   PARTS="8k 256k 64k" (the default) bash bench/core_runs.sh
#   8k    make run's job: Llama 3.2 3B, 8K tokens, 30 steps        -> core_3b_8k_h200.json
#   256k  the small model (53M parameters) at 256K tokens, 2 steps  -> core_small_256k_h200.json
#   64k   Llama 3.2 3B, 64K tokens, --ckpt, 3 steps, with --attention auto (the default) and
#         --attention fast                                         -> core_3b_64k_h200.json
# Step times are medians of the steps after the first (python3 bench/summarize.py prints them).
set -u
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
L=${OUT:-gpu_logs/core}; mkdir -p "$L"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$L/gpu.txt"
run() {  # run NAME ARGS...: ./train ARGS --log NAME.jsonl, its output to NAME.log
  local name=$1; shift; echo "--- $name: ./train $*"
  timeout 300 ./train "$@" --log "$L/$name.jsonl" > "$L/$name.log" 2>&1; echo "exit $?"
  grep -E "^step|out of memory|error" "$L/$name.log" | tail -n 3
}
for part in ${PARTS:-8k 256k 64k}; do case $part in
  8k)   run train_3b_8k --config llama3.2-3b --seq-len 8K --steps 30 --lr 3e-4 --task copy ;;
  256k) run train_small_256k --config small --seq-len 256K --steps 2 ;;
  64k)  run train_3b_64k --config llama3.2-3b --seq-len 64K --steps 3 --ckpt --task random
        run train_3b_64k_fast --config llama3.2-3b --seq-len 64K --steps 3 --ckpt --task random --attention fast ;;
  *)    echo "core_runs.sh: unknown part '$part' (8k 256k 64k)" >&2; exit 2 ;;
esac; done
python3 bench/summarize.py $(for f in "$L"/*.jsonl; do echo "$(basename "$f" .jsonl)=$f"; done) | tee "$L/table.md"
