#!/usr/bin/env bash
# bench/compare_binaries.sh - does a change compute what the binary before it computed? On one GPU:
#   same     --dump of step 1 (loss and every gradient) at stages 0-7, with and without
#            --ckpt=selective (also with outputs on the host and a rebuilt input), lean and fused,
#            with and without packed documents, Llama and Qwen3, 2-8 real ranks (--comm host),
#            tiny models at 2K-8K and 3B with 2 layers at 8K: the two binaries' files compared
#            byte for byte; then --sim-world logs (loss and gradient norm of each step) at
#            stages 6 and 7
#   suites   every test binary of $SUITE_BIN (build/tests), with its counts and time
#   both     the two
# OLD=the previous ./train (required for same), NEW=./train; logs under $OUT (default /tmp/out).
# results/refactor/compare_binaries_h100.txt came from it.
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
  T="--config tiny-hd128 --seq-len 2K --steps 1 --seed 3"
  for st in 0 1 2 3 4 5 6 7; do dumpcmp tiny_s$st $T --stage $st; done
  for st in 3 4 6 7; do dumpcmp tinysel_s$st $T --stage $st --ckpt=selective; done
  for st in 6 7; do dumpcmp tiny_fused_s$st $T --stage $st --attention fused; dumpcmp tiny_fast_s$st $T --stage $st --attention fast; done
  for at in fast fused; do for st in 0 6 7; do
    dumpcmp tiny_docs_${at}_s$st $T --stage $st --attention $at --task copy --doc-lengths 128,700 --doc-mask; done; done
  Q="--config tiny-qwen3 --seq-len 2K --steps 1 --seed 3"
  for st in 0 3 4 5 6 7; do dumpcmp qwen3_s$st $Q --stage $st; done
  dumpcmp qwen3_sel_s7 $Q --stage 7 --ckpt=selective
  dumpcmp qwen3_docs_fused_s6 $Q --stage 6 --attention fused --task copy --doc-lengths 128,700 --doc-mask
  S="--config tiny-hd128 --layers 8 --seq-len 8K --steps 1 --seed 3 --ckpt=selective --host-mem-gib 0.03 --rebuild-inputs 2 --device-keep-gib 0.004"
  for st in 4 6 7; do dumpcmp tiny8_selhost_s$st $S --stage $st; done
  for st in 2 6 7; do dumpcmp tiny_np2_s$st $T --stage $st --nproc 2 --comm host; done
  dumpcmp tiny_np2_docs_s6 $T --stage 6 --nproc 2 --comm host --task copy --doc-lengths 128,700 --doc-mask
  dumpcmp tiny8h_np4_s6 --config tiny-8h --seq-len 2K --steps 1 --seed 3 --stage 6 --nproc 4 --comm host
  dumpcmp tiny8h_np4_s2 --config tiny-8h --seq-len 2K --steps 1 --seed 3 --stage 2 --nproc 4 --comm host
  for st in 2 6 7; do dumpcmp qwen3_np2_s$st $Q --stage $st --nproc 2 --comm host; done
  dumpcmp qwen3_8h_np8_s7 --config tiny-qwen3-8h --seq-len 2K --steps 1 --seed 3 --stage 7 --nproc 8 --comm host
  B="--config llama3.2-3b --layers 2 --seq-len 8K --steps 1 --seed 3"
  for st in 0 6 7; do dumpcmp 3b_s$st $B --stage $st; done
  dumpcmp 3b_s7_sel $B --stage 7 --ckpt=selective
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
