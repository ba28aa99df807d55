#!/usr/bin/env bash
# bench/techniques.sh - activation checkpointing, CPU offload and chunking on one GPU: memory and
# step time, results/steps/techniques_h200.json. Logs and markdown tables go to $OUT (default
# gpu_logs/techniques); run from the repository root. PART_A=0 or PART_B=0 skips a part.
#   A. Llama 3.2 3B, 4 layers, 128K tokens: plain, --ckpt, --ckpt=selective, --ckpt --offload
#      (with its event timeline), --ckpt=selective --offload
#   B. Llama 3.1 8B, 4 layers: plain and --chunked at 32K; --ckpt --offload with and without
#      --chunked at 64K; the longest context of each under an 80 GiB cap (plan), allocated
#      (--steps 0), and 1K more tried
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
L=${OUT:-gpu_logs/techniques}; mkdir -p "$L"
run() { local name=$1; shift; echo "--- $name: ./train $*"; timeout 300 ./train "$@" --log "$L/$name.jsonl" > "$L/$name.log" 2>&1; echo "exit $?"; grep -E "^step|out of memory|error" "$L/$name.log" | tail -n 3; }
S3="--config llama3.2-3b --layers 4 --seq-len 128K --steps 3 --task random"
if [ "${PART_A:-1}" = 1 ]; then
run a_plain $S3
run a_ckpt $S3 --ckpt
run a_selective $S3 --ckpt=selective
run a_offload $S3 --ckpt --offload --timeline "$L/a_offload_timeline.json"
run a_selective_offload $S3 --ckpt=selective --offload
python3 bench/summarize.py "plain=$L/a_plain.jsonl" "ckpt=$L/a_ckpt.jsonl" "ckpt=selective=$L/a_selective.jsonl" \
  "ckpt offload=$L/a_offload.jsonl" "ckpt=selective offload=$L/a_selective_offload.jsonl" | tee "$L/table_a.md"
fi
if [ "${PART_B:-1}" = 1 ]; then
S8="--config llama3.1-8b --layers 4 --task random"
run b_plain_32k $S8 --seq-len 32K --steps 3
run b_chunked_32k $S8 --seq-len 32K --steps 3 --chunked
run b_offload_64k $S8 --seq-len 64K --steps 3 --ckpt --offload
run b_offload_chunked_64k $S8 --seq-len 64K --steps 3 --ckpt --offload --chunked
python3 bench/summarize.py "plain 32K=$L/b_plain_32k.jsonl" "chunked 32K=$L/b_chunked_32k.jsonl" \
  "ckpt offload 64K=$L/b_offload_64k.jsonl" "ckpt offload chunked 64K=$L/b_offload_chunked_64k.jsonl" | tee "$L/table_b.md"
for flags in "" "--chunked" "--ckpt --offload" "--ckpt --offload --chunked"; do
  longest=$(./train $S8 --seq-len 1K $flags --plan --mem-cap-gib 80 | sed -n 's/^longest context.*: \([0-9]*\) tokens.*/\1/p')
  name="b_longest_$(echo "$flags" | tr -d ' -')"
  echo "--- longest under 80 GiB with [$flags]: $longest tokens (plan); allocating it:"
  timeout 200 ./train $S8 --seq-len "$longest" $flags --steps 0 --mem-cap-gib 80 > "$L/$name.log" 2>&1; echo "exit $?"
  grep -E "^  (total|host)|out of memory" "$L/$name.log"
  echo "    one more K tokens:"; timeout 60 ./train $S8 --seq-len $((longest + 1024)) $flags --steps 0 --mem-cap-gib 80 2>&1 | grep -E "out of memory|needs" | head -2
done
fi
