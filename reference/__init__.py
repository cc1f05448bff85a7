"""The no-sharing reference model the engine is checked against."""

from .model import RefCache, RefContext

__all__ = ["RefCache", "RefContext"]
