#!/usr/bin/env bash
# One short run on a GPU machine: the CUDA torch store through the lockstep machine,
# the directed conformance checks (fork allocates 0, one write copies one page, ...)
# and the CUDA-marked store tests (bit-identity with NumPy, refusals, counting).
# Usage: bench/gpu_check.sh [python]      (about a minute or two on one GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python}"
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: torch sees no CUDA device')"
"$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), 'torch', torch.__version__)"
"$PY" -m pytest -q -m cuda -p no:cacheprovider tests/test_torch_store.py tests/test_conform.py
"$PY" -m kvstate conform kvstate.impl.torch:cuda_factory --profile ci --time-limit 240
"$PY" -m kvstate.bench.store_bench --device cuda --repeat 200
