#!/usr/bin/env bash
# The suite as `make test` runs it: two pytest processes side by side on the 2 cores, each running
# its tests one at a time. "vllm": the tests that start vLLM servers (they share them: tests/conftest.py)
# and the in-memory tests; "processes": the tests that start the project's other processes or netlab
# labs (fixed lab names, timed faults), with the simulator's (CPU-bound: they even the halves out). Then the tests marked `timing` (latency ratios) alone, with
# the machine to themselves. Each prints its own summary and slowest tests; the exit status is the
# first failure's. Extra arguments go to each (e.g. -x, -k EXPR).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${PDDLINK_VENV:-.venv}
PY=$VENV/bin/python
export PATH="$PWD/$VENV/bin:$PATH"  # tests start `pddlink` subprocesses: the project's environment first
mkdir -p out
PROCS="(e2e or netlab or process or root or docker or sim) and not (vllm or hf or timing)"
args=(-q --durations=15 -p no:cacheprovider "$@")
"$PY" -m pytest "${args[@]}" -m "not fleet and ($PROCS)" > out/test-processes.log 2>&1 &
procs=$!
echo "test.sh: the vLLM and in-memory tests here; the processes' tests meanwhile in out/test-processes.log"
"$PY" -m pytest "${args[@]}" -m "not fleet and not timing and not ($PROCS)"
rc_a=$?
wait "$procs"; rc_b=$?
echo "test.sh: the processes' tests (out/test-processes.log):"
cat out/test-processes.log
echo "test.sh: the latency comparisons, alone:"
"$PY" -m pytest "${args[@]}" -m "not fleet and timing"
rc_c=$?
echo "test.sh: exit statuses: vllm and in-memory $rc_a, processes $rc_b, timing $rc_c"
for rc in "$rc_a" "$rc_b" "$rc_c"; do [ "$rc" = 0 ] || exit "$rc"; done
