#!/usr/bin/env bash
# bench/compare_binaries.sh - does a change compute what the binary before it computed? On one GPU:
#   same     --dump of step 1 (loss and every gradient) at stages 0-7, with and without
#            --ckpt=selective, lean and fused, with and without packed documents, for tiny-hd128
#            at 2K and 3B with 2 layers at 8K:
#            the two binaries' files compared byte for byte; then --sim-world logs (loss and
#            gradient norm of each step) at stages 6 and 7
#   suites   every test binary of $SUITE_BIN (build/tests), with its counts and time
#   both     the two
# OLD=the previous ./train (required for same), NEW=./train; logs under $OUT (default /tmp/out).
# results/parity/card_reorganisation_vs_previous_binary.txt came from it (removed from main:
# git show 7d8ad1a:results/parity/card_reorganisation_vs_previous_binary.txt).
set -u
what=${1:-both}
export NCCL_NVLS_ENABLE=0
L=${OUT:-/tmp/out}; mkdir -p "$L"
nvidia-smi --query-gpu=name,clocks.sm,power.draw,memory.used --format=csv > "$L/gpu.txt" 2>&1
OLD=${OLD:-} NEW=${NEW:-./train}
SUITE_BIN=${SUITE_BIN:-build/tests}
if [ "$what" != suites ] && [ ! -x "$OLD" ]; then echo "OLD=<the previous binary> is needed" >&2; exit 2; fi
if [ "$what" = same ] || [ "$what" = both ]; then
  : > "$L/same.txt"
  if [ -z "${SIM_ONLY:-}" ]; then
  dumpcmp() {  # name, args...
    local name=$1; shift
    timeout 120 $OLD "$@" --dump /tmp/old.bin > /tmp/dump_old.log 2>&1; a=$?
    timeout 120 $NEW "$@" --dump /tmp/new.bin > /tmp/dump_new.log 2>&1; b=$?
    if [ $a -ne 0 ] || [ $b -ne 0 ]; then r="RUN-FAILED($a,$b)"; elif cmp -s /tmp/old.bin /tmp/new.bin; then r=IDENTICAL; else r=DIFFERENT; fi
    echo "$name $(stat -c %s /tmp/new.bin 2>/dev/null) bytes: $r" | tee -a "$L/same.txt"
    rm -f /tmp/old.bin /tmp/new.bin
  }
  for st in 0 1 2 3 4 5 6 7; do
    dumpcmp tiny_s$st --config tiny-hd128 --seq-len 2K --steps 1 --stage $st --seed 3
    dumpcmp tinysel_s$st --config tiny-hd128 --seq-len 2K --steps 1 --stage $st --seed 3 --ckpt=selective
  done
  for st in 6 7; do
    dumpcmp tiny_fast_s$st --config tiny-hd128 --seq-len 2K --steps 1 --stage $st --seed 3 --attention fast
    dumpcmp tiny_fused_s$st --config tiny-hd128 --seq-len 2K --steps 1 --stage $st --seed 3 --attention fused
  done
  for st in 0 1 2 3 4 5 6 7; do
    dumpcmp 3b_s$st --config llama3.2-3b --layers 2 --seq-len 8K --steps 1 --stage $st --seed 3
  done
  for at in fast fused; do  # packed documents (--doc-mask), both backwards
    for st in 0 6 7; do
      dumpcmp tiny_docs_${at}_s$st --config tiny-hd128 --seq-len 2K --steps 1 --stage $st --seed 3 --attention $at \
        --task copy --doc-lengths 128,700 --doc-mask
    done
    dumpcmp 3b_docs_${at}_s6 --config llama3.2-3b --layers 2 --seq-len 8K --steps 1 --stage 6 --seed 3 --attention $at \
      --task copy --doc-lengths 512,3K --doc-mask
  done
  dumpcmp 3b_s7_sel --config llama3.2-3b --layers 2 --seq-len 8K --steps 1 --stage 7 --ckpt=selective --seed 3
  fi
  simcmp() {  # name, args...
    local name=$1; shift
    timeout 200 $OLD "$@" --log /tmp/old.jsonl > /dev/null 2>&1
    timeout 200 $NEW "$@" --log /tmp/new.jsonl > /dev/null 2>&1
    o=$(grep '"step"' /tmp/old.jsonl | sed -E 's/.*"loss": ([^,]*), .*"grad_norm": ([^,]*),.*/\1 \2/' | tr '\n' ' ')
    n=$(grep '"step"' /tmp/new.jsonl | sed -E 's/.*"loss": ([^,]*), .*"grad_norm": ([^,]*),.*/\1 \2/' | tr '\n' ' ')
    o_t=$(grep '"step"' /tmp/old.jsonl | sed -E 's/.*"step_time_s": ([^,]*),.*/\1/' | tr '\n' ' ')
    n_t=$(grep '"step"' /tmp/new.jsonl | sed -E 's/.*"step_time_s": ([^,]*),.*/\1/' | tr '\n' ' ')
    [ -n "$o" ] && [ "$o" = "$n" ] && r=SAME || r="DIFFER old[$o] new[$n]"
    echo "sim $name: $r (loss, grad norm: $n; step s old $o_t new $n_t)" | tee -a "$L/same.txt"
    rm -f /tmp/old.jsonl /tmp/new.jsonl
  }
  simcmp tiny_w4_s7 --config tiny-hd128 --seq-len 4K --steps 3 --stage 7 --sim-world 4 --seed 5 --task random
  simcmp tiny_w4_s6 --config tiny-hd128 --seq-len 4K --steps 3 --stage 6 --sim-world 4 --seed 5 --task random
  simcmp 3b_w8_s6 --config llama3.2-3b --layers 2 --seq-len 64K --steps 2 --stage 6 --sim-world 8 --seed 5 --task random --mem-cap-gib 80
  simcmp 3b_w8_s7 --config llama3.2-3b --layers 2 --seq-len 64K --steps 2 --stage 7 --sim-world 8 --seed 5 --task random --mem-cap-gib 80
  simcmp 3b_w8_s7sel --config llama3.2-3b --layers 3 --seq-len 64K --steps 2 --stage 7 --ckpt=selective --sim-world 8 --seed 5 --task random --mem-cap-gib 80
fi
if [ "$what" = suites ] || [ "$what" = both ]; then
  for t in ${SUITES:-test_source test_reference test_kernels test_model test_techniques test_cli test_files test_inputs test_multi_gpu test_attention test_hf}; do
    s0=$(date +%s.%N)
    timeout ${SUITE_TIMEOUT:-400} $SUITE_BIN/$t > "$L/$t.log" 2>&1; rc=$?
    s1=$(date +%s.%N)
    echo "$t rc=$rc $(grep TESTCOUNTS "$L/$t.log" | tail -1) $(awk "BEGIN{printf \"%.1f\", $s1 - $s0}") s" | tee -a "$L/suites.txt"
  done
fi
