#!/usr/bin/env bash
# The suite as `make test` runs it (all but the `fleet` tests), in three phases:
#   1. the in-memory tests and, side by side in a second pytest process, the tests that start the
#      project's processes or netlab labs (fixed lab names, timed faults; log out/test-processes.log,
#      printed after) -- much of their time is waiting, so the two share the 2 cores well;
#   2. the tests that start vLLM servers (they share them: tests/conftest.py), alone: vLLM on CPU
#      slowed 2-6x beside the other half;
#   3. the tests marked `timing` (latency compared loaded against unloaded), alone.
# Each prints its summary and slowest tests; the exit status is the first failure's. Extra arguments
# go to each (e.g. -x, -k EXPR).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${PDDLINK_VENV:-.venv}
PY=$VENV/bin/python
export PATH="$PWD/$VENV/bin:$PATH"  # tests start `pddlink` subprocesses: the project's environment first
mkdir -p out
VLLM="vllm or hf"
PROCS="(e2e or netlab or process or root or docker) and not ($VLLM or timing)"
args=(-q --durations=15 -p no:cacheprovider "$@")
"$PY" -m pytest "${args[@]}" -m "not fleet and ($PROCS)" > out/test-processes.log 2>&1 &
procs=$!
echo "test.sh: 1. the in-memory tests here; the processes' tests meanwhile in out/test-processes.log"
"$PY" -m pytest "${args[@]}" -m "not fleet and not timing and not ($VLLM) and not ($PROCS)"
rc_unit=$?
wait "$procs"; rc_procs=$?
echo "test.sh: 1. the processes' tests (out/test-processes.log):"
cat out/test-processes.log
echo "test.sh: 2. the vLLM tests, alone:"
"$PY" -m pytest "${args[@]}" -m "not fleet and not timing and ($VLLM)"
rc_vllm=$?
echo "test.sh: 3. the latency comparisons, alone:"
"$PY" -m pytest "${args[@]}" -m "not fleet and timing"
rc_timing=$?
echo "test.sh: exit statuses: in-memory $rc_unit, processes $rc_procs, vLLM $rc_vllm, timing $rc_timing"
for rc in "$rc_unit" "$rc_procs" "$rc_vllm" "$rc_timing"; do [ "$rc" = 0 ] || exit "$rc"; done
