#!/bin/bash
# bench/attention_gpu.sh - one device call for issue 9: attention tests (both kernel sets), the
# model tests, the per-kernel Hopper bench, the attention bench with PyTorch side by side, and
# the Llama 3.2 3B 64K step (default --attention auto, and the lean backward), one unchecked
# 1M-token run of the bench (PARTS=long), the 1M-token correctness test of all three kernel sets
# (PARTS=longtest);
# on two GPUs the multi-GPU tests (PARTS=multi); both benches timing all the
# forwards, then all the backwards, instead of alternating (PARTS=separate). Logs under $OUT
# (tarred). PARTS, HSEQS, SEQS, TSEQS, BENCH_ARGS (e.g. --reference, --shapes 3B-U8,8B-U8) and
# TORCH_ARGS (e.g. --shapes 3B-U8,8B-U8) select what runs.
set -u
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
L=$OUT/logs; mkdir -p $L
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $L/gpu.txt
run() { local name=$1; shift; echo "== $name: $*"; local t0=$(date +%s); stdbuf -oL -eL timeout ${T:-300} "$@" > $L/$name.log 2>&1; echo "rc=$? seconds=$(( $(date +%s) - t0 ))" >> $L/$name.log; tail -3 $L/$name.log; }
for part in ${PARTS:-tests hopper bench torch mfu}; do case $part in
  tests)  T=240 run test_attention build/tests/test_attention
          T=200 run test_model build/tests/test_model
          T=200 run test_techniques build/tests/test_techniques ;;
  hopper) T=120 run bench_hopper build/bench_attention_hopper --bench --seqs ${HSEQS:-16K} ;;
  bench)  T=300 run bench_attention build/bench_attention ${BENCH_ARGS:-} --seqs ${SEQS:-8K,16K,64K,128K} --json $L/attention.jsonl ;;
  multi)  T=300 run test_multi_gpu build/tests/test_multi_gpu ;;
  torch)  T=200 run torch python3 bench/attention_vs_torch.py ${TORCH_ARGS:-} --seqs ${TSEQS:-8192,16384,65536,131072} --json $L/torch.jsonl ;;
  separate) T=200 run bench_separate build/bench_attention --separate --no-check --seqs ${SEQS:-8K,16K,64K,128K} --json $L/attention_separate.jsonl
          T=200 run torch_separate python3 bench/attention_vs_torch.py --separate --seqs ${TSEQS:-8192,16384,65536,131072} --json $L/torch_separate.jsonl ;;
  mfu)    T=200 run mfu_3b_64k ./train --config llama3.2-3b --seq-len 64K --steps 3 --ckpt --task random --log $L/mfu_3b_64k.jsonl
          T=200 run mfu_3b_64k_lean ./train --config llama3.2-3b --seq-len 64K --steps 3 --ckpt --task random --attention fast --log $L/mfu_3b_64k_lean.jsonl ;;
  longtest) T=400 run test_attention_long env TEST_ATTENTION_LONG_TOKENS=${LONG_TOKENS:-1048653} build/tests/test_attention --gtest_filter='Kernels/AttentionLong.*' ;;
  long)   T=400 run bench_1m build/bench_attention --seqs ${LSEQS:-1M} --shapes ${LSHAPES:-3B,8B} --reps 1 --warmup 0 --no-check --json $L/attention_1m.jsonl ;;
esac; done
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $L
