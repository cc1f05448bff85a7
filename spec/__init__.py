"""The contract as code: layout, precisions, invariants, the backend protocol.

Imports nothing else of kvstate; the reference and the engine both depend on it.
"""

from .errors import *  # noqa: F401,F403  (the hierarchy is part of the contract)
from .layout import DEFAULT_PAGE_TOKENS, TOKEN_LIMIT, Layout
from .observation import EntryView, NodeView, Observation, PageView
from .precision import PRECISIONS
from .protocol import CacheProtocol, Config, ContextProtocol, Factory, standard_configs

__all__ = [
    "DEFAULT_PAGE_TOKENS", "TOKEN_LIMIT", "Layout", "Observation", "PageView", "NodeView",
    "EntryView", "PRECISIONS", "CacheProtocol", "ContextProtocol", "Config", "Factory",
    "standard_configs",
]
