#!/usr/bin/env bash
# bench/learning.sh - a model learning to use a long context, the same under every stage
# (results/learning/, notebooks/learning.ipynb).
#
# The mini model learns --task induction (each scored token is found by looking up its
# predecessor's one occurrence in the sequence's first half) at 4K tokens (make run), continues
# at 16K, then at 64K from the same checkpoint with the same seed under each stage one GPU runs:
# 0, 3 (--ckpt), 4 (--ckpt --offload), 5 and 6. The memory techniques change where bytes live,
# not what is learned: the curves agree (bit for bit up to stage 4; within rounding after).
#   OUT     logs (default gpu_logs/learning)
#   STAGES  which 64K runs (default "0 3 4 5 6"); on two GPUs NODE='--nproc 2' runs stages
#           2 to 7 with Ulysses splitting the sequence, the first half (what is looked up) on
#           one GPU and the second half (what is scored) on the other
set -u
export NCCL_NVLS_ENABLE=0
L=${OUT:-gpu_logs/learning}; mkdir -p "$L"
NODE=${NODE:-}; STAGES=${STAGES:-0 3 4 5 6}
cont="--config mini --task induction --lr 1e-4 --warmup 20 --seed 2"
./train --config mini --task induction --seq-len 4K --batch 4 --steps 1000 --lr 1e-3 --seed 1 \
  --save-to "$L/ck4k" --save-dtype fp32 --log "$L/pre4k.jsonl" > "$L/pre4k.log" 2>&1 || exit 1
./train $cont --seq-len 16K --steps 300 --init-from "$L/ck4k" --save-to "$L/ck16k" --save-dtype fp32 \
  --log "$L/pre16k.jsonl" > "$L/pre16k.log" 2>&1 || exit 1
for k in $STAGES; do
  case $k in 0) flags="" ;; 3) flags="--ckpt" ;; 4) flags="--ckpt --offload" ;; *) flags="--stage $k" ;; esac
  ./train $cont --seq-len 64K --steps 250 --init-from "$L/ck16k" $flags $NODE \
    --log "$L/64k_stage$k.jsonl" > "$L/64k_stage$k.log" 2>&1
  echo "stage $k exit $?: $(grep '^step' "$L/64k_stage$k.log" | tail -n 1 | cut -c1-40)"
done
