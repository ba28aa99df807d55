#!/usr/bin/env bash
# bench/learning_text.sh - a byte-level model learning to use a long context on real text: the
# Linux kernel's source (make data), evaluated on held-out subsystems by position in the context
# (results/learning/linux/, notebooks/learning_text.ipynb).
#
# The mini-bytes model (D 512, 4 layers, 4 query / 2 KV heads of 128, vocabulary 384) trains at
# 16K tokens (4 windows a step, about 200 M tokens), then continues at 64K from that checkpoint,
# with the same seed, under each stage one GPU runs: 0, 3 (--ckpt), 4 (--ckpt --offload), 5 and 6.
# Every run evaluates on data/linux/heldout.tok (other directories of the kernel than the training
# file's): the mean loss over fixed windows of the run's length (512 of 16K, 256 of 64K: 8 M and
# 16 M tokens, enough that the text at each position averages out), and by position in the window.
# The 16K checkpoint is also evaluated at 64K before the continued training (--eval-only).
#   OUT       logs (default gpu_logs/learning_text)
#   DATA      the token files (default data/linux: make data)
#   STAGES    which 64K runs (default "0 3 4 5 6")
#   PRE_STEPS steps at 16K (default 3000); STEPS_64K steps at 64K (default 250)
set -u
export NCCL_NVLS_ENABLE=0
L=${OUT:-gpu_logs/learning_text}; D=${DATA:-data/linux}; mkdir -p "$L"
STAGES=${STAGES:-0 3 4 5 6}; PRE_STEPS=${PRE_STEPS:-3000}; STEPS_64K=${STEPS_64K:-250}
heldout="--eval-data $D/heldout.tok"
./train --config mini-bytes --data "$D/train.tok" --seq-len 16K --batch 4 --steps "$PRE_STEPS" --lr 2e-3 --warmup 50 \
  --seed 1 $heldout --eval-windows 512 --eval-every 500 --save-to "$L/ck16k" --save-dtype fp32 \
  --log "$L/pre16k.jsonl" > "$L/pre16k.log" 2>&1 || exit 1
grep '^eval' "$L/pre16k.log" | tail -n 1
./train --config mini-bytes --seq-len 64K --init-from "$L/ck16k" $heldout --eval-windows 256 --eval-only \
  --log "$L/ck16k_at_64k.jsonl" > "$L/ck16k_at_64k.log" 2>&1 || exit 1
grep '^eval' "$L/ck16k_at_64k.log"
for k in $STAGES; do
  case $k in 0) flags="" ;; 3) flags="--ckpt" ;; 4) flags="--ckpt --offload" ;; *) flags="--stage $k" ;; esac
  ./train --config mini-bytes --data "$D/train.tok" --seq-len 64K --steps "$STEPS_64K" --lr 5e-4 --warmup 10 --seed 2 \
    --init-from "$L/ck16k" $heldout --eval-windows 256 $flags --log "$L/64k_stage$k.jsonl" > "$L/64k_stage$k.log" 2>&1
  echo "stage $k exit $?: $(grep '^step' "$L/64k_stage$k.log" | tail -n 1 | cut -c1-60)"
  grep '^eval' "$L/64k_stage$k.log" | tail -n 1
done
