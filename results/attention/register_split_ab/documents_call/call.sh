#!/usr/bin/env bash
# The fused backward with documents: PRODUCER_REGS/CONSUMER_REGS 40/232 (main) against 56/224 (no
# kernel spills per ptxas), old new new old, documents and causal at 3B 128K; then 8B-U8 1M
# documents once each; then FlexAttention at 1M with the block mask from the documents' lengths.
set -u; export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
tar xJf .gpu/ab_regs.tar.xz
D=4K,16K,1K,32K,8K,2K; mkdir -p /tmp/ab
for v in main regs56 regs56 main; do for docs in "--docs $D" ""; do
  tag=${v}_3b_128k_$([ -n "$docs" ] && echo docs || echo causal)
  ./bench_attention_$v --shapes 3B --seqs 128K $docs --json /tmp/ab/$tag.jsonl > /tmp/ab/$tag.txt 2>&1
  echo "$tag: $(tail -2 /tmp/ab/$tag.txt | tr '\n' ' ' | cut -c1-300)" | tee -a $OUT/summary.txt
done; done
for v in main regs56; do
  ./bench_attention_$v --shapes 8B-U8 --seqs 1M --docs $D --no-check --reps 5 --warmup 1 --json /tmp/ab/${v}_8bu8_1m_docs.jsonl > /tmp/ab/${v}_8bu8_1m_docs.txt 2>&1
  echo "${v}_8bu8_1m_docs: $(tail -2 /tmp/ab/${v}_8bu8_1m_docs.txt | tr '\n' ' ' | cut -c1-300)" | tee -a $OUT/summary.txt
done
timeout 400 python3 bench/attention_vs_torch.py --docs $D --seqs 128K,1M --shapes 8B-U8 --flex-only --reps 5 --json /tmp/ab/flex_8bu8.json > /tmp/ab/flex_8bu8.txt 2>&1
echo "flex rc=$?"; tail -8 /tmp/ab/flex_8bu8.txt | tee -a $OUT/summary.txt
cd /tmp/ab && tar czf $OUT/ab.tgz *
