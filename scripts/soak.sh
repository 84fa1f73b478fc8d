#!/usr/bin/env bash
# The long soak (`make soak`), outside CI: the native stress test under
# ASan+UBSan and under TSan (`make asan` / `make tsan`, two seeds each, SOAK_ASAN_SECONDS
# and SOAK_TSAN_SECONDS per run: TSan runs about 60% of ASan's operations per second), then the Python state machine of tests/test_cache_invariants.py for
# SOAK_EXAMPLES examples. Fails on any sanitizer report, cache violation or state-machine
# failure, and when a sanitizer ran fewer than SOAK_MIN_OPS operations in all (a loaded
# machine: run again with a larger SOAK_SECONDS). Logs and the summary go to build/soak/.
set -euo pipefail
SOAK_ASAN_SECONDS=${SOAK_ASAN_SECONDS:-200}
SOAK_TSAN_SECONDS=${SOAK_TSAN_SECONDS:-340}
SOAK_SEED=${SOAK_SEED:-16}
SOAK_EXAMPLES=${SOAK_EXAMPLES:-500}
SOAK_MIN_OPS=${SOAK_MIN_OPS:-1000000}
PYTHON=${PYTHON:-python3}
MAKE=${MAKE:-make}
out=build/soak
mkdir -p "$out"
: >"$out/summary.txt"

for san in asan tsan; do
  start=$(date +%s)
  seconds=$SOAK_ASAN_SECONDS
  [[ $san == tsan ]] && seconds=$SOAK_TSAN_SECONDS
  "$MAKE" --no-print-directory "$san" STRESS_SECONDS="$seconds" STRESS_SEED="$SOAK_SEED" \
    2>&1 | tee "$out/$san.log"
  ops=$(grep -Eo '^[0-9]+ operations' "$out/$san.log" | awk '{s += $1} END {print s + 0}')
  violations=$(grep -Eo '[0-9]+ violations' "$out/$san.log" | awk '{s += $1} END {print s + 0}')
  reports=$(grep -Ec 'ERROR: (Address|Thread|UndefinedBehavior)Sanitizer|WARNING: ThreadSanitizer|runtime error:' "$out/$san.log" || true)
  line="$san: $ops operations, $violations violations, $reports sanitizer reports, $(( $(date +%s) - start )) s ($(grep -E '^[0-9]+ operations' "$out/$san.log" | tr '\n' ';'))"
  echo "$line" | tee -a "$out/summary.txt"
  if (( ops < SOAK_MIN_OPS )); then
    echo "soak: $san ran $ops operations, fewer than $SOAK_MIN_OPS: give it more seconds" >&2
    exit 1
  fi
done

start=$(date +%s)
ES_STATE_MACHINE_EXAMPLES="$SOAK_EXAMPLES" "$PYTHON" -m pytest -q -s -p no:cacheprovider \
  tests/test_cache_invariants.py -k test_cache_state_machine 2>&1 | tee "$out/state_machine.log"
echo "state machine: $SOAK_EXAMPLES examples, $(grep -Eo 'state machine: .*' "$out/state_machine.log" | head -1 | sed 's/^state machine: //'), $(( $(date +%s) - start )) s" \
  | tee -a "$out/summary.txt"
