"""The GPT-2 forward pass in torch: the same contract as ``numpy_gpt2.GPT2``.

Same weights dict, same calls (``prefill``, ``decode``), same contexts (a kvstate
``Context`` or ``ContiguousKV``), same exactness rule: past K/V are read back from
the context, new K/V pass through the precision's round trip before later layers
use them, and one ``ctx.extend`` appends every layer's K/V after the pass, logits
included (as a float32 NumPy batch, which every page store accepts). ``device`` may be ``"cuda"``; values cross to the CPU only for the
round trip and the extend.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from kvstate.spec.precision import roundtrip

from .config import GPT2Config
from .numpy_gpt2 import check_call
from .weights import block_weights, check_weights, random_weights


class TorchGPT2:
    def __init__(self, config: GPT2Config, weights: dict[str, np.ndarray], device: str = "cpu"):
        check_weights(config, weights)
        self.config = config
        self.layout = config.layout
        self.device = torch.device(device)
        # float32, as the NumPy model computes: a float64 or integer weight would meet float32 K/V
        w = {name: torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(self.device)
             for name, array in weights.items()}
        self.wte, self.wpe = w["wte.weight"], w["wpe.weight"]
        self.ln_f = (w["ln_f.weight"], w["ln_f.bias"])
        self.blocks = block_weights(w, config.n_layer)

    @classmethod
    def random(cls, config: GPT2Config, seed: int = 0, device: str = "cpu") -> "TorchGPT2":
        return cls(config, random_weights(config, seed), device)

    def prefill(self, ctx, tokens) -> np.ndarray:
        """Append ``tokens`` to ``ctx``; logits ``(n, vocab)`` for every new position (NumPy, float32)."""
        return self._forward(ctx, tokens)

    def decode(self, ctx, token: int) -> np.ndarray:
        """Append one token to ``ctx``; next-token logits ``(vocab,)``."""
        return self._forward(ctx, [token])[0]

    @torch.no_grad()
    def _forward(self, ctx, tokens) -> np.ndarray:
        cfg = self.config
        tokens = check_call(cfg, ctx, tokens)
        start, n = len(ctx), len(tokens)
        H, D, eps = cfg.n_head, cfg.head_dim, cfg.layer_norm_epsilon
        ids = torch.from_numpy(tokens).to(self.device)
        x = self.wte[ids] + self.wpe[start:start + n]
        kv = np.empty(self.layout.batch_shape(n), np.float32)
        causal = torch.ones(n, start + n, dtype=torch.bool, device=self.device).tril(start)
        for layer, (g1, b1, w_qkv, b_qkv, w_o, b_o, g2, b2, w_fc, b_fc, w_out, b_out) in enumerate(self.blocks):
            qkv = F.layer_norm(x, (cfg.n_embd,), g1, b1, eps) @ w_qkv + b_qkv
            q, k, v = (part.reshape(n, H, D) for part in qkv.split(cfg.n_embd, dim=1))
            kv[:, layer, 0], kv[:, layer, 1] = k.cpu().numpy(), v.cpu().numpy()
            keys, values = self._keys_values(ctx, layer, start, kv[:, layer, 0], kv[:, layer, 1])
            scores = (q.transpose(0, 1) @ keys.permute(1, 2, 0)) / math.sqrt(D)     # (H, n, T)
            weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            attended = (weights @ values.transpose(0, 1)).transpose(0, 1).reshape(n, cfg.n_embd)
            x = x + attended @ w_o + b_o
            h = F.layer_norm(x, (cfg.n_embd,), g2, b2, eps)
            x = x + F.gelu(h @ w_fc + b_fc, approximate="tanh") @ w_out + b_out
        logits = (F.layer_norm(x, (cfg.n_embd,), *self.ln_f, eps) @ self.wte.T).cpu().numpy()
        ctx.extend(tokens, kv)          # last: a pass that fails leaves the context as it was
        return logits

    def _keys_values(self, ctx, layer: int, start: int, k: np.ndarray, v: np.ndarray):
        """Past K/V read from the context, then the new ones as the context will store them."""
        new = [roundtrip(ctx.precision, part) for part in (k, v)]
        if start:        # ``read_layer_pages``: the one read every context of the contract has
            parts = ctx.read_layer_pages(layer)
            new = [np.concatenate([_host(page[side]) for page in parts] + [n]) for side, n in enumerate(new)]
        return tuple(torch.from_numpy(part).to(self.device) for part in new)


def _host(part) -> np.ndarray:
    """A page's K or V as a NumPy array (a torch store's pages may be tensors, on any device)."""
    return part.cpu().numpy() if torch.is_tensor(part) else np.asarray(part)
