#!/usr/bin/env bash
# Runs every test binary given, shows their output, and ends with one line:
#   N passed, N failed, N skipped
# Exit status: 0 only if every binary ran and no test failed. A binary that runs longer than
# TEST_TIMEOUT seconds (default 3600) is stopped and counted as failed (a hang is a failure).
set -u
passed=0; failed=0; skipped=0; status=0
for bin in "$@"; do
    echo "=== $bin"
    out=$(timeout "${TEST_TIMEOUT:-3600}" "$bin" 2>&1); rc=$?
    [ "$rc" -eq 124 ] && echo "!!! $bin stopped after ${TEST_TIMEOUT:-3600} s"
    echo "$out" | grep -v '^TESTCOUNTS '
    line=$(echo "$out" | grep '^TESTCOUNTS ' | tail -n 1)
    if [ -z "$line" ]; then
        echo "!!! $bin ended without a result (exit code $rc)"; failed=$((failed + 1)); status=1; continue
    fi
    p=$(echo "$line" | sed -E 's/.*passed=([0-9]+).*/\1/')
    f=$(echo "$line" | sed -E 's/.*failed=([0-9]+).*/\1/')
    s=$(echo "$line" | sed -E 's/.*skipped=([0-9]+).*/\1/')
    passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + s))
    [ "$rc" -ne 0 ] && status=1
done
[ "$failed" -ne 0 ] && status=1
echo "$passed passed, $failed failed, $skipped skipped"
exit $status
