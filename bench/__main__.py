"""``python -m kvstate.bench``: run the benchmarks (same as ``kvstate bench``)."""

import sys

from .cli import main

sys.exit(main())
