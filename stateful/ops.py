"""Operations as plain data: what the lockstep machine, sweeps, replay files and the
exhaustive checker all speak.

An operation names contexts by the handle the run gave them (``c1``, ``c2``, ...
in order of creation) and carries K/V values as a seed, so a whole sequence is a
short, readable, version-independent JSON document.
"""

from __future__ import annotations

import functools

from dataclasses import asdict, dataclass, fields

import numpy as np

from kvstate.spec.layout import Layout


@dataclass(frozen=True)
class Op:
    kind = "op"
    creates = False        # whether the operation yields a new context handle

    def to_json(self) -> dict:
        return {"op": self.kind, **asdict(self)}

    def __str__(self) -> str:
        args = ", ".join(f"{name}={_shown(getattr(self, name))}" for name in _field_names(type(self)))
        return f"{self.kind}({args})"


@functools.lru_cache(maxsize=None)
def _field_names(cls: type) -> tuple[str, ...]:
    """An operation class's field names, in order: every step of a run prints its operation."""
    return tuple(f.name for f in fields(cls))


def _shown(value) -> str:
    """An argument as a counterexample prints it: a long token run as its first and last ids and its
    length (the replay file keeps every id). The last too: a query one token apart from a key at its
    end read the same as the key's (an audit, s73)."""
    if isinstance(value, tuple) and len(value) > 24:
        return f"({', '.join(map(str, value[:8]))}, ... {', '.join(map(str, value[-5:]))}; {len(value)} tokens)"
    return repr(value)


@dataclass(frozen=True)
class Allocate(Op):
    kind = "allocate"
    creates = True


@dataclass(frozen=True)
class Extend(Op):
    ctx: str
    tokens: tuple[int, ...]
    seed: int = 0
    kind = "extend"


@dataclass(frozen=True)
class Overwrite(Op):
    ctx: str
    start: int
    tokens: tuple[int, ...]
    seed: int = 0
    kind = "overwrite"


@dataclass(frozen=True)
class Fork(Op):
    ctx: str
    kind = "fork"
    creates = True


@dataclass(frozen=True)
class Truncate(Op):
    ctx: str
    n: int
    kind = "truncate"


@dataclass(frozen=True)
class Close(Op):
    ctx: str
    kind = "close"


@dataclass(frozen=True)
class Retain(Op):
    ctx: str
    kind = "retain"


@dataclass(frozen=True)
class Match(Op):
    tokens: tuple[int, ...]
    kind = "match"
    creates = True


@dataclass(frozen=True)
class Clear(Op):
    kind = "clear"


OPS: dict[str, type[Op]] = {cls.kind: cls for cls in (
    Allocate, Extend, Overwrite, Fork, Truncate, Close, Retain, Match, Clear)}


def register(cls: type[Op]) -> type[Op]:
    """Add an operation kind (snapshot and restore register themselves this way)."""
    OPS[cls.kind] = cls
    return cls


def op_from_json(data: dict) -> Op:
    """An operation from its JSON object; ``ValueError`` naming an unknown kind, a missing field or one
    the kind does not have."""
    data = dict(data)
    kind = data.pop("op", None)
    cls = OPS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"an operation of unknown kind {kind!r} (known: {', '.join(sorted(OPS))})")
    kwargs = {}
    for f in fields(cls):
        if f.name not in data:
            raise ValueError(f"operation {kind!r} without its {f.name!r} field")
        value = data.pop(f.name)
        kwargs[f.name] = tuple(value) if isinstance(value, list) else value
    if data:        # a field this build does not know: a file from another version, or edited by hand
        raise ValueError(f"operation {kind!r} with fields it does not have: {', '.join(sorted(map(str, data)))} "
                         f"(its fields: {', '.join(f.name for f in fields(cls))})")
    return cls(**kwargs)


def values_for(layout: Layout, n: int, seed: int) -> np.ndarray:
    """Deterministic K/V values for ``n`` positions: the same seed gives the same bytes everywhere.

    Mixes magnitudes, and zeroes some head vectors so q8's zero-scale path is exercised; one
    seed in four gives q8 rounding ties instead (``_q8_ties``), and one in 256 one value past
    f16's range (``_past_f16``).

    A negative seed picks from a tiny value set instead (the exhaustive checker's):
    position i of the write gets a vector fixed by ``(seed, i)`` whatever the write's
    length, so a small scope holds only a few distinct values.
    """
    if n * layout.values_per_position <= _CACHED_FLOATS:
        return _cached_values(layout, n, seed).copy()
    return _values(layout, n, seed)


LAYOUTS = ("C order", "layer-major", "Fortran order", "every other element")


def layout_of(seed: int) -> str:
    """Which of ``LAYOUTS`` a write of ``seed`` hands the engine its K/V in (``laid_out``)."""
    return LAYOUTS[_layout_index(seed)]


