#!/usr/bin/env bash
# bench/traces_and_checks.sh - one short call on one H200: the attention and CLI suites, the
# memory traces of one step (Llama 3.2 3B, 8 layers, 64K: plain, --ckpt, --ckpt --offload
# --chunked), then the work-in-progress Hopper kernels (wip/, if built). Logs to $OUT.
set -u
FINAL=${OUT:-gpu_logs}; mkdir -p "$FINAL"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
timeout 180 bash tests/run_tests.sh build/tests/test_attention > "$FINAL/tests.log" 2>&1; echo "attention suite: exit $?"
timeout 90 bash tests/run_tests.sh build/tests/test_cli >> "$FINAL/tests.log" 2>&1; echo "cli suite: exit $?"
grep -E "FAILED|Failure|passed,|Expected|actual" "$FINAL/tests.log" | head -20
T="--config llama3.2-3b --layers 8 --seq-len 64K --steps 1 --task random"
for v in "plain:" "ckpt:--ckpt" "ckpt_offload_chunked:--ckpt --offload --chunked"; do
  name=${v%%:*}; flags=${v#*:}
  timeout 60 ./train $T $flags --mem-trace "$FINAL/mem_trace_llama3.2-3b_64k_$name.jsonl" > "$FINAL/trace_$name.log" 2>&1
  echo "trace $name: exit $?"; grep -E "^step" "$FINAL/trace_$name.log" | tail -1
done
[ -x wip/test_hopper ] && timeout 90 wip/test_hopper --bench 2>&1 | tee "$FINAL/hopper.log"
true
