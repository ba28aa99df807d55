#!/bin/bash
# bench/profile_bwd.sh - Nsight Compute (ncu --set full) on the attention kernels at one shape: the
# details page, per-instruction SASS samples and raw metrics as text, in $OUT (gpu_logs/profile).
#
# NCU_SEQ (16K), NCU_SHAPE (3B), NCU_REGEX (dkdv_kernel|dq_kernel|forward_kernel), NCU_COUNT (6
# launches) and NCU_BENCH_ARGS (more arguments, e.g. --docs 4K,16K) pick what is profiled, in
# build/bench_attention; the SASS of build/attention_hopper.o goes beside it. Run from the
# repository root after make.
set -u
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PATH=/usr/local/cuda/bin:$PATH
L=${OUT:-gpu_logs/profile}; mkdir -p "$L"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "profile_bwd.sh: ncu (Nsight Compute) not found" >&2; exit 1; }
echo "ncu: $NCU"
t0=$(date +%s)
timeout 300 "$NCU" --clock-control none --kernel-name regex:"${NCU_REGEX:-dkdv_kernel|dq_kernel|forward_kernel}" \
    --launch-count "${NCU_COUNT:-6}" --set full --import-source no -o "$L/attn" -f \
    build/bench_attention --seqs "${NCU_SEQ:-16K}" --shapes "${NCU_SHAPE:-3B}" --reps 1 --warmup 0 --no-check ${NCU_BENCH_ARGS:-} > "$L/ncu_run.log" 2>&1
echo "ncu rc=$? seconds=$(( $(date +%s) - t0 ))"; tail -5 "$L/ncu_run.log"
"$NCU" --import "$L/attn.ncu-rep" --page details > "$L/details.txt" 2>&1
"$NCU" --import "$L/attn.ncu-rep" --page source --csv --print-source sass > "$L/source_sass.csv" 2>&1
"$NCU" --import "$L/attn.ncu-rep" --page raw --csv > "$L/raw.csv" 2>&1
cuobjdump --dump-sass build/attention_hopper.o > "$L/attention_hopper.sass" 2>&1
ls -la "$L"
