#!/usr/bin/env bash
# bench/verify_and_sweep.sh - one call on two H200s: the single-GPU test suites on GPU 0 while
# GPU 1 runs the Untied Ulysses sweep (bench/untied_sweep.sh), then the two-GPU suite on both.
set -u
FINAL=${OUT:-gpu_logs}; mkdir -p "$FINAL"
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
(CUDA_VISIBLE_DEVICES=1 OUT=$FINAL bash bench/untied_sweep.sh > "$FINAL/sweep.log" 2>&1) &
sweep=$!
CUDA_VISIBLE_DEVICES=0 timeout 420 bash tests/run_tests.sh build/tests/test_kernels build/tests/test_attention \
  build/tests/test_model build/tests/test_techniques build/tests/test_cli build/tests/test_files build/tests/test_hf \
  > "$FINAL/tests_1gpu.log" 2>&1
echo "single-GPU suites: exit $?"; grep -E "FAILED|Failure|passed,|Expected|Which is|rel" "$FINAL/tests_1gpu.log" | head -40
wait $sweep; cat "$FINAL/sweep.log"
timeout 240 bash tests/run_tests.sh build/tests/test_multi_gpu > "$FINAL/tests_2gpu.log" 2>&1
echo "two-GPU suite: exit $?"; grep -E "FAILED|Failure|passed,|Expected|Which is|rel" "$FINAL/tests_2gpu.log" | head -40
