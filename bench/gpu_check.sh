#!/usr/bin/env bash
# bench/gpu_check.sh - one GPU session's checks in one go (what the README's figures come from):
# the GPU test suites, a Llama 3.2 3B training run at 8K tokens, attention TFLOP/s, and PyTorch
# SDPA on the same shapes. Logs go to $OUT (or ./gpu_logs).
set -u
FINAL=${OUT:-gpu_logs}; mkdir -p "$FINAL"
# Logs are written to a scratch folder and returned as one archive (the device returns 8 files).
OUT=$(mktemp -d)
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"
step() { echo; echo "##### $*"; }
step tests
timeout 400 bash tests/run_tests.sh ${TESTS:-build/tests/test_kernels build/tests/test_attention build/tests/test_model build/tests/test_cli} > "$OUT/tests.log" 2>&1
echo "exit $?"; grep -E "FAILED|Failure|rel error|passed,|stopped at|^  step|Expected|Which is|actual|seed" "$OUT/tests.log" | head -80
if [ "${TRAIN:-1}" = 1 ]; then
  step "make run's job: llama3.2-3b 8K, 30 steps"
  timeout 300 ./train --config llama3.2-3b --seq-len 8K --steps 30 --lr 3e-4 --task copy --log "$OUT/train3b.jsonl" > "$OUT/train3b.log" 2>&1
  echo "exit $?"; tail -n 34 "$OUT/train3b.log"
  step "a long step with per-layer progress: small model, 256K tokens"
  timeout 300 ./train --config small --seq-len 256K --steps 2 --log "$OUT/small256k.jsonl" > "$OUT/small256k.log" 2>&1
  echo "exit $?"; tail -n 12 "$OUT/small256k.log" | tr '\r' '\n' | tail -n 14
fi
if [ "${BENCH:-1}" = 1 ]; then
  step "attention bench"
  timeout 200 build/bench_attention --seqs ${SEQS:-16K,64K} --reps 5 --json "$OUT/bench.jsonl" 2>&1 | tee "$OUT/bench.log"
  step "pytorch sdpa"
  PYTHONUNBUFFERED=1 timeout 200 python3 bench/attention_vs_torch.py --seqs ${TORCH_SEQS:-16384,65536} --reps 5 --json "$OUT/torch.jsonl" 2>&1 | grep -v Warning | tee "$OUT/torch.log"
fi
(cd "$OUT" && tar czf "$FINAL/logs.tar.gz" . && cp *.md *.txt "$FINAL"/ 2>/dev/null); true
