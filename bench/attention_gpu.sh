#!/bin/bash
# bench/attention_gpu.sh - the attention benches behind results/attention/attention_h200.json, run from the
# repository root after make; each part's log and JSON lines go to $OUT (default gpu_logs/attention).
#
#   PARTS="bench torch" (the default) bash bench/attention_gpu.sh
#   bench     build/bench_attention (each shape checked against kernels/attention.cu first) -> attention.jsonl
#   torch     bench/attention_vs_torch.py, PyTorch SDPA flash and cuDNN on the same shapes -> torch.jsonl
#   separate  both, timing all the forwards, then all the backwards -> *_separate.jsonl
#   hopper    build/bench_attention_hopper --bench --seqs $HSEQS (16K): the backward's kernels apart
#   long      build/bench_attention --seqs $LSEQS (1M), one run, unchecked -> attention_1m.jsonl
#   longtest  test_attention's long case at $LONG_TOKENS (1048653) tokens, checked in float64
#   mfu       the Llama 3.2 3B 64K training step, auto and fast attention (bench/core_runs.sh's 64k)
#   documents packed documents ($DOCS, default the mix 4K,16K,1K,32K,8K,2K) in one call: ours and
#             FlexAttention at 3B 128K and 8B-U8 1M, our causal kernels at both, and one document
#             over the whole sequence (the causal work through the documents' kernels) -> docs_*.log
#             (results/attention/documents_same_call/ and docs/attention.md's "Packed documents")
# SEQS (8K,16K,64K,128K) and SHAPES (3B,8B; 3B-U8,8B-U8 for one of eight Ulysses ranks) apply to
# bench, torch and separate; BENCH_ARGS goes to build/bench_attention (e.g. --reference).
set -u
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
L=${OUT:-gpu_logs/attention}; mkdir -p "$L"
SEQS=${SEQS:-8K,16K,64K,128K}; SHAPES=${SHAPES:-3B,8B}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$L/gpu.txt"
run() {  # run NAME TIMEOUT COMMAND...: the command's output to NAME.log, its exit code and time after it
  local name=$1 limit=$2; shift 2; echo "== $name: $*"; local t0=$(date +%s)
  stdbuf -oL -eL timeout "$limit" "$@" > "$L/$name.log" 2>&1
  echo "rc=$? seconds=$(( $(date +%s) - t0 ))" >> "$L/$name.log"; tail -3 "$L/$name.log"
}
for part in ${PARTS:-bench torch}; do case $part in
  bench)    run bench_attention 300 build/bench_attention ${BENCH_ARGS:-} --seqs "$SEQS" --shapes "$SHAPES" --json "$L/attention.jsonl" ;;
  torch)    run torch 200 python3 bench/attention_vs_torch.py --seqs "$SEQS" --shapes "$SHAPES" --json "$L/torch.jsonl" ;;
  separate) run bench_separate 200 build/bench_attention --separate --no-check --seqs "$SEQS" --shapes "$SHAPES" --json "$L/attention_separate.jsonl"
            run torch_separate 200 python3 bench/attention_vs_torch.py --separate --seqs "$SEQS" --shapes "$SHAPES" --json "$L/torch_separate.jsonl" ;;
  hopper)   run bench_hopper 120 build/bench_attention_hopper --bench --seqs "${HSEQS:-16K}" ;;
  long)     run bench_1m 400 build/bench_attention --seqs "${LSEQS:-1M}" --shapes "$SHAPES" --reps 1 --warmup 0 --no-check --json "$L/attention_1m.jsonl" ;;
  mfu)      OUT="$L" PARTS=64k bash bench/core_runs.sh ;;
  documents)
            D=${DOCS:-4K,16K,1K,32K,8K,2K}
            run docs_3b_128k 120 build/bench_attention --shapes 3B --seqs 128K --docs "$D" --json "$L/docs_3b_128k.jsonl"
            run docs_flex_3b_128k 200 python3 bench/attention_vs_torch.py --docs "$D" --seqs 128K --shapes 3B --reps 5 --flex-only --json "$L/docs_flex_3b_128k.json"
            run docs_causal_3b_128k 120 build/bench_attention --shapes 3B --seqs 128K --json "$L/docs_causal_3b_128k.jsonl"
            run docs_one_3b_128k 120 build/bench_attention --shapes 3B --seqs 128K --docs 128K --no-check --json "$L/docs_one_3b_128k.jsonl"
            run docs_8bu8_1m 120 build/bench_attention --shapes 8B-U8 --seqs 1M --docs "$D" --no-check --reps 5 --warmup 1 --json "$L/docs_8bu8_1m.jsonl"
            run docs_flex_8bu8_1m 200 python3 bench/attention_vs_torch.py --docs "$D" --seqs 1M --shapes 8B-U8 --reps 3 --flex-only --json "$L/docs_flex_8bu8_1m.json"
            run docs_causal_8bu8_1m 200 build/bench_attention --shapes 8B-U8 --seqs 1M --no-check --reps 3 --warmup 1 --json "$L/docs_causal_8bu8_1m.jsonl"
            run docs_one_8bu8_1m 120 build/bench_attention --shapes 8B-U8 --seqs 1M --docs 1M --no-check --reps 3 --warmup 1 --json "$L/docs_one_8bu8_1m.jsonl" ;;
  longtest) run test_attention_long 400 env TEST_ATTENTION_LONG_TOKENS="${LONG_TOKENS:-1048653}" build/tests/test_attention --gtest_filter='Kernels/AttentionLong.*' ;;
  *)        echo "attention_gpu.sh: unknown part '$part' (bench torch separate hopper long longtest mfu documents)" >&2; exit 2 ;;
esac; done
