#!/usr/bin/env bash
# bench/throughput.sh - tokens/s per GPU at full depth for long contexts, from two layers run at
# the real length (make throughput). Logs, timelines and NAME.throughput.json go to $OUT
# (gpu_logs/throughput); results/throughput_h200.json collects them.
#
# For each model in CONFIGS (llama3.1-8b llama3.2-3b) and length in SEQS (3M 4M 5M), as rank 0 of
# 8 (--sim-world 8; on a node of 8 GPUs NODE_GPUS='--nproc 8'), under the 80 GiB cap, with the
# full stack and selective checkpointing within --host-mem-gib (FLAGS: --stage 6 --ckpt=selective):
#   1. the full-depth plan says how many layers keep their attention output (no rerun);
#   2. one step of 2 layers at the real length, with a host budget that keeps the first layer's
#      output off the host (and --device-keep-gib 0 off the device), so its backward reruns
#      attention, while the last layer's stays in its slot: the --timeline gives one layer of each
#      kind, forward and backward;
#   3. bench/throughput.py adds them up: the step less the two layers is what does not grow with
#      depth (embedding, head and loss, optimizer); full depth = that + each kind of layer times
#      how many the plan has. It also takes each layer apart (attention kernels, all-to-alls,
#      MLP, the rest), estimates the step on a node with NVLink all-to-alls, and what the step
#      would reach with the attention kernels at other rates.
set -u
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
L=${OUT:-gpu_logs/throughput}; mkdir -p "$L"
CONFIGS=${CONFIGS:-llama3.1-8b llama3.2-3b}; SEQS=${SEQS:-3M 4M 5M}
NODE_GPUS=${NODE_GPUS:---sim-world 8}; FLAGS=${FLAGS:---stage 6 --ckpt=selective}
for cfg in $CONFIGS; do for seq in $SEQS; do
  name=${cfg}_$seq
  base="--config $cfg --seq-len $seq $NODE_GPUS $FLAGS --mem-cap-gib 80 --task random"
  ./train $base --plan > "$L/$name.plan.txt" 2>&1
  # Two layers' block inputs (the full stack without =selective), and a little: no first layer's
  # attention output fits on the host.
  host=$(./train --config $cfg --seq-len $seq $NODE_GPUS --stage 6 --layers 2 --plan | awk '/^  host/ {print $2}')
  budget=$(python3 -c "print(${host:-0} + 0.01)")
  echo "--- $name: ./train $base --layers 2 --steps 1 --host-mem-gib $budget --device-keep-gib 0"
  # The GPUs' clocks and power every 10 s while it runs: the same kernel's speed differs between
  # GPUs at their power cap.
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,power.limit,temperature.gpu --format=csv \
    -l 10 > "$L/$name.gpu.csv" 2>&1 &
  smi=$!
  timeout ${RUN_TIMEOUT:-1800} ./train $base --layers 2 --steps 1 --host-mem-gib "$budget" --device-keep-gib 0 \
    --timeline "$L/$name.timeline.json" --log "$L/$name.jsonl" > "$L/$name.log" 2>&1
  echo "exit $?"; kill $smi 2>/dev/null; grep -E "^step|out of memory|error" "$L/$name.log" | tail -n 2
done; done
python3 bench/throughput.py --dir "$L" --commit "${TRAIN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" \
  $(for cfg in $CONFIGS; do for seq in $SEQS; do echo ${cfg}_$seq; done; done) | tee "$L/throughput.md"
