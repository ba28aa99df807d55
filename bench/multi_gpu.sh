#!/usr/bin/env bash
# bench/multi_gpu.sh - on a machine with two GPUs: the test suites (multi-GPU ones included), then
# memory per GPU as FSDP and Ulysses divide it, real (--nproc 2) and emulated (--sim-world 2, 8).
set -u
FINAL=${OUT:-gpu_logs}; mkdir -p "$FINAL"; OUT=$(mktemp -d)
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 420 bash tests/run_tests.sh ${TESTS:-build/tests/test_multi_gpu build/tests/test_techniques build/tests/test_model build/tests/test_cli} > "$OUT/tests.log" 2>&1
echo "tests exit $?"; grep -E "^\[ +(OK|FAILED|SKIPPED) +\]|rel error|driver view|Failure|actual|Which is|passed," "$OUT/tests.log" | grep -v "^  [a-z_0-9]* *layer" | head -60
if [ "${MEASURE:-1}" = 1 ]; then
C="--config llama3.2-3b --layers 4 --seq-len 64K --steps 3 --task random"
run() { local name=$1; shift; echo "--- $name: ./train $*"; timeout 200 ./train "$@" --log "$OUT/$name.jsonl" > "$OUT/$name.log" 2>&1; echo "exit $?"; grep -E "^step +3|out of memory|error" "$OUT/$name.log" | tail -n 2; }
run one $C
run dp2 --nproc 2 $C
run fsdp2 --nproc 2 $C --fsdp
run ulysses2 --nproc 2 $C --ulysses
run both2 --nproc 2 $C --fsdp --ulysses
run sim2 --sim-world 2 $C --fsdp --ulysses
run sim8 --sim-world 8 $C --fsdp --ulysses
python3 bench/summarize.py "1 GPU=$OUT/one.jsonl" "2 GPUs, replicated (data parallel)=$OUT/dp2.jsonl" \
  "2 GPUs --fsdp=$OUT/fsdp2.jsonl" "2 GPUs --ulysses=$OUT/ulysses2.jsonl" "2 GPUs --fsdp --ulysses=$OUT/both2.jsonl" \
  "--sim-world 2 --fsdp --ulysses=$OUT/sim2.jsonl" "--sim-world 8 --fsdp --ulysses=$OUT/sim8.jsonl" | tee "$OUT/table.md"
fi
(cd "$OUT" && tar czf "$FINAL/logs.tar.gz" . && cp table.md "$FINAL"/ 2>/dev/null); true
