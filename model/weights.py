"""GPT-2 weights as a flat dict named the way Hugging Face's ``GPT2Model`` names them.

``random_weights`` draws seeded weights for any shape; ``load_safetensors`` reads a
local file (no download). Linear weights are ``(in, out)`` (GPT-2's ``Conv1D``),
so a layer is ``x @ W + b``. The output head is tied to ``wte``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from kvstate.spec.errors import ConfigError, UnsupportedModelError

from .config import GPT2Config


BLOCK_PARTS = (
    "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
    "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
    "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias")
"""One transformer block's weights, in the order the forward passes unpack them."""


def block_weights(weights: dict, n_layer: int) -> list[tuple]:
    """Per layer, that block's weights in ``BLOCK_PARTS`` order (NumPy arrays or tensors alike)."""
    return [tuple(weights[f"h.{i}.{part}"] for part in BLOCK_PARTS) for i in range(n_layer)]


def weight_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    d = config.n_embd
    shapes = {"wte.weight": (config.vocab_size, d), "wpe.weight": (config.n_positions, d),
              "ln_f.weight": (d,), "ln_f.bias": (d,)}
    for i in range(config.n_layer):
        shapes.update({
            f"h.{i}.ln_1.weight": (d,), f"h.{i}.ln_1.bias": (d,),
            f"h.{i}.attn.c_attn.weight": (d, 3 * d), f"h.{i}.attn.c_attn.bias": (3 * d,),
            f"h.{i}.attn.c_proj.weight": (d, d), f"h.{i}.attn.c_proj.bias": (d,),
            f"h.{i}.ln_2.weight": (d,), f"h.{i}.ln_2.bias": (d,),
            f"h.{i}.mlp.c_fc.weight": (d, 4 * d), f"h.{i}.mlp.c_fc.bias": (4 * d,),
            f"h.{i}.mlp.c_proj.weight": (4 * d, d), f"h.{i}.mlp.c_proj.bias": (d,),
        })
    return shapes