def _layout_index(seed: int) -> int:
    return (seed >> 2) % len(LAYOUTS)      # bits the seed's other uses (``_q8_ties``: seed % 4) leave alone


def laid_out(values: np.ndarray, seed: int) -> np.ndarray:
    """A copy of ``values`` (a write's K/V) in one of four memory layouts, chosen by the write's
    seed (``layout_of``): C order; layer-major (the positions not outermost in memory, as K/V a model
    computes layer by layer and hands over transposed); Fortran order; every other element of a
    buffer twice as wide (a strided view, as a slice of a fused K/V projection is). The same values
    every way, every stride positive (torch takes no negative stride, and no caller's tensor has one):
    a backend must read its argument by index (NumPy and torch do), not as raw memory in C order,
    which only the first layout reads right. Always a copy: what the engine is handed is never what
    the reference is."""
    kind = _layout_index(seed)
    if kind == 0 or values.ndim != 5:
        return values.copy()
    if kind == 1:
        return np.moveaxis(np.array(np.moveaxis(values, 0, 2), order="C", copy=True), 2, 0)
    if kind == 2:
        return np.array(values, order="F", copy=True)
    return np.repeat(values, 2, axis=-1)[..., ::2]


# A write's values cost tens of microseconds to draw (a seeded generator each), and the same
# (n, seed) recurs: the seeded check's configurations that refuse nothing run the same sequences,
# and Hypothesis replays prefixes. Small writes are kept, read-only, and handed out as copies.
_CACHED_FLOATS = 1024        # 4 KiB a write at most: the cache stays under 16 MiB


@functools.lru_cache(maxsize=4096)
def _cached_values(layout: Layout, n: int, seed: int) -> np.ndarray:
    values = _values(layout, n, seed)
    values.setflags(write=False)
    return values


def _values(layout: Layout, n: int, seed: int) -> np.ndarray:
    if seed < 0:
        values = np.zeros(layout.batch_shape(n), np.float32)
        for i in range(n):
            values[i] = np.random.default_rng([-seed, i]).standard_normal(layout.position_shape)
        return values
    rng = np.random.default_rng(seed)
    if seed % PAST_F16_EVERY == PAST_F16_EVERY - 1:
        return _past_f16(rng, layout.batch_shape(n))
    if seed % 4 == 3:
        return _q8_ties(rng, layout.batch_shape(n))
    scale = np.float32([1e-3, 1.0, 30.0][seed % 3])
    values = (rng.standard_normal(layout.batch_shape(n)) * scale).astype(np.float32)
    zero = rng.random(layout.batch_shape(n)[:-1]) < 0.1
    values[zero] = 0.0
    return values


# One seed in 256 (255, 511, ...): the random engines' writes then include bad input, which at f16
# both sides must refuse (``PrecisionRangeError``) leaving everything as it was, in whatever state
# the sequence has reached; f32 and q8 store it.
PAST_F16_EVERY = 256
PAST_F16 = 1e5          # f16's largest finite value is 65504


def _past_f16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Unit-scale values, one of them (at a drawn place and sign) beyond f16's range."""
    values = rng.standard_normal(shape).astype(np.float32)
    if values.size:
        values.flat[rng.integers(values.size)] = np.float32(PAST_F16 if rng.random() < 0.5 else -PAST_F16)
    return values


def _q8_ties(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Half-integers in each head vector with one element at 127: q8's scale is exactly 1, so
    most codes are ties, and a rounding rule other than half-to-even reads back other values
    (random normal values almost never land on a tie). Exact in f16 and f32 too."""
    values = (rng.integers(-127, 127, shape) + 0.5).astype(np.float32)
    peak = rng.integers(0, shape[-1], shape[:-1])
    np.put_along_axis(values, peak[..., None], np.float32(127.0), axis=-1)
    return values


@functools.lru_cache(maxsize=1 << 16)
def _position_values(layout: Layout, position: int, token: int) -> np.ndarray:
    rng = np.random.default_rng([position, token % (1 << 62), 23])
    scale = np.float32([1e-3, 1.0, 30.0][(position + token) % 3])
    values = (rng.standard_normal(layout.position_shape) * scale).astype(np.float32)
    values[rng.random(layout.position_shape[:-1]) < 0.1] = 0.0     # zero head vectors, as values_for
    values.setflags(write=False)
    return values


def prefix_values(layout: Layout, start: int, tokens) -> np.ndarray:
    """K/V values for ``tokens`` written from position ``start`` under ``values="prefix"``
    (``spec/semantics.py``): position ``i`` holding token ``t`` always gets the values fixed by
    ``(i, t)``, so equal token prefixes hold equal values, whichever write made them."""
    values = np.zeros(layout.batch_shape(len(tokens)), np.float32)
    for i, token in enumerate(tokens):
        token = int(token) if isinstance(token, (int, np.integer)) else 0     # a bad token still gets values
        values[i] = _position_values(layout, start + i, token)
    return values
