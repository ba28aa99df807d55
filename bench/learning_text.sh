#!/usr/bin/env bash
# bench/learning_text.sh - a byte-level model learning to use a long context on real text: the
# Linux kernel's source (make data), evaluated on held-out subsystems by position in the context,
# over several seeds (results/learning/linux/, notebooks/learning_text.ipynb).
#
# The mini-bytes model (D 512, 4 layers, 4 query / 2 KV heads of 128, vocabulary 384) trains at
# 16K tokens (4 windows a step, about 200 M tokens), then continues at 64K from that checkpoint.
# Each seed runs the whole recipe: the seed draws the initial weights and the windows, at 16K and
# at 64K. The first seed continues at 64K under each stage one GPU runs, 0, 3 (--ckpt), 4 (--ckpt
# --offload), 5 and 6 (the stages agree); the others under stage 0. Every run evaluates on
# data/linux/heldout.tok (other directories of the kernel than the training file's): the mean loss
# over fixed windows of the run's length (512 of 16K, 256 of 64K), and by position in the window.
# The 16K checkpoint is also evaluated at 64K before the continued training (--eval-only), and
# the 64K model on data/linux/other.tok: Python's standard library, text from a source the corpus
# never drew on.
#   OUT       logs, a folder per seed (default gpu_logs/learning_text)
#   DATA      the token files (default data/linux: make data)
#   SEEDS     the seeds (default "1 2 3 4 5"); PARALLEL of them at a time on the GPU (default 1)
#   STAGES    the first seed's 64K runs (default "0 3 4 5 6")
#   LR        the 16K learning rate (default 1e-3); PRE_STEPS its steps (default 3000);
#   STEPS_64K steps at 64K (default 250)
# On one H100 a seed took 204 s alone (16K, its two reads, 64K at stage 0); the first seed's four
# more stages add about 4 minutes (their H200 step times): the default run is about 20 minutes.
set -u
export NCCL_NVLS_ENABLE=0
L=${OUT:-gpu_logs/learning_text}; D=${DATA:-data/linux}; mkdir -p "$L"
SEEDS=${SEEDS:-1 2 3 4 5}; PARALLEL=${PARALLEL:-1}; STAGES=${STAGES:-0 3 4 5 6}
LR=${LR:-1e-3}; PRE_STEPS=${PRE_STEPS:-3000}; STEPS_64K=${STEPS_64K:-250}
heldout="--eval-data $D/heldout.tok"

one_seed() {  # seed, stages at 64K
  local seed=$1 stages=$2 d=$L/seed$1 k flags
  mkdir -p "$d"
  ./train --config mini-bytes --data "$D/train.tok" --seq-len 16K --batch 4 --steps "$PRE_STEPS" --lr "$LR" --warmup 50 \
    --seed "$seed" $heldout --eval-windows 512 --eval-every 500 --save-to "$d/ck16k" --save-dtype fp32 \
    --log "$d/pre16k.jsonl" > "$d/pre16k.log" 2>&1 || { echo "seed $seed: 16K run failed"; return 1; }
  ./train --config mini-bytes --seq-len 64K --init-from "$d/ck16k" $heldout --eval-windows 256 --eval-only \
    --log "$d/ck16k_at_64k.jsonl" > "$d/ck16k_at_64k.log" 2>&1
  for k in $stages; do
    case $k in 0) flags="--save-to $d/ck64k --save-dtype fp32" ;; 3) flags="--ckpt" ;; 4) flags="--ckpt --offload" ;;
      *) flags="--stage $k" ;; esac
    ./train --config mini-bytes --data "$D/train.tok" --seq-len 64K --steps "$STEPS_64K" --lr 5e-4 --warmup 10 \
      --seed "$seed" --init-from "$d/ck16k" $heldout --eval-windows 256 $flags --log "$d/64k_stage$k.jsonl" \
      > "$d/64k_stage$k.log" 2>&1
  done
  ./train --config mini-bytes --seq-len 64K --init-from "$d/ck64k" --eval-data "$D/other.tok" --eval-windows 256 \
    --eval-only --log "$d/other_at_64k.jsonl" > "$d/other_at_64k.log" 2>&1
  echo "seed $seed: $(grep '^eval' "$d/pre16k.log" | tail -n 1 | cut -c1-60) | 64K: $(grep '^eval' "$d/64k_stage0.log" |
    tail -n 1 | cut -c1-60) | other: $(grep '^eval' "$d/other_at_64k.log" | tail -n 1 | cut -c1-60)"
}

source "$(dirname "$0")/seeds.sh"
run_seeds
python3 bench/learning_seeds.py "$L"
