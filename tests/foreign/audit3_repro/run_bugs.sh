#!/usr/bin/env bash
# Rerun every planted bug of tests/foreign/audit3_locks_bugs.py against `kvstate conform`, one at a time,
# then the correct engine (the control). Usage: tests/foreign/audit3_repro/run_bugs.sh [NAME ...]
# Output: one log per bug under ${OUT:-/tmp/audit3_bugs}/NAME.txt and one summary line per bug.
set -u
ROOT="$(cd "$(dirname "$0")/../../.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT"
OUT="${OUT:-/tmp/audit3_bugs}"; mkdir -p "$OUT"
NAMES=("$@")
if [ ${#NAMES[@]} -eq 0 ]; then
  mapfile -t NAMES < <(python -c "import sys; sys.path.insert(0,'tests/foreign'); import audit3_locks_bugs as b; print('\n'.join(b.BUGS))")
fi
for name in "${NAMES[@]}"; do
  # --time-limit 60: a planted deadlock is reported as TIMEOUT within a minute, not five
  python -m kvstate conform "tests/foreign/audit3_locks_bugs.py:$name" --workers 1 --time-limit 60 > "$OUT/$name.txt" 2>&1
  rc=$?
  fails=$(grep -oE '^[a-z0-9-]+ / [a-z ]+: (FAIL|TIMEOUT)' "$OUT/$name.txt" | sed 's/: .*//' | tr '\n' ';')
  echo "$name rc=$rc ${fails:-<none: not caught>}"
done
python -m kvstate conform tests/foreign/audit3_locks.py --workers 1 > "$OUT/control.txt" 2>&1
echo "control (correct engine) rc=$?"
