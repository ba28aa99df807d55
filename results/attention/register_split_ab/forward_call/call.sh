#!/usr/bin/env bash
# Forward register split: producer/consumer 40/232 (main), 24/240, 56/224, 64/216 at 3B 128K causal
# in the order 40 56 24 64 64 24 56 40; then 8B-U8 1M causal 40, 56; then a stage-6 8B 1M step ABBA.
set -u; export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p /tmp/rb && tar xJf .gpu/regs_fwd.tar.xz -C /tmp/rb
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $OUT/summary.txt
mkdir -p /tmp/ab
i=0
for v in 40 56 24 64 64 24 56 40; do i=$((i+1))
  /tmp/rb/bench_attention_$v --shapes 3B --seqs 128K --json /tmp/ab/${i}_$v.jsonl > /tmp/ab/${i}_$v.txt 2>&1
  echo "${i}_$v: $(tail -2 /tmp/ab/${i}_$v.txt | tr '\n' ' ' | cut -c1-300)" | tee -a $OUT/summary.txt
done
for v in 40 56; do
  /tmp/rb/bench_attention_$v --shapes 8B-U8 --seqs 1M --no-check --reps 5 --warmup 1 --json /tmp/ab/1m_$v.jsonl > /tmp/ab/1m_$v.txt 2>&1
  echo "1m_$v: $(tail -2 /tmp/ab/1m_$v.txt | tr '\n' ' ' | cut -c1-300)" | tee -a $OUT/summary.txt
done
A=/tmp/rb/train_40 B=/tmp/rb/train_56 OUT=/tmp/ab/step ARGS="--config llama3.1-8b --seq-len 1M --sim-world 8 --stage 6 --mem-cap-gib 80 --layers 1 --steps 2 --task random" \
  timeout 300 bash bench/step_ab.sh 2>&1 | tee -a $OUT/summary.txt
cd /tmp/ab && tar czf $OUT/ab.tgz *
