#!/usr/bin/env bash
# bench/step_ab.sh - two builds of ./train on one GPU, back to back in the order A B B A: what a
# change does to a training step, apart from the spread between GPUs (docs/history.md). Each
# run's step time and its attention kernels' time (every attention forward, reruns included, and
# every backward) come from --log and --timeline.
#
#   A=build/train_old B=./train bash bench/step_ab.sh
#   ARGS   the run (default: Llama 3.1 8B, one layer at 1M tokens, rank 0 of 8, the full stack
#          with selective checkpointing)
#   OUT    logs (default gpu_logs/step_ab)
set -u
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
A=${A:?A=path of the first ./train}; B=${B:-./train}
ARGS=${ARGS:---config llama3.1-8b --seq-len 1M --sim-world 8 --stage 7 --ckpt=selective --mem-cap-gib 80 --layers 1 --steps 2 --task random}
L=${OUT:-gpu_logs/step_ab}; mkdir -p "$L"
i=0
rm -f "$L"/[1-4][AB].*
for which in A B B A; do
  i=$((i + 1)); bin=${!which}; name=$i$which
  "$bin" $ARGS --log "$L/$name.jsonl" --timeline "$L/$name.timeline.json" > "$L/$name.log" 2>&1
  echo "$name exit $?"
done
python3 - "$L" <<'EOF'
import json, os, sys
d = sys.argv[1]
print("| run | step s | attention forward s | attention backward s |")
print("|---|---|---|---|")
for name in ("1A", "2B", "3B", "4A"):  # this run's, not older files in the folder
    try:
        step = [json.loads(l) for l in open(os.path.join(d, name + ".jsonl")) if '"type": "step"' in l][-1]["step_time_s"]
        marks = json.load(open(os.path.join(d, name + ".timeline.json")))
    except (OSError, ValueError, IndexError, KeyError) as e:
        print(f"| {name} | (no result: {e}) | | |")
        continue
    t = {w: sum(m["end_ms"] - m["start_ms"] for m in marks if m["what"] == w) / 1000 for w in ("attention forward", "attention backward")}
    print(f"| {name} | {step:.3f} | {t['attention forward']:.3f} | {t['attention backward']:.3f} |")
EOF
