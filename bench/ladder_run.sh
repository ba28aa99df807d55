#!/usr/bin/env bash
# bench/ladder_run.sh - one call on two H200s: the two-GPU suite, then in parallel
#   GPU 1: make ladder (both models, 3M and 5M, emulated rank 0 of 8 x 80 GiB)
#   GPU 0: the single-GPU suites, and memory traces of one step (Llama 3.2 3B, 8 layers, 64K):
#          plain, --ckpt, --ckpt --offload --chunked
# Results (ladder JSON, traces) and logs go to $OUT (or ./gpu_logs).
set -u
FINAL=${OUT:-gpu_logs}; mkdir -p "$FINAL"
OUT=$(mktemp -d)
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2
timeout 200 bash tests/run_tests.sh build/tests/test_multi_gpu > "$OUT/tests_2gpu.log" 2>&1
echo "two-GPU suite: exit $?"; grep -E "FAILED|Failure|passed,|Expected|actual" "$OUT/tests_2gpu.log" | head -20
(CUDA_VISIBLE_DEVICES=1 timeout ${LADDER_TIMEOUT:-420} make ladder > "$OUT/ladder.log" 2>&1; echo "make ladder: exit $?" >> "$OUT/ladder.log") &
ladder=$!
CUDA_VISIBLE_DEVICES=0 timeout 300 bash tests/run_tests.sh build/tests/test_kernels build/tests/test_attention \
  build/tests/test_model build/tests/test_techniques build/tests/test_cli build/tests/test_files build/tests/test_hf \
  > "$OUT/tests_1gpu.log" 2>&1
echo "single-GPU suites: exit $?"; grep -E "FAILED|Failure|passed,|Expected|actual|untied" "$OUT/tests_1gpu.log" | head -30
T="--config llama3.2-3b --layers 8 --seq-len 64K --steps 2 --task random"
for v in "plain:" "ckpt:--ckpt" "ckpt_offload_chunked:--ckpt --offload --chunked"; do
  name=${v%%:*}; flags=${v#*:}
  CUDA_VISIBLE_DEVICES=0 timeout 120 ./train $T $flags --mem-trace "$OUT/mem_trace_llama3.2-3b_64k_$name.jsonl" > "$OUT/trace_$name.log" 2>&1
  echo "trace $name: exit $?"; grep -E "^step" "$OUT/trace_$name.log" | tail -1
done
wait $ladder; cat "$OUT/ladder.log"
cp results/ladder_*.jsonl "$OUT"/ 2>/dev/null
(cd "$OUT" && tar czf "$FINAL/logs.tar.gz" .); true
