#!/usr/bin/env bash
# bench/mem_traces.sh - memory over one step (--mem-trace) of Llama 3.2 3B, 8 layers, 64K tokens:
# plain, --ckpt, --ckpt --offload --chunked, as results/memory/mem_trace_*.jsonl, in $OUT (gpu_logs/mem_traces).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
L=${OUT:-gpu_logs/mem_traces}; mkdir -p "$L"
T="--config llama3.2-3b --layers 8 --seq-len 64K --steps 1 --task random"
for v in "plain:" "ckpt:--ckpt" "ckpt_offload_chunked:--ckpt --offload --chunked"; do
  name=${v%%:*}; flags=${v#*:}
  timeout 60 ./train $T $flags --mem-trace "$L/mem_trace_llama3.2-3b_64k_$name.jsonl" > "$L/trace_$name.log" 2>&1
  echo "trace $name: exit $?"; grep -E "^step" "$L/trace_$name.log" | tail -1
done
