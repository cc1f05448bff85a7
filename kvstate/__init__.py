"""kvstate: a paged, copy-on-write KV-cache state engine, and the suite that proves it.

    from kvstate import Cache, Layout
    cache = Cache(Layout(layers=2, kv_heads=4, head_dim=16), page_tokens=64)
    ctx = cache.allocate()
"""

from kvstate.impl import Cache, Context, TokenIds
from kvstate.spec import Config, Layout
from kvstate.spec.errors import *  # noqa: F401,F403

__version__ = "0.1.0"
__all__ = ["Cache", "Context", "TokenIds", "Config", "Layout", "__version__"]
