"""GPT-2 shapes, and the K/V layout a model of that shape writes into a cache."""

from __future__ import annotations

from dataclasses import dataclass

from kvstate.spec.errors import ConfigError
from kvstate.spec.layout import Layout


@dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"GPT2Config.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def layout(self) -> Layout:
        """One position's K/V: ``(n_layer, 2, n_head, head_dim)``."""
        return Layout(self.n_layer, self.n_head, self.head_dim)

    @classmethod
    def small(cls, n_positions: int = 1024) -> "GPT2Config":
        """The GPT-2-small shape: 12 layers, 12 heads, 768 wide."""
        return cls(n_positions=n_positions)

    @classmethod
    def tiny(cls, **overrides) -> "GPT2Config":
        """A shape small enough for exact-logit tests to run in milliseconds."""
        fields = dict(vocab_size=97, n_positions=256, n_embd=32, n_layer=2, n_head=4)
        fields.update(overrides)
        return cls(**fields)
