#!/usr/bin/env bash
# bench/throughput.sh - tokens/s per GPU at full depth for long contexts, from a few layers run at
# the real length (make throughput). Logs, traces and NAME.throughput.json go to $OUT
# (gpu_logs/throughput); results/throughput/throughput_h200.json collects them.
#
# For each model in CONFIGS (llama3.1-8b llama3.2-3b) and length in SEQS (3M 4M 5M), as rank 0 of
# 8 (--sim-world 8; on a node of 8 GPUs NODE_GPUS='--nproc 8'), under the 80 GiB cap, with the
# full stack, our savings and selective checkpointing within --host-mem-gib (FLAGS: --stage 7 --ckpt=selective):
#   1. the full-depth plan says what each layer does with its attention output (kept on the host,
#      on the device, in the last layer's slot, or rerun) and which block inputs are rebuilt;
#   2. one step of a few layers at the real length, one layer of each kind the full depth has
#      (bench/throughput.py --run-shape: host, rebuilt, rerun, then the last, in its slot), with a
#      host budget for just their block inputs and attention outputs, --rebuild-inputs 1 only if
#      the shape has a rebuilt layer, and --device-keep-gib 0:
#      8B at 3M and 4M run 2 layers (host, slot), at 5M 3 (host, rebuilt, slot); with
#      FLAGS='--stage 6' (plain --ckpt, every layer reruns its attention) 2 rerun layers;
#      RUN_REBUILT=0 leaves the rebuilt layer out, estimated as the host layer plus its MLP forward
#      and one attention output fetched (8B at 5M in 2 layers, for a GPU lent 10 minutes a call);
#   3. bench/throughput.py adds them up: the step less its layers is what does not grow with depth
#      (embedding, head and loss, optimizer); full depth = that + each kind of layer times how
#      many the plan has. It also takes each layer apart (attention kernels, all-to-alls, MLP,
#      the rest), estimates the step on a node with NVLink all-to-alls, and what the step would
#      reach with the attention kernels at other rates.
set -u
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
L=${OUT:-gpu_logs/throughput}; mkdir -p "$L"
CONFIGS=${CONFIGS:-llama3.1-8b llama3.2-3b}; SEQS=${SEQS:-3M 4M 5M}
NODE_GPUS=${NODE_GPUS:---sim-world 8}; FLAGS=${FLAGS:---stage 7 --ckpt=selective}
# TASK: the data (default --task random: causal attention over the whole sequence); packed
# documents, e.g. TASK='--task copy --doc-lengths 64K,64K --doc-mask'.
TASK=${TASK:---task random}
for cfg in $CONFIGS; do for seq in $SEQS; do
  name=${cfg}_$seq
  base="--config $cfg --seq-len $seq $NODE_GPUS $FLAGS --mem-cap-gib 80 $TASK"
  ./train $base --plan > "$L/$name.plan.txt" 2>&1
  read -r layers inputs outputs kinds <<< "$(python3 bench/throughput.py --run-shape "$L/$name.plan.txt" \
    $([ "${RUN_REBUILT:-1}" = 0 ] && echo --no-rebuilt))"
  [ -n "$kinds" ] || { echo "--- $name: no plan to run (see $L/$name.plan.txt)"; continue; }
  if grep -qE '^(host|cap) .*: OOM$' "$L/$name.plan.txt"; then
    echo "--- $name: the full-depth plan does not fit (see $L/$name.plan.txt): no run"; continue
  fi
  # One block input and one attention output (with its lse) on the host, in GiB: two layers'
  # plans, without and with selective checkpointing (whose last layer keeps its output in its slot).
  two_inputs=$(./train --config $cfg --seq-len $seq $NODE_GPUS --stage 7 --layers 2 --plan | awk '/^  host/ {print $2}')
  with_output=$(./train $base --layers 2 --host-mem-gib 100000 --rebuild-inputs 0 --plan | awk '/^  host/ {print $2}')
  budget=$(python3 -c "i = ${two_inputs:-0} / 2; a = ${with_output:-0} - 2 * i; print($inputs * i + ($outputs + 0.05) * a)")
  # The budget and --rebuild-inputs give the run its kinds of layer together: with inputs rebuilt
  # by default, a budget for one attention output could rebuild layer 1's where the shape has a
  # rerun layer.
  rebuild=0; case ",$kinds," in *,rebuilt,*) rebuild=1;; esac
  run="--layers $layers --steps 1 --host-mem-gib $budget --rebuild-inputs $rebuild --device-keep-gib 0"
  echo "--- $name: layers $kinds: ./train $base $run"
  # The GPUs' clocks and power every 10 s while it runs: the same kernel's speed differs between
  # GPUs at their power cap. nvidia-smi stamps local time; NAME.clockref pairs it with Unix time,
  # the step record's end_unix_s, so throughput.py can place the samples in the step's phases.
  date '+%Y/%m/%d %H:%M:%S.%N %s.%N' > "$L/$name.clockref"
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,power.limit,temperature.gpu --format=csv \
    -l 10 > "$L/$name.gpu.csv" 2>&1 &
  smi=$!
  timeout ${RUN_TIMEOUT:-1800} ./train $base $run \
    --trace "$L/$name.trace.json" --log "$L/$name.jsonl" > "$L/$name.log" 2>&1
  echo "exit $?"; kill $smi 2>/dev/null; grep -E "^step|out of memory|error" "$L/$name.log" | tail -n 2
done; done
python3 bench/throughput.py --dir "$L" --commit "${TRAIN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" \
  $(for cfg in $CONFIGS; do for seq in $SEQS; do echo ${cfg}_$seq; done; done) | tee "$L/throughput.md"
