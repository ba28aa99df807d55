#!/usr/bin/env bash
# bench/ladder_run.sh - one call on two H200s:
#   GPU 1: make ladder (both models, 3M and 5M, emulated rank 0 of 8 x 80 GiB)
#   GPU 0: the single-GPU suites, then the Untied Ulysses sweep (bench/untied_sweep.sh)
#   then, on both: the two-GPU suite
# Results (ladder JSON, sweep) and logs go to $OUT (or ./gpu_logs).
set -u
FINAL=${OUT:-gpu_logs}; mkdir -p "$FINAL"
OUT=$(mktemp -d)
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
(CUDA_VISIBLE_DEVICES=1 timeout ${LADDER_TIMEOUT:-400} make ladder > "$OUT/ladder.log" 2>&1; echo "make ladder: exit $?" >> "$OUT/ladder.log") &
ladder=$!
CUDA_VISIBLE_DEVICES=0 timeout 150 bash tests/run_tests.sh build/tests/test_kernels build/tests/test_attention \
  build/tests/test_model build/tests/test_techniques build/tests/test_cli build/tests/test_files build/tests/test_hf \
  > "$OUT/tests_1gpu.log" 2>&1
echo "single-GPU suites: exit $?"; grep -E "FAILED|Failure|passed,|Expected|actual|untied" "$OUT/tests_1gpu.log" | head -30
CUDA_VISIBLE_DEVICES=0 STEPS_LARGER_K=1 OUT=$OUT bash bench/untied_sweep.sh > "$OUT/sweep.log" 2>&1; cat "$OUT/sweep.log" | grep -v "^\[stage\|^  "
wait $ladder; cat "$OUT/ladder.log"
cp results/ladder_*.jsonl "$OUT"/ 2>/dev/null
(cd "$OUT" && tar czf "$FINAL/logs.tar.gz" .)
timeout 100 bash tests/run_tests.sh build/tests/test_multi_gpu > "$FINAL/tests_2gpu.log" 2>&1
echo "two-GPU suite: exit $?"; grep -E "FAILED|Failure|passed,|Expected|actual|untied" "$FINAL/tests_2gpu.log" | head -20
