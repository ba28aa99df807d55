#!/usr/bin/env bash
# bench/learning.sh - a model learning to use a long context, the same under every stage
# (results/learning/, notebooks/learning.ipynb), over seeds.
#
# The mini model learns --task induction (each scored token is found by looking up its
# predecessor's one occurrence in the sequence's first half) at 4K tokens (make run with --seed
# SEED), continues at 16K, then at 64K from the same checkpoint with seed SEED+1 under each stage
# one GPU runs: 0, 3 (--ckpt), 4 (--ckpt --offload), 5 and 6. The memory techniques change where
# bytes live, not what is learned: the curves agree (bit for bit up to stage 4; within rounding
# after). The first seed runs every stage in STAGES at 64K, the others stage 0.
#   OUT     logs, a folder per seed (default gpu_logs/learning)
#   SEEDS   the seeds (default "1 2 3"); PARALLEL of them at a time on the GPU (default 1)
#   PRE_STEPS  the 4K run's steps (default 1000); PRE_ARGS, MID_ARGS, LONG_ARGS more flags for
#           the 4K, 16K and 64K runs (e.g. PRE_ARGS='--doc-lengths 1K,4K': documents of other
#           lengths, so that the copy does not always stand half the sequence back); LR_CONT the
#           16K and 64K runs' learning rate (default 1e-4)
#   STAGES  the first seed's 64K runs (default "0 3 4 5 6"); on two GPUs NODE='--nproc 2' runs
#           stages 2 to 7 with Ulysses splitting the sequence, the first half (what is looked up)
#           on one GPU and the second half (what is scored) on the other
# The H200's step times add up to about 5 minutes for the first seed and 70 s for each other one.
set -u
export NCCL_NVLS_ENABLE=0
L=${OUT:-gpu_logs/learning}; mkdir -p "$L"
NODE=${NODE:-}; SEEDS=${SEEDS:-1 2 3}; STAGES=${STAGES:-0 3 4 5 6}; PARALLEL=${PARALLEL:-1}
PRE_STEPS=${PRE_STEPS:-1000}; PRE_ARGS=${PRE_ARGS:-}; MID_ARGS=${MID_ARGS:-}; LONG_ARGS=${LONG_ARGS:-}
LR_CONT=${LR_CONT:-1e-4}

one_seed() {  # seed, stages at 64K
  local seed=$1 stages=$2 d=$L/seed$1 k flags
  local cont="--config mini --task induction --lr $LR_CONT --warmup 20 --seed $((seed + 1))"
  mkdir -p "$d"
  ./train --config mini --task induction --seq-len 4K --batch 4 --steps "$PRE_STEPS" --lr 1e-3 --seed "$seed" $PRE_ARGS \
    --save-to "$d/ck4k" --save-dtype fp32 --log "$d/pre4k.jsonl" > "$d/pre4k.log" 2>&1 || return 1
  ./train $cont --seq-len 16K --steps 300 --init-from "$d/ck4k" --save-to "$d/ck16k" --save-dtype fp32 $MID_ARGS \
    --log "$d/pre16k.jsonl" > "$d/pre16k.log" 2>&1 || return 1
  for k in $stages; do
    case $k in 0) flags="" ;; 3) flags="--ckpt" ;; 4) flags="--ckpt --offload" ;; *) flags="--stage $k" ;; esac
    ./train $cont --seq-len 64K --steps 250 --init-from "$d/ck16k" $flags $NODE $LONG_ARGS \
      --log "$d/64k_stage$k.jsonl" > "$d/64k_stage$k.log" 2>&1
    echo "seed $seed stage $k exit $?: 4K $(grep '^step' "$d/pre4k.log" | tail -n 1 | cut -c1-32) | 64K $(grep '^step' "$d/64k_stage$k.log" | tail -n 1 | cut -c1-32)"
  done
}

source "$(dirname "$0")/seeds.sh"
run_seeds
