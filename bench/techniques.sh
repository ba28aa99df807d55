#!/usr/bin/env bash
# bench/techniques.sh - the measurements of the checkpointing/offload and chunking issues:
#   A. Llama 3.2 3B, 4 layers, 128K tokens: plain, --ckpt, --ckpt=selective, --ckpt --offload,
#      --ckpt=selective --offload (peak memory, step time; event timeline of the offload run)
#   B. Llama 3.1 8B, 4 layers: plain vs --chunked at 32K; --ckpt --offload with and without
#      --chunked at 64K (step-time overhead of chunking); the longest context of each under an
#      80 GiB cap (plan), confirmed by allocating it (--steps 0)
set -u
FINAL=${OUT:-gpu_logs}; mkdir -p "$FINAL"
# Logs are written to a scratch folder and returned as one archive (the device returns 8 files).
OUT=$(mktemp -d)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
run() { local name=$1; shift; echo "--- $name: ./train $*"; timeout 300 ./train "$@" --log "$OUT/$name.jsonl" > "$OUT/$name.log" 2>&1; echo "exit $?"; grep -E "^step|out of memory|error" "$OUT/$name.log" | tail -n 3; }
S3="--config llama3.2-3b --layers 4 --seq-len 128K --steps 3 --task random"
if [ "${PART_A:-1}" = 1 ]; then
run a_plain $S3
run a_ckpt $S3 --ckpt
run a_selective $S3 --ckpt=selective
run a_offload $S3 --ckpt --offload --timeline "$OUT/a_offload_timeline.json"
run a_selective_offload $S3 --ckpt=selective --offload
python3 bench/summarize.py plain=$OUT/a_plain.jsonl ckpt=$OUT/a_ckpt.jsonl ckpt=selective=$OUT/a_selective.jsonl \
  "ckpt offload=$OUT/a_offload.jsonl" "ckpt=selective offload=$OUT/a_selective_offload.jsonl" | tee "$OUT/table_a.md"
fi
if [ "${PART_B:-1}" = 1 ]; then
S8="--config llama3.1-8b --layers 4 --task random"
run b_plain_32k $S8 --seq-len 32K --steps 3
run b_chunked_32k $S8 --seq-len 32K --steps 3 --chunked
run b_offload_64k $S8 --seq-len 64K --steps 3 --ckpt --offload
run b_offload_chunked_64k $S8 --seq-len 64K --steps 3 --ckpt --offload --chunked
python3 bench/summarize.py "plain 32K=$OUT/b_plain_32k.jsonl" "chunked 32K=$OUT/b_chunked_32k.jsonl" \
  "ckpt offload 64K=$OUT/b_offload_64k.jsonl" "ckpt offload chunked 64K=$OUT/b_offload_chunked_64k.jsonl" | tee "$OUT/table_b.md"
for flags in "" "--chunked" "--ckpt --offload" "--ckpt --offload --chunked"; do
  longest=$(./train $S8 --seq-len 1K $flags --plan --mem-cap-gib 80 | sed -n 's/^longest context.*: \([0-9]*\) tokens.*/\1/p')
  name="b_longest_$(echo "$flags" | tr -d ' -')"
  echo "--- longest under 80 GiB with [$flags]: $longest tokens (plan); allocating it:"
  timeout 200 ./train $S8 --seq-len "$longest" $flags --steps 0 --mem-cap-gib 80 > "$OUT/$name.log" 2>&1; echo "exit $?"
  grep -E "^  (total|host)|out of memory" "$OUT/$name.log"
  echo "    one more K tokens:"; timeout 60 ./train $S8 --seq-len $((longest + 1024)) $flags --steps 0 --mem-cap-gib 80 2>&1 | grep -E "out of memory|needs" | head -2
done
fi
(cd "$OUT" && tar czf "$FINAL/logs.tar.gz" . && cp *.md *.txt "$FINAL"/ 2>/dev/null); true
