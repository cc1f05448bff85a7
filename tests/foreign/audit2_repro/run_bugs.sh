#!/bin/sh
# Run conform (ci) on the audit engine and on each planted bug; prints each verdict row.
# From the worktree root: PYTHONPATH=$PWD sh tests/foreign/audit2_repro/run_bugs.sh
set -u
timeout 200 python -m kvstate conform tests/foreign/audit_snapshots.py --workers 2 | grep -E '^(f32|f16|q8)-heap  '
for b in in_place_write no_folder_fsync allocate_before_validate allocate_then_free checksum_not_verified \
         content_not_checked trailing_bytes_accepted layout_by_size layer_major_body convert_without_range_check \
         close_without_lock close_plain; do
  echo "== $b"
  timeout 200 python -m kvstate conform tests/foreign/audit_snapshots_bugs.py:$b --workers 2 > /tmp/audit2_$b.txt 2>&1
  echo "rc=$?"; grep -m2 -E 'BrokenPromise|AssertionError|RaceFailure' /tmp/audit2_$b.txt | cut -c1-300
done
