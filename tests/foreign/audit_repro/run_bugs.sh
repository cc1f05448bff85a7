#!/bin/sh
# Run conform (ci profile) against each planted bug of tests/foreign/audit_bugs.py; one log per bug.
# Usage: [CONFORM_ARGS="--config NAME"] tests/foreign/audit_repro/run_bugs.sh OUTDIR [BUG...]
cd "$(dirname "$0")/../../.." || exit 2
export PYTHONPATH="$PWD"
out=${1:-/tmp/audit_bugs}; shift
mkdir -p "$out"
bugs=${*:-"evict_newest_for_room cow_ignores_entries need_omits_tail_copy stamp_all_candidates tie_first_retained unchained_hash refuse_midway truncate_keeps_page clear_keeps_index evict_skips_shared partial_hit_no_stamp hash_without_parent"}
for b in $bugs; do
  timeout 900 python -m kvstate conform "tests/foreign/audit_bugs.py:$b" --workers 2 $CONFORM_ARGS > "$out/$b.log" 2>&1
  echo "$b: exit $?"
done
