#!/usr/bin/env bash
# One-GPU checks of the multi-GPU machinery: --sim-world runs (FakeComm, FSDP shards, Ulysses
# packing, KV-head replication) and compute-sanitizer on small ones.
set -u
FINAL=${OUT:-gpu_logs}; mkdir -p "$FINAL"; OUT=$(mktemp -d)
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
run() { echo "--- ./train $*"; timeout 300 ./train "$@" > "$OUT/run.log" 2>&1; echo "exit $?"; grep -E "^step|error|out of memory|^  (model|attention|other|comm|total)" "$OUT/run.log" | tail -n 8; }
run --sim-world 2 --config tiny --seq-len 256 --steps 2 --fsdp --ulysses
run --sim-world 4 --config tiny-untied --seq-len 512 --steps 2 --stage 5 --chunk-tokens 40
run --sim-world 8 --config llama3.1-8b --layers 2 --seq-len 256K --steps 2 --stage 5
SAN=/usr/local/cuda/bin/compute-sanitizer; command -v compute-sanitizer >/dev/null && SAN=compute-sanitizer
for args in "--sim-world 2 --config tiny --seq-len 256 --steps 1 --fsdp --ulysses" \
            "--sim-world 4 --config tiny-untied --seq-len 512 --steps 1 --stage 5 --chunk-tokens 40" \
            "--config tiny --seq-len 200 --batch 2 --steps 1 --fsdp --ckpt=selective --offload --chunked --chunk-tokens 48"; do
  echo "--- compute-sanitizer ./train $args"
  timeout 300 $SAN --tool memcheck --leak-check no ./train $args > "$OUT/san.log" 2>&1; echo "exit $?"
  grep -E "ERROR SUMMARY|Invalid|out of bounds" "$OUT/san.log" | head -5
done
(cd "$OUT" && tar czf "$FINAL/logs.tar.gz" .); true
