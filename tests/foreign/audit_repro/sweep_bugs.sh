#!/bin/sh
# Sweep planted bugs that conform's ci caught in only some configurations: how often does a 400-step seed catch each?
# Usage: tests/foreign/audit_repro/sweep_bugs.sh OUTDIR SEEDS
cd "$(dirname "$0")/../../.." || exit 2
export PYTHONPATH="$PWD"
out=${1:-/tmp/audit_sweeps}; seeds=${2:-200}
mkdir -p "$out"
for spec in "need_omits_tail_copy block4-f32-pool10-evict,block3-f16-pool8-evict-pages5" \
            "stamp_all_candidates block4-q8-pool12-refuse-pages6,block3-f16-pool8-evict-pages5" \
            "evict_skips_shared block4-f32-pool10-evict,block3-f16-pool8-evict-pages5"; do
  set -- $spec
  timeout 900 python -m kvstate sweep --seeds "$seeds" --steps 400 --configs "$2" \
      --backend "tests/foreign/audit_bugs.py:$1" --workers 2 --out "$out/$1" > "$out/$1.log" 2>&1
  echo "$1: exit $?"; tail -6 "$out/$1.log"
done
