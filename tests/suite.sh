#!/bin/sh
# `make test` after the product's set-up: the lint and the whole suite, ordered so that waiting overlaps work on a
# small machine.
#   - Installing the real vLLM (`make vllm`: minutes, most of them pip's) and the lint run behind the tests that
#     spend their time waiting on stacks of real processes (end to end, faults, integration).
#   - Then the tests of real vLLM engines (the conformance suite and the real-vLLM end to end), whose time is the
#     engines' start-up, run beside the unit tests, which only compute and have no clock to miss.
# The installer runs in a process group of its own, so an interrupted run stops it too. Each part's output comes
# after the part; the exit status fails when any part failed.
set -u
MAKE=${MAKE:-make}
PYTEST=".venv/bin/python -m pytest -q -p no:cacheprovider"
REAL_VLLM_TESTS="tests/conformance tests/e2e/test_real_vllm.py"
VLLM_LOG=.vllm-install.log
LINT_LOG=.lint.log
UNIT_LOG=.unit-tests.log

setsid "$MAKE" --no-print-directory vllm >"$VLLM_LOG" 2>&1 &
installer=$!
trap 'kill -- -$installer 2>/dev/null' INT TERM HUP
"$MAKE" --no-print-directory lint >"$LINT_LOG" 2>&1 &
lint=$!

started=$(date +%s)
ignore="--ignore=tests/unit"
for path in $REAL_VLLM_TESTS; do ignore="$ignore --ignore=$path"; done
# shellcheck disable=SC2086
$PYTEST tests $ignore
waiting=$?
waiting_done=$(date +%s)

wait "$lint"
linted=$?
echo "--- make lint (exit $linted):"
cat "$LINT_LOG"
wait "$installer"
installed=$?
echo "--- make vllm (exit $installed):"
grep -v '^WARNING: Location' "$VLLM_LOG"
install_done=$(date +%s)

$PYTEST tests/unit >"$UNIT_LOG" 2>&1 &
unit=$!
real=1
if [ "$installed" = 0 ]; then
  # shellcheck disable=SC2086
  $PYTEST $REAL_VLLM_TESTS
  real=$?
fi
wait "$unit"
units=$?
echo "--- unit tests (exit $units):"
cat "$UNIT_LOG"
ended=$(date +%s)
echo "make test: end-to-end, fault and integration tests $((waiting_done - started)) s; then waited" \
     "$((install_done - waiting_done)) s for the vLLM install; real-vLLM and unit tests $((ended - install_done)) s;" \
     "$((ended - started)) s in all"
[ "$waiting" = 0 ] && [ "$linted" = 0 ] && [ "$installed" = 0 ] && [ "$real" = 0 ] && [ "$units" = 0 ]
