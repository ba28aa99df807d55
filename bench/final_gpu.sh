#!/usr/bin/env bash
# bench/final_gpu.sh - the ladder again (confirmation wording), attention TFLOP/s of our kernels
# and PyTorch SDPA for both shapes at 8K-128K, and Llama 3.2 3B at 64K on one GPU (issue 9's
# "before" MFU). Logs to $OUT.
set -u
FINAL=${OUT:-gpu_logs}; mkdir -p "$FINAL"
OUT=$(mktemp -d)
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
(CUDA_VISIBLE_DEVICES=1 timeout 120 make ladder > "$OUT/ladder.log" 2>&1; echo "ladder exit $?" >> "$OUT/ladder.log") &
CUDA_VISIBLE_DEVICES=0 timeout 150 build/bench_attention --seqs 8K,16K,64K,128K --reps 5 --json "$OUT/bench.jsonl" > "$OUT/bench.log" 2>&1; echo "bench exit $?"; cat "$OUT/bench.log"
CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1 timeout 120 python3 bench/attention_vs_torch.py --seqs 8192,16384,65536,131072 --reps 5 --json "$OUT/torch.jsonl" 2>&1 | grep -v Warning | tee "$OUT/torch.log"
wait  # the ladder's children measure the whole GPU: nothing else runs on it meanwhile
CUDA_VISIBLE_DEVICES=1 timeout 150 ./train --config llama3.2-3b --seq-len 64K --steps 3 --ckpt --task random --log "$OUT/train3b_64k.jsonl" > "$OUT/train3b_64k.log" 2>&1; echo "3b 64k exit $?" >> "$OUT/train3b_64k.log"
 cat "$OUT/ladder.log" | grep -E "^[0-9]|exit|measured"; grep -E "^step|exit" "$OUT/train3b_64k.log"
cp results/ladder_*.jsonl "$OUT"/
(cd "$OUT" && tar czf "$FINAL/logs.tar.gz" .); true
