"""A GPT-2-architecture decoder that keeps its K/V in a kvstate ``Context``.

- ``config.py``      shapes (``GPT2Config``) and the K/V layout they imply
- ``weights.py``     seeded random weights and the local safetensors loader
- ``numpy_gpt2.py``  the forward pass in NumPy: ``prefill`` and ``decode``
- ``torch_gpt2.py``  the same pass in torch (``TorchGPT2``; imported only when asked for)
- ``contiguous.py``  a plain contiguous K/V cache with the same read/extend calls (benchmark baseline)
"""

from .config import GPT2Config
from .contiguous import ContiguousKV
from .numpy_gpt2 import GPT2
from .weights import load_safetensors, random_weights

__all__ = ["GPT2", "GPT2Config", "ContiguousKV", "load_safetensors", "random_weights"]
