#!/usr/bin/env bash
# tests/fuzz/run_fuzz.sh TARGET - runs the fuzz target build/fuzz/fuzz_TARGET (tests/fuzz/fuzz.mk)
# for FUZZ_SECONDS seconds (default 40) from its committed seeds, prints what libFuzzer did
# (executions, coverage: cov edges and ft features) and ends with the line tests/run_tests.sh
# counts: TESTCOUNTS passed=1 when nothing was found; failed=1 on a crash, a sanitizer report, an
# oracle failure, an input taking over 10 s (a hang) or a run over 2 GB (memory); skipped=1
# when the target is not built (no clang++ with libFuzzer). A failing input is kept under
# build/fuzz/ and the line to replay it printed.
set -u
target=$1
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$root/build/fuzz/fuzz_$target
seeds=$root/tests/fuzz/seeds/$target
if [ ! -x "$bin" ]; then
    echo "fuzz_$target: not built (needs clang++ with libFuzzer, Debian's clang and libclang-rt-dev): skipped"
    echo "TESTCOUNTS passed=0 failed=0 skipped=1"
    exit 0
fi
dict=()
case $target in tokens | outputs) ;; *) dict=(-dict="$root/tests/fuzz/json.dict") ;; esac
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/corpus"
# New inputs go to a scratch corpus; the committed seeds are only read.
"$bin" -max_total_time="${FUZZ_SECONDS:-40}" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$work/" "${dict[@]}" "$work/corpus" "$seeds" > "$work/log" 2>&1
rc=$?
grep -E '^INFO: Seed:|^#[0-9]+[[:space:]]+INITED' "$work/log" | sed "s/^/fuzz_$target: /"
done=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$work/log" | tail -n 1)
runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/log")
rss=$(sed -n 's/^stat::peak_rss_mb: *//p' "$work/log")
cov=$(echo "$done" | sed -n 's/.*cov: \([0-9]*\).*/\1/p')
ft=$(echo "$done" | sed -n 's/.*ft: \([0-9]*\).*/\1/p')
corp=$(echo "$done" | sed -n 's/.*corp: \([0-9]*\).*/\1/p')
if [ "$rc" -eq 0 ] && [ -n "$done" ]; then
    echo "fuzz_$target: ${runs:-?} executions in ${FUZZ_SECONDS:-40} s, cov ${cov:-?} ft ${ft:-?}, corpus ${corp:-?} inputs, peak RSS ${rss:-?} MB: nothing found"
    echo "TESTCOUNTS passed=1 failed=0 skipped=0"
    exit 0
fi
tail -n 60 "$work/log"
for a in "$work"/crash-* "$work"/timeout-* "$work"/oom-* "$work"/leak-* "$work"/slow-unit-*; do
    [ -e "$a" ] || continue
    cp "$a" "$root/build/fuzz/$target-$(basename "$a")"
    echo "fuzz_$target: failing input kept; replay: $bin $root/build/fuzz/$target-$(basename "$a")"
done
echo "fuzz_$target: FAILED (libFuzzer exit code $rc)"
echo "TESTCOUNTS passed=0 failed=1 skipped=0"
exit 1
