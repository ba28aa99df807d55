#!/usr/bin/env bash
# bench/multi_gpu.sh - memory per GPU and step time as FSDP and Ulysses divide them, on two GPUs
# (--nproc 2) and emulated (--sim-world 2, 8): results/multi_gpu/fsdp_ulysses_3b_64k.json. Logs and a markdown
# table (bench/summarize.py) go to $OUT (default gpu_logs/multi_gpu); run from the repository root.
set -u
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
L=${OUT:-gpu_logs/multi_gpu}; mkdir -p "$L"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
C="--config llama3.2-3b --layers 4 --seq-len 64K --steps 3 --task random"
run() {  # run NAME ARGS...: ./train ARGS --log NAME.jsonl, its output to NAME.log
  local name=$1; shift; echo "--- $name: ./train $*"
  timeout 200 ./train "$@" --log "$L/$name.jsonl" > "$L/$name.log" 2>&1; echo "exit $?"
  grep -E "^step +3|out of memory|error" "$L/$name.log" | tail -n 2
}
run one $C
run dp2 --nproc 2 $C
run fsdp2 --nproc 2 $C --fsdp
run ulysses2 --nproc 2 $C --ulysses
run both2 --nproc 2 $C --fsdp --ulysses
run sim2 --sim-world 2 $C --fsdp --ulysses
run sim8 --sim-world 8 $C --fsdp --ulysses
python3 bench/summarize.py "1 GPU=$L/one.jsonl" "2 GPUs, replicated (data parallel)=$L/dp2.jsonl" \
  "2 GPUs --fsdp=$L/fsdp2.jsonl" "2 GPUs --ulysses=$L/ulysses2.jsonl" "2 GPUs --fsdp --ulysses=$L/both2.jsonl" \
  "--sim-world 2 --fsdp --ulysses=$L/sim2.jsonl" "--sim-world 8 --fsdp --ulysses=$L/sim8.jsonl" | tee "$L/table.md"
