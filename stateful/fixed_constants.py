"""Hypothesis's draws, independent of which modules the process happens to have imported.

Hypothesis (6.1xx) answers about one integer draw in twenty with a literal harvested from the source
of every local module in ``sys.modules``: rule choices, token ids and positions included. Which
modules are loaded depends on what ran before in the process (another check, another test on the
same pytest-xdist worker, the backend's own imports), so one derandomized run drew different
sequences in different processes: in one pytest order the q8-heap machine restored nothing in 50
runs. Inside ``without_local_constants()`` that harvested pool is empty (Hypothesis's built-in
constants stay), so a derandomized run depends on its settings and the code it checks alone.

Hypothesis has no public switch for this; the patch is of two module attributes, taken only where
they exist (``patchable()``), so a later Hypothesis that renames them runs as it would unpatched.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

try:
    from hypothesis.internal.conjecture import providers as _providers
    from hypothesis.internal.constants_ast import Constants as _Constants
except ImportError:    # a Hypothesis without the harvest: nothing to pin
    _providers = _Constants = None

_lock = threading.Lock()
_depth = 0             # nested or concurrent users (conform's checks run in threads)
_harvest = None        # Hypothesis's own function, while it is replaced


def patchable() -> bool:
    return (_providers is not None and callable(getattr(_providers, "_get_local_constants", None))
            and hasattr(getattr(_providers, "CONSTANTS_CACHE", None), "cache"))


def _nothing_harvested():
    return _NOTHING


_NOTHING = _Constants() if _Constants is not None else None


@contextmanager
def without_local_constants() -> Iterator[None]:
    """Run Hypothesis inside with no harvested constants; restored when the last user leaves."""
    global _depth, _harvest
    if not patchable():
        yield
        return
    with _lock:
        if _depth == 0:
            _harvest = _providers._get_local_constants
            _providers._get_local_constants = _nothing_harvested
            _providers.CONSTANTS_CACHE.cache.clear()     # it holds constants drawn from the old pool
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _providers._get_local_constants = _harvest
                _providers.CONSTANTS_CACHE.cache.clear()
