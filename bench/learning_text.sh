#!/usr/bin/env bash
# bench/learning_text.sh - a byte-level model learning to use a long context on real text: the
# Linux kernel's source (make data), evaluated on held-out subsystems by position in the context
# (results/learning/linux/, notebooks/learning.ipynb).
#
# The mini-bytes model (D 512, 4 layers, 4 query / 2 KV heads of 128, vocabulary 384) trains at
# 4K tokens (16 windows a step), then continues at 64K from that checkpoint, with the same seed,
# under each stage one GPU runs: 0, 3 (--ckpt), 4 (--ckpt --offload), 5 and 6. Every run
# evaluates on data/linux/heldout.tok (other directories of the kernel than the training file's):
# the mean loss over 96 fixed windows of the run's length (6M tokens at 64K), and by position in
# the window: so many that the text at each position averages out. The 4K
# checkpoint is also evaluated at 64K before the continued training (--eval-only).
#   OUT     logs (default gpu_logs/learning_text)
#   DATA    the token files (default data/linux: make data)
#   STAGES  which 64K runs (default "0 3 4 5 6")
set -u
export NCCL_NVLS_ENABLE=0
L=${OUT:-gpu_logs/learning_text}; D=${DATA:-data/linux}; mkdir -p "$L"
STAGES=${STAGES:-0 3 4 5 6}
eval_args="--eval-data $D/heldout.tok --eval-windows 96"
./train --config mini-bytes --data "$D/train.tok" --seq-len 4K --batch 16 --steps 600 --lr 2e-3 --warmup 30 \
  --seed 1 $eval_args --eval-every 200 --save-to "$L/ck4k" --save-dtype fp32 --log "$L/pre4k.jsonl" > "$L/pre4k.log" 2>&1 || exit 1
grep '^eval' "$L/pre4k.log" | tail -n 1
./train --config mini-bytes --seq-len 64K --init-from "$L/ck4k" $eval_args --eval-only \
  --log "$L/ck4k_at_64k.jsonl" > "$L/ck4k_at_64k.log" 2>&1 || exit 1
grep '^eval' "$L/ck4k_at_64k.log"
for k in $STAGES; do
  case $k in 0) flags="" ;; 3) flags="--ckpt" ;; 4) flags="--ckpt --offload" ;; *) flags="--stage $k" ;; esac
  ./train --config mini-bytes --data "$D/train.tok" --seq-len 64K --steps 250 --lr 5e-4 --warmup 10 --seed 2 \
    --init-from "$L/ck4k" $eval_args --eval-every 125 $flags --log "$L/64k_stage$k.jsonl" > "$L/64k_stage$k.log" 2>&1
  echo "stage $k exit $?: $(grep '^step' "$L/64k_stage$k.log" | tail -n 1 | cut -c1-60)"
  grep '^eval' "$L/64k_stage$k.log" | tail -n 1
done
