#!/bin/sh
# How often `races` catches each planted lock bug: RUNS runs of conform's races check (default 5),
# printing the configurations caught (of 3) in each run.
# From the worktree root: PYTHONPATH=$PWD sh tests/foreign/audit2_repro/race_catch_rates.sh [RUNS]
set -u
runs=${1:-5}
for b in close_plain restore_unlocked close_without_lock fork_plain; do
  line=""
  for i in $(seq 1 "$runs"); do
    n=$(timeout 300 python -m kvstate conform "tests/foreign/audit_snapshots_bugs.py:$b" --check races --workers 2 2>&1 \
        | grep -cE '^(f32|f16|q8)-heap +FAIL')
    line="$line $n"
  done
  echo "$b: configurations caught in each run:$line (of 3)"
done