def random_weights(config: GPT2Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded float32 weights: N(0, 0.02) matrices, small random biases, LayerNorm gains near 1."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        values = rng.standard_normal(shape, dtype=np.float32)
        if name.endswith(".weight") and len(shape) == 1:      # LayerNorm gain
            values = 1 + np.float32(0.1) * values
        else:
            values *= np.float32(0.02)
        weights[name] = values
    return weights


def load_safetensors(path, n_head: int | None = None) -> tuple[GPT2Config, dict[str, np.ndarray]]:
    """Config and weights from a local GPT-2 safetensors file (HF ``save_pretrained`` naming).

    ``n_head`` is not recorded in the weights: it is taken from the argument, else
    from a ``config.json`` beside the file, else ``n_embd // 64`` (every GPT-2 size
    uses 64-wide heads; an ``n_embd`` that is not a multiple of 64 needs it said). That file's ``layer_norm_epsilon`` is honoured; an activation or
    attention scaling this model does not compute is refused (``check_computed``).
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        path = Path(path)
    except TypeError:
        raise ConfigError(f"load_safetensors needs a file path, got {type(path).__name__}") from None
    if path.is_dir():       # safetensors' own error is "No such device (os error 19)"
        raise ConfigError(f"{path} is a folder, not a safetensors file")
    if not path.exists():
        raise ConfigError(f"{path}: no such safetensors file")
    try:
        raw = load_file(str(path))
    except (SafetensorError, OSError, TypeError, ValueError) as error:    # TypeError: a dtype NumPy lacks (bfloat16)
        raise ConfigError(f"{path} is not a readable safetensors file: {error}") from None
    weights = {}
    for name, array in raw.items():
        name = name.removeprefix("transformer.")
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
            continue    # causal-mask buffers; the head is tied to wte
        if array.dtype.kind != "f":     # before the cast, which would turn int64 into float32 silently
            raise ConfigError(f"{path}: weight {name} has dtype {array.dtype}, expected a floating-point array")
        weights[name] = np.ascontiguousarray(array, dtype=np.float32)
    if "wte.weight" not in weights or "wpe.weight" not in weights:
        raise ConfigError(f"{path} holds no GPT-2 embeddings (wte.weight, wpe.weight)")
    for name in ("wte.weight", "wpe.weight"):   # the shape is read from these two: (rows, n_embd)
        if weights[name].ndim != 2:
            raise ConfigError(f"{path}: weight {name} has shape {weights[name].shape}, expected (rows, n_embd)")
    vocab, d = weights["wte.weight"].shape
    layers = 1 + max((int(m.group(1)) for m in map(re.compile(r"h\.(\d+)\.").match, weights) if m), default=-1)
    beside = path.with_name("config.json")
    hf_config = read_hf_config(beside) if beside.exists() else {}
    check_computed(hf_config, beside)
    epsilon = hf_config.get("layer_norm_epsilon", 1e-5)
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not 0 < epsilon < float("inf"):
        raise ConfigError(f"{beside}: layer_norm_epsilon must be a positive finite number, got {epsilon!r}")
    if n_head is None:
        n_head = hf_config.get("n_head")
    if n_head is None:      # GPT-2's heads are 64 wide; anything else must be said
        if d % 64:
            raise ConfigError(f"{path}: n_embd {d} is not a multiple of GPT-2's 64-wide heads; "
                              f"give n_head (or a config.json beside the file that has it)")
        n_head = d // 64
    config = GPT2Config(vocab_size=vocab, n_positions=weights["wpe.weight"].shape[0], n_embd=d,
                        n_layer=layers, n_head=n_head, layer_norm_epsilon=float(epsilon))
    check_weights(config, weights)
    return config, weights


def read_hf_config(where: Path) -> dict:
    """The JSON object in ``config.json``; ``ConfigError`` naming the file for anything else."""
    try:
        hf_config = json.loads(where.read_bytes())
    except (OSError, ValueError) as error:     # ValueError: bad JSON or bad UTF-8
        raise ConfigError(f"{where} is not a readable JSON file: {error}") from None
    if not isinstance(hf_config, dict):
        raise ConfigError(f"{where} holds a JSON {type(hf_config).__name__}, expected an object")
    return hf_config


# What an HF GPT-2 config.json may say that this model does not compute, and what it computes.
COMPUTED = {"activation_function": ("gelu_new", "gelu_pytorch_tanh"), "scale_attn_weights": (True,),
            "scale_attn_by_inverse_layer_idx": (False,)}


def check_computed(hf_config: dict, where) -> None:
    """``UnsupportedModelError`` for a config.json whose model computes otherwise than this one (another
    activation, unscaled or layer-scaled attention): its logits would differ, silently."""
    for field, computed in COMPUTED.items():
        if field in hf_config and hf_config[field] not in computed:
            raise UnsupportedModelError(f"{where}: {field} is {hf_config[field]!r}; this GPT-2 computes "
                                        f"{computed[0]!r} only")


def check_weights(config: GPT2Config, weights: dict[str, np.ndarray]) -> None:
    """``ConfigError`` naming the first weight that is missing, not an array of real floating-point
    numbers (a complex weight would lose its imaginary part in the float32 cast), misshapen, or not
    finite (a NaN in the final layer norm never reaches the K/V a store screens: only the logits)."""
    for name, shape in weight_shapes(config).items():
        if name not in weights:
            raise ConfigError(f"weight {name} is missing")
        try:
            array = np.asarray(weights[name])
        except (TypeError, ValueError, RuntimeError) as error:
            raise ConfigError(f"weight {name} is not an array: {error}") from None
        if array.dtype.kind != "f":
            raise ConfigError(f"weight {name} has dtype {array.dtype}, expected a floating-point array")
        if array.shape != shape:
            raise ConfigError(f"weight {name} has shape {array.shape}, expected {shape}")
        if not np.isfinite(array).all():
            where = tuple(int(i) for i in np.argwhere(~np.isfinite(array))[0])
            raise ConfigError(f"weight {name} holds {array[where]} at {where}")
