"""The torch page store, on CPU or CUDA (the backend factories are ``impl/torch.py``).

Pages have the NumPy store's layout, as torch tensors on one device:
``(values,)`` of shape ``(layers, 2, page_tokens, kv_heads, head_dim)`` for f32/f16,
plus float32 ``scales`` ``(layers, 2, page_tokens, kv_heads)`` for q8. With an arena,
they are views into one preallocated tensor per component.

Encoding follows ``kvstate.spec.precision`` operation for operation in float32
(``torch.round`` rounds half to even, like ``np.rint``), so every read is
bit-identical to the NumPy store's. Validation costs one scalar device-to-host
sync per write batch; fork, copy-on-write and extend otherwise stay on the device.
Reads return float32 tensors on the store's device.

This module is named ``torch`` inside ``kvstate.impl``; absolute imports make
``import torch`` below the real library.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from kvstate.spec import precision as precisions
from kvstate.spec.errors import ConfigError, DTypeError, NonFiniteError, PrecisionRangeError
from kvstate.spec.layout import Layout

from .arena import SlotArena
from .memory import check_store_size
from .snapshot_tuning import TORCH_CONVERSION_BYTES
from .store import StoreCounters

VALUE_DTYPES = {"f32": torch.float32, "f16": torch.float16, "q8": torch.int8}


def _ordinary(make):
    """``make`` (a method that makes or hands out page memory) run outside ``torch.inference_mode``.

    Under inference mode torch makes *inference tensors*, and views made there of ordinary
    tensors are marked too: neither may be written in place once inference mode is off. A page is
    written long after it is made (the next decode fills its free rows; a restore's pages are
    written by the next turn), so a cache filled under ``inference_mode`` and continued under
    ``no_grad`` failed on its first write. Page memory and its views are therefore always
    ordinary tensors, which may be written in place in either mode."""
    @functools.wraps(make)
    def outside_inference_mode(*args, **kwargs):
        if not torch.is_inference_mode_enabled():
            return make(*args, **kwargs)
        with torch.inference_mode(False):
            return make(*args, **kwargs)
    return outside_inference_mode
_Q8_MAX = float(precisions.Q8_MAX)
_Q8_SCALE_MAX = float(precisions.Q8_SCALE_MAX)      # exactly representable in float32


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _refuse_unusable(device: torch.device, asked) -> None:
    """``ConfigError`` now for a device this torch cannot keep values on: ``meta`` keeps shapes only
    (the cache was built and its first extend failed with a bare ``RuntimeError``), and a backend this
    torch was built without (``xpu``, ``hpu``) raised ``AssertionError`` or ``ImportError`` from torch."""
    if device.type == "cpu":
        return
    try:
        probe = torch.zeros(1, device=device)
    except Exception as error:     # noqa: BLE001 - torch's own refusal, whatever its class
        raise ConfigError(f"device {asked!r} cannot be used by this torch: {error!r}") from None
    if probe.is_meta:
        raise ConfigError(f"device {asked!r} keeps no values (a meta tensor has a shape only): use 'cpu' or 'cuda'")


class TorchBuffer:
    __slots__ = ("tensors", "slot")

    def __init__(self, tensors: tuple[torch.Tensor, ...], slot: int | None):
        self.tensors = tensors
        self.slot = slot


class TorchStore:
    conversion_bytes = TORCH_CONVERSION_BYTES      # what a restore from another precision costs a number here

    def __init__(self, layout: Layout, page_tokens: int, precision: str, arena_pages: int = 0,
                 device: str | torch.device = "cpu"):
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise ConfigError(f"not a torch device: {device!r} ({error})") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} asked for, but torch sees no CUDA device")
        _refuse_unusable(self.device, device)
        self.layout = layout
        self.page_tokens = page_tokens
        self.precision = precisions.check_precision(precision)
        self.arena_pages = arena_pages
        self.counters = StoreCounters()
        self._shapes = [layout.page_shape(page_tokens)]
        self._dtypes = [VALUE_DTYPES[precision]]
        if precision == "q8":
            self._shapes.append(layout.page_shape(page_tokens)[:-1])
            self._dtypes.append(torch.float32)
        self.page_bytes = sum(math.prod(s) * d.itemsize for s, d in zip(self._shapes, self._dtypes))
        if self.device.type == "cpu":
            check_store_size(self.page_bytes, arena_pages)
        self._arena = SlotArena(arena_pages, self.counters)
        try:
            self._blocks = _ordinary(lambda: [torch.zeros((arena_pages, *s), dtype=d, device=self.device)
                                              for s, d in zip(self._shapes, self._dtypes)])()
        except (MemoryError, RuntimeError, ValueError, TypeError) as error:   # out of memory; a size past int64 (TypeError)
            raise ConfigError(f"an arena of {arena_pages} pages of {self.page_bytes} bytes cannot be allocated "
                              f"on {self.device}: {error!r}") from None

    # -- encoding (validation happens here, before anything is written) -----------

    def _as_tensor(self, kv) -> torch.Tensor:
        """A private float32 copy of ``kv`` on the store's device, detached from any autograd graph.

        A cache stores values, not their history: a tensor with ``requires_grad`` (a model
        run outside ``no_grad``) is detached on the way in, so no page or arena block joins
        the graph. The copy is taken before any check, so what was checked is what is stored.
        """
        if isinstance(kv, torch.Tensor):
            try:
                # a plain tensor: a subclass's hooks (``__torch_function__``) must not run again inside
                # the write, after pages have been taken, where an exception would leave it half done
                return kv.detach().to(device=self.device, dtype=torch.float32, copy=True).as_subclass(torch.Tensor)
            except (RuntimeError, NotImplementedError) as error:    # a meta or sparse tensor holds no values
                raise DTypeError(f"cannot take K/V values from a {kv.layout} tensor on {kv.device}: {error}") from None
        if not isinstance(kv, np.ndarray):
            raise DTypeError(f"the torch store takes torch tensors or NumPy arrays, got {type(kv).__name__}")
        # a C-ordered copy: torch takes no negative strides (a reversed view such as ``kv[::-1]``)
        return torch.from_numpy(np.array(kv, dtype=np.float32, copy=True, order="C")).to(self.device)

    def encode(self, kv) -> tuple[torch.Tensor, ...]:
        x = self._as_tensor(kv)
        finite = torch.isfinite(x).all()
        if self.precision == "f16":
            half = x.to(torch.float16)
            ok = torch.stack([finite, torch.isfinite(half).all()]).tolist()   # the one sync
            _refuse_nonfinite(x, ok[0])
            if not ok[1]:
                bad = tuple(int(i) for i in torch.nonzero(~torch.isfinite(half))[0].tolist())
                raise PrecisionRangeError(
                    f"K/V value {float(x[bad])} at index {bad} overflows f16 (|x| >= {precisions.F16_OVERFLOW})")
            encoded = (half,)
        else:
            _refuse_nonfinite(x, bool(finite))                                 # the one sync
            encoded = _q8_encode(x) if self.precision == "q8" else (x,)      # x is already a private copy
        # position-major batch -> layer-major rows, the page's own order
        return tuple(part.movedim(0, 2) for part in encoded)

    def recycle(self, encoded) -> None:
        """Nothing to hand on: each encode's tensors are the caching allocator's to reuse."""

    # -- memory ----------------------------------------------------------------------

    @_ordinary
    def _take(self, page_id: int, zero: bool) -> TorchBuffer:
        slot = self._arena.issue(page_id)
        if slot is None:
            return TorchBuffer(tuple(torch.zeros(s, dtype=d, device=self.device)
                                     for s, d in zip(self._shapes, self._dtypes)), None)
        try:        # the slot back if zeroing it fails or is interrupted: else it stayed out for good
            tensors = tuple(block[slot] for block in self._blocks)
            if zero:
                # A recycled slot still holds the last page's bytes: zero it on issue.
                for tensor in tensors:
                    tensor.zero_()
            return TorchBuffer(tensors, slot)
        except BaseException:
            self._arena.give_back(slot)
            raise

    def allocate(self, page_id: int) -> TorchBuffer:
        return self._take(page_id, zero=True)

    def free_all(self, buffers) -> None:
        """``free`` of each buffer; failing part way, the rest are freed before re-raising (as the NumPy store)."""
        pending = iter(buffers)
        try:
            for buffer in pending:
                self.free(buffer)
        except BaseException:
            self.free_all(list(pending))
            raise

    def free(self, buffer: TorchBuffer) -> None:
        self._arena.give_back(buffer.slot)
        buffer.tensors = ()

    def copy(self, source: TorchBuffer, page_id: int) -> TorchBuffer:
        target = self._take(page_id, zero=False)   # every byte is overwritten below
        try:        # a device error or an interrupt: the slot back, or it stayed out for good
            for dst, src in zip(target.tensors, source.tensors):
                dst.copy_(src)
            self.counters.pages_copied += 1
            self.counters.bytes_copied += self.page_bytes
        except BaseException:
            self._arena.give_back(target.slot)
            target.tensors = ()
            raise
        return target

    # -- values ----------------------------------------------------------------------

    def write(self, buffer: TorchBuffer, offset: int, encoded: tuple[torch.Tensor, ...], lo: int, hi: int) -> None:
        for dst, src in zip(buffer.tensors, encoded):
            dst[:, :, offset:offset + hi - lo] = src[:, :, lo:hi]

    def write_whole(self, buffers: list[TorchBuffer], encoded: tuple[torch.Tensor, ...], row: int) -> None:
        """``write`` of whole pages, one page's rows each from ``row`` on: the rows cut into pages by
        one reshape and ``unbind``, not two slices a page (as the NumPy store)."""
        pages, page_tokens = len(buffers), self.page_tokens
        for part, rows in enumerate(encoded):
            rows = rows[:, :, row:row + pages * page_tokens]
            by_page = rows.reshape(*rows.shape[:2], pages, page_tokens, *rows.shape[3:]).movedim(2, 0)
            for buffer, page_rows in zip(buffers, by_page.unbind(0)):
                buffer.tensors[part].copy_(page_rows)

    def read(self, buffer: TorchBuffer, start: int, stop: int) -> torch.Tensor:
        return self._decoded(tuple(tensor[:, :, start:stop] for tensor in buffer.tensors))

    def read_spans(self, spans: list[tuple[TorchBuffer, int, int]]) -> torch.Tensor:
        """What ``concat`` of ``read`` over ``spans`` (each ``(buffer, start, stop)``) returns: the pages'
        rows joined per part (one ``cat``), then decoded and moved once, where a read page by page
        paid four tensor operations a page (at one-token pages, thousands of them a read)."""
        if len(spans) == 1:
            return self.read(*spans[0])
        whole = self.page_tokens
        return self._decoded(tuple(
            torch.cat([buffer.tensors[i] if hi - lo == whole else buffer.tensors[i][:, :, lo:hi]
                       for buffer, lo, hi in spans], dim=2)
            for i in range(len(spans[0][0].tensors))))

    def _decoded(self, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Layer-major rows (slices of pages, or rows joined from several) as fresh position-major float32."""
        if self.precision == "q8":
            codes, scales = parts
            values = codes.to(torch.float32) * scales.unsqueeze(-1)
        elif self.precision == "f32":
            # A copy always, like the NumPy store's: ``contiguous()`` alone hands back the page
            # itself when the slice already is contiguous (one layer, one position per page).
            return parts[0].movedim(2, 0).clone(memory_format=torch.contiguous_format)
        else:
            values = parts[0].to(torch.float32)
        return values.movedim(2, 0).contiguous()

    def stored_spans(self, spans: list[tuple[TorchBuffer, int, int]]) -> tuple[torch.Tensor, ...]:
        """A copy of the stored rows of ``spans`` (each ``(buffer, start, stop)``), joined per stored
        part in ``encode``'s layer-major form, on the store's device: what ``write`` takes back as they
        are (an overwrite keeps them to undo itself). One ``cat`` a part, a copy even for one span."""
        return tuple(torch.cat([buffer.tensors[i][:, :, lo:hi] for buffer, lo, hi in spans], dim=2)
                     for i in range(len(spans[0][0].tensors)))

    def read_encoded(self, buffer: TorchBuffer, start: int, stop: int) -> tuple[np.ndarray, ...]:
        # Snapshots are host files: this is the one deliberate device-to-host copy.
        return tuple(t[:, :, start:stop].movedim(2, 0).cpu().numpy() for t in buffer.tensors)

    @_ordinary
    def from_encoded(self, parts: tuple[np.ndarray, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(torch.from_numpy(np.ascontiguousarray(p)).to(self.device).movedim(0, 2) for p in parts)

    def read_layer(self, buffer: TorchBuffer, layer: int, start: int, stop: int):
        parts = tuple(t[layer, :, start:stop] for t in buffer.tensors)
        if self.precision == "q8":
            codes, scales = parts
            decoded = codes.to(torch.float32) * scales.unsqueeze(-1)
        else:
            decoded = parts[0].to(torch.float32)      # a view for f32: gather copies
        return decoded[0], decoded[1]

    def gather(self, parts: list[torch.Tensor], layer_shape: tuple[int, ...]) -> torch.Tensor:
        if not parts:
            return torch.zeros(layer_shape, dtype=torch.float32, device=self.device)
        return torch.cat(parts)

    def read_empty(self) -> torch.Tensor:
        return torch.zeros(self.layout.batch_shape(0), dtype=torch.float32, device=self.device)

    def concat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def is_zero_from(self, buffer: TorchBuffer, offset: int) -> bool:
        return not any(bool(tensor[:, :, offset:].any()) for tensor in buffer.tensors)

    def arena_books(self) -> tuple[int, dict[int, int], tuple[int, ...]]:
        return self._arena.books()


def _refuse_nonfinite(x: torch.Tensor, finite: bool) -> None:
    if not finite:
        bad = tuple(int(i) for i in torch.nonzero(~torch.isfinite(x))[0].tolist())
        raise NonFiniteError(f"K/V value at index {bad} is {float(x[bad])}")


def _q8_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kvstate.spec.precision.q8_encode`` in torch, step for step in float32."""
    peak = x.abs().amax(dim=-1)
    # Divide by a tensor, not a Python scalar: torch may turn ``t / scalar`` into
    # ``t * (1 / scalar)``, which rounds differently from NumPy's true division.
    scales = torch.clamp(peak / torch.full_like(peak, _Q8_MAX), max=_Q8_SCALE_MAX)
    positive = (scales > 0).unsqueeze(-1)
    safe = torch.where(positive, scales.unsqueeze(-1), torch.ones_like(x[..., :1]))
    ratio = torch.where(positive, x / safe, torch.zeros_like(x))
    codes = torch.clamp(torch.round(ratio), -_Q8_MAX, _Q8_MAX).to(torch.int8)
    return codes, scales
