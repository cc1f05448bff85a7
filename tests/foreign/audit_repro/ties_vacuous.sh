#!/bin/sh
# Finding: prefix edges' `ties` scenario (and the block-ties pinned row) is vacuous under a max_pages
# budget that cannot hold both tied entries: the older one is evicted by the budget before the tied
# query. tie_first_retained is caught by prefix edges + pinned semantics where max_pages is 0, and
# passes both in the two max_pages configurations (it is still caught there by lockstep/seeded).
cd "$(dirname "$0")/../../.." || exit 2
export PYTHONPATH="$PWD"
for c in block4-f32-pool10-evict block4-q8-pool12-refuse-pages6 block3-f16-pool8-evict-pages5; do
  timeout 300 python -m kvstate conform tests/foreign/audit_bugs.py:tie_first_retained --config "$c" \
      --check "prefix edges" --check "pinned semantics" --workers 1 2>&1 | grep -E "^$c "
done
