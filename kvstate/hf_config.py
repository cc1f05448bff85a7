"""Which transformers models a kvstate context can hold, and their K/V layout.

Everything here runs before any forward pass: a model kvstate cannot hold is
refused by name (``UnsupportedModelError``) while nothing has been computed,
allocated or written.
"""

from __future__ import annotations

import os

from kvstate.spec.errors import ConfigError, UnsupportedModelError
from kvstate.spec.layout import Layout

MISSING = ("kvstate.hf needs Hugging Face transformers 5.x and torch: "
           "pip install 'kvstate[hf]'")


def require_transformers():
    """The ``transformers`` module, or ``ImportError`` naming the extra to install."""
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError as error:
        raise ImportError(f"{MISSING} ({error})") from None
    major = int(transformers.__version__.split(".")[0])
    if major != 5:
        raise ImportError(f"{MISSING}; found transformers {transformers.__version__}")
    return transformers


def decoder_config(model_or_config):
    """The decoder's text config of a model or a config; encoder-decoders are refused, and anything
    else by name (a checkpoint's name, None: an AttributeError deep in transformers before)."""
    from transformers import PretrainedConfig

    config = getattr(model_or_config, "config", model_or_config)
    if not isinstance(config, PretrainedConfig):
        hint = " (load the model first, e.g. AutoModelForCausalLM.from_pretrained(name))" \
            if isinstance(model_or_config, (str, os.PathLike)) else ""
        raise ConfigError(f"kvstate.hf needs a transformers model or its config, got "
                          f"{type(model_or_config).__name__}{hint}")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(config).__name__} is an encoder-decoder; kvstate.hf holds decoder-only models")
    check_text_only(config)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(text, "add_cross_attention", False):
        raise UnsupportedModelError(
            f"{type(text).__name__} has cross-attention (add_cross_attention=True); "
            "kvstate.hf holds decoder-only self-attention")
    return text


# Inputs besides token ids that the K/V of a multimodal model's positions come from: kvstate keys K/V by
# token ids, so a prefix hit through an image's placeholder ids served another image's K/V.
_OTHER_INPUTS = ("vision_config", "audio_config", "speech_config", "image_token_index", "image_token_id",
                 "video_token_index", "video_token_id", "audio_token_index", "audio_token_id")


def check_text_only(config) -> None:
    """A model whose K/V come from images or audio too is refused by name (an outside audit, s69: a
    Llava request with another image hit the first image's K/V through its placeholder ids)."""
    found = next((name for name in _OTHER_INPUTS if getattr(config, name, None) is not None), None)
    if found is not None:
        raise UnsupportedModelError(
            f"{type(config).__name__} computes K/V from images or audio as well as token ids ({found}); kvstate "
            "keeps K/V by token ids, so a prefix hit would serve one image's K/V for another's: kvstate.hf holds "
            "text-only decoders")


# transformers' rotary types whose frequencies follow the sequence's current length (``dynamic_rope_update``)
_LENGTH_DEPENDENT_ROPE = frozenset(("dynamic", "longrope"))


def length_dependent_rope(config) -> str | None:
    """The rotary type of ``config`` whose K/V depend on the length of the sequence that computed them, if
    any: a prefix hit would serve a long request's rotations to a shorter one (1e-4 to 1e-3 off
    transformers' logits; an outside audit, s69). One conversation, continued or cut back, is exact."""
    for name in ("rope_parameters", "rope_scaling"):
        found = getattr(config, name, None)
        kinds = [found] + (list(found.values()) if isinstance(found, dict) else [])    # per layer type too
        for kind in kinds:
            if isinstance(kind, dict):
                rope = kind.get("rope_type", kind.get("type"))
                if rope in _LENGTH_DEPENDENT_ROPE:
                    return rope
    return None


# How a model places a left-padded row, given no position_ids (an outside review, s70, ran each against the
# row alone): ALiBi models' K/V do not depend on where a row sits (a bias linear in the key index, which the
# softmax cancels for a uniform shift); OPT numbers positions from the mask's cumulative sum; every other
# model counts the padding (transformers' ``cache_position``), RoFormer too, which takes no position_ids.
ALIBI, FROM_THE_MASK, PADDING_COUNTED = "alibi", "from the mask", "padding counted"
_ALIBI = frozenset(("bloom", "mpt"))
_FROM_THE_MASK = frozenset(("opt",))


def position_numbering(config) -> str:
    """``ALIBI``, ``FROM_THE_MASK`` or ``PADDING_COUNTED``: how ``config``'s model places a left-padded row's
    tokens given no position_ids (see above; Falcon is ALiBi where ``config.alibi``)."""
    config = decoder_config(config)
    kind = getattr(config, "model_type", None)
    if kind in _ALIBI or (kind == "falcon" and bool(getattr(config, "alibi", False))):
        return ALIBI
    return FROM_THE_MASK if kind in _FROM_THE_MASK else PADDING_COUNTED


def check_attention(config) -> None:
    """Every layer must be full (global) attention: a sliding window drops old positions and a
    linear-attention layer keeps a recurrent state, neither of which is a per-position K/V."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    layer_types, _ = get_layer_types_and_kwargs(config)
    for index, kind in enumerate(layer_types):
        if kind != "full_attention":
            raise UnsupportedModelError(
                f"layer {index} of {type(config).__name__} is {kind!r}; kvstate.hf holds full-attention layers only")


def check_kv_shape(config) -> None:
    """K/V whose shape the config's head counts do not describe are refused by name, before a
    forward pass: DeepSeek's multi-head latent attention caches a compressed latent (its K and V
    differ in width from ``head_dim``), and Falcon's original ``multi_query=True`` shares one K/V
    head that no ``num_key_value_heads`` names."""
    if getattr(config, "kv_lora_rank", None):
        raise UnsupportedModelError(
            f"{type(config).__name__} uses multi-head latent attention (kv_lora_rank={config.kv_lora_rank}): "
            "its cached K and V are not per-head K/V of one head_dim; kvstate.hf does not hold it")
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        raise UnsupportedModelError(
            f"{type(config).__name__} with multi_query=True shares one K/V head across all query heads, "
            "which its config does not state as num_key_value_heads; kvstate.hf does not hold it")


def layout_of(model_or_config) -> Layout:
    """``Layout(layers, kv_heads, head_dim)`` of a decoder-only full-attention model.

    ``kv_heads`` is ``num_key_value_heads`` where the config has one (grouped-query
    attention stores fewer K/V heads than query heads), else ``num_attention_heads``.
    """
    model = model_or_config if hasattr(model_or_config, "config") else None
    config = decoder_config(model_or_config)
    if model is not None and hasattr(model, "_supports_default_dynamic_cache") \
            and not model._supports_default_dynamic_cache():
        raise UnsupportedModelError(
            f"{type(model).__name__} does not use a per-layer K/V cache (a recurrent or hybrid model)")
    check_attention(config)
    check_kv_shape(config)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if getattr(config, "new_decoder_architecture", False):      # Falcon's own name for its K/V head count
        kv_heads = getattr(config, "num_kv_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return Layout(int(config.num_hidden_layers), int(kv_heads), int(head_dim))


def check_layout(expected: Layout, found: Layout, what: str) -> None:
    if expected != found:
        raise UnsupportedModelError(
            f"{what} has layout {found}, but the model's config needs {expected} "
            "(layers, kv_heads incl. grouped-query attention, head_dim)")
