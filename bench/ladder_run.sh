#!/usr/bin/env bash
# bench/ladder_run.sh - one call on two H200s: make ladder with Llama 3.2 3B on GPU 0 and
# Llama 3.1 8B on GPU 1 (3M and 5M tokens, emulated rank 0 of 8 x 80 GiB), then the CLI suite
# (its measured-ladder test) and the two-GPU suite. Results and logs go to $OUT (or ./gpu_logs).
set -u
FINAL=${OUT:-gpu_logs}; mkdir -p "$FINAL"
OUT=$(mktemp -d)
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
start=$(date +%s)
(CUDA_VISIBLE_DEVICES=0 timeout ${LADDER_TIMEOUT:-300} make ladder LADDER_CONFIGS=llama3.2-3b > "$OUT/ladder_3b.log" 2>&1; echo "exit $? after $(( $(date +%s) - start )) s" >> "$OUT/ladder_3b.log") &
(CUDA_VISIBLE_DEVICES=1 timeout ${LADDER_TIMEOUT:-300} make ladder LADDER_CONFIGS=llama3.1-8b > "$OUT/ladder_8b.log" 2>&1; echo "exit $? after $(( $(date +%s) - start )) s" >> "$OUT/ladder_8b.log") &
wait
# Children a timeout left behind: this checkout's ./train only (the ladder's parent runs as
# ./train, its children by their resolved path), not every command line that mentions "train --".
pkill -f "^(\./|$PWD/|$(pwd -P)/)train( |$)"; cat "$OUT/ladder_3b.log" "$OUT/ladder_8b.log"
cp results/ladder_*.jsonl "$OUT"/ 2>/dev/null
(cd "$OUT" && tar czf "$FINAL/logs.tar.gz" .)
timeout 60 bash tests/run_tests.sh build/tests/test_cli > "$FINAL/tests_cli.log" 2>&1
echo "cli suite: exit $?"; grep -E "FAILED|Failure|passed,|Expected|actual" "$FINAL/tests_cli.log" | head
timeout 130 bash tests/run_tests.sh build/tests/test_multi_gpu > "$FINAL/tests_2gpu.log" 2>&1
echo "two-GPU suite: exit $?"; grep -E "FAILED|Failure|passed,|Expected|actual|untied" "$FINAL/tests_2gpu.log" | head -20
