#!/bin/bash
# bench/profile_bwd.sh - one device call: Nsight Compute on the attention kernels at one shape
# (3B, 16K by default), the details page and the per-instruction SASS samples as text, the SASS
# of attention_hopper.o; then the GPU suites not run by attention_gpu.sh. Logs under $OUT (tarred).
# NCU_SEQ, NCU_SHAPE, NCU_REGEX, SUITES select what runs.
set -u
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PATH=/usr/local/cuda/bin:$PATH
L=$OUT/prof; mkdir -p $L
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
t0=$(date +%s)
timeout 300 $NCU --clock-control none --kernel-name regex:"${NCU_REGEX:-dkdv_kernel|dq_kernel|forward_kernel}" \
    --launch-count ${NCU_COUNT:-6} --set full --import-source no -o $L/attn -f \
    build/bench_attention --seqs ${NCU_SEQ:-16K} --shapes ${NCU_SHAPE:-3B} --reps 1 --warmup 0 --no-check > $L/ncu_run.log 2>&1
echo "ncu rc=$? seconds=$(( $(date +%s) - t0 ))"; tail -5 $L/ncu_run.log
$NCU --import $L/attn.ncu-rep --page details > $L/details.txt 2>&1
$NCU --import $L/attn.ncu-rep --page source --csv --print-source sass > $L/source_sass.csv 2>&1
$NCU --import $L/attn.ncu-rep --page raw --csv > $L/raw.csv 2>&1
cuobjdump --dump-sass build/attention_hopper.o > $L/attention_hopper.sass 2>&1
ls -la $L
for t in ${SUITES:-}; do
  echo "== $t"; t1=$(date +%s)
  stdbuf -oL -eL timeout 200 build/tests/$t > $L/$t.log 2>&1; echo "rc=$? seconds=$(( $(date +%s) - t1 ))" >> $L/$t.log; tail -3 $L/$t.log
done
tar czf $OUT/prof.tgz -C $OUT prof && rm -rf $L
