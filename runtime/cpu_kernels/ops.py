"""Loading ``runtime._cpu_kernels`` and typed wrappers of its kernels over torch tensors.

The extension takes addresses and sizes; these wrappers check shapes, dtypes and strides and
pass ``data_ptr()``s, so tests and callers outside the hot loop cannot hand it a bad pointer.
The decode step (:mod:`runtime.models.llama_decode`) prepares its addresses once and calls
the extension directly.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from runtime.errors import EmberRuntimeError

ENV = "EMBER_CPU_KERNELS"
CHOICES = ("auto", "avx512", "avx2", "generic", "off")

# The extension's dtype codes (ck.h, enum ck_dtype).
F32, BF16, Q8_0, Q4_1, F16 = 0, 1, 2, 3, 4
ACCUMULATE, ROUND_BF16, X_BF16, X_Q8 = 1, 2, 4, 8
_FLOAT_CODES = {torch.float32: F32, torch.bfloat16: BF16, torch.float16: F16}
_GROUP = 32


class CpuKernelError(EmberRuntimeError):
    """The CPU kernels were asked for something they do not support, or are not built."""

    code = "cpu_kernel_error"


def load(choice: str | None = None) -> ModuleType | None:
    """The extension on the path ``choice`` (default: ``$EMBER_CPU_KERNELS``, else ``auto``).

    ``None`` when the choice is ``off`` or the extension is not built (the torch path runs
    then); a bad choice, or ``avx512``/``avx2`` on a CPU without it, fails loudly."""
    choice = choice if choice is not None else os.environ.get(ENV, "auto")
    if choice not in CHOICES:
        raise CpuKernelError(f"{ENV} must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "off":
        return None
    try:
        # torch is imported above: its libgomp is loaded first and serves the extension too.
        from runtime import _cpu_kernels
    except ImportError:
        if choice != "auto":
            raise CpuKernelError(f"{ENV}={choice} but runtime._cpu_kernels is not built") from None
        return None
    try:
        _cpu_kernels.set_isa(choice)
    except ValueError as exc:
        raise CpuKernelError(str(exc)) from None
    return _cpu_kernels


def available_isas() -> tuple[str, ...]:
    """The kernel paths this CPU runs, portable first (empty when the extension is not built);
    the extension keeps the path it had."""
    try:
        from runtime import _cpu_kernels
    except ImportError:
        return ()
    current = _cpu_kernels.isa()
    found = []
    for isa in ("generic", "avx2", "avx512"):
        try:
            _cpu_kernels.set_isa(isa)
        except ValueError:  # this CPU lacks it
            continue
        found.append(isa)
    _cpu_kernels.set_isa(current)
    return tuple(found)


def float_code(dtype: torch.dtype) -> int:
    code = _FLOAT_CODES.get(dtype)
    if code is None:
        raise CpuKernelError(f"dtype {dtype} is not a float dtype the kernels read")
    return code


@dataclass(frozen=True)
class Weight:
    """One (out_features, in_features) matrix in a layout the kernels read.

    ``data`` is fp32/bf16 (out, in), q8_0 int8 (out, in) or q4_1 uint8 (out, in/2) with
    float16 ``scales`` (out, in/32) and, for q4_1, ``mins``; ``bias`` is (out,) or None."""

    data: torch.Tensor
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        d = self.data
        if d.dim() != 2 or not d.is_contiguous() or d.device.type != "cpu":
            raise CpuKernelError("weights must be contiguous 2-D CPU tensors")
        if self.kind in (Q8_0, Q4_1):
            groups = (self.in_features // _GROUP,)
            want = [self.scales] if self.kind == Q8_0 else [self.scales, self.mins]
            for t in want:
                if t is None or t.dtype != torch.float16 or tuple(t.shape) != (d.shape[0], *groups):
                    raise CpuKernelError(f"quantized weights need float16 scales/mins of shape {groups}")
                if not t.is_contiguous():
                    raise CpuKernelError("scales and mins must be contiguous")
            if self.in_features % _GROUP:
                raise CpuKernelError("quantized weights need in_features % 32 == 0")
        if self.bias is not None:
            if tuple(self.bias.shape) != (self.out_features,) or not self.bias.is_contiguous():
                raise CpuKernelError("bias must be a contiguous (out_features,) tensor")
            float_code(self.bias.dtype)

    @property
    def kind(self) -> int:
        if self.data.dtype == torch.int8:
            return Q8_0
        if self.data.dtype == torch.uint8:
            return Q4_1
        code = float_code(self.data.dtype)
        if code == F16:
            raise CpuKernelError("float16 weights are not supported (bfloat16, float32, q8_0, q4_1 are)")
        return code

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.data.shape[1]) * (2 if self.kind == Q4_1 else 1)

    @classmethod
    def from_table(cls, table: Mapping[str, torch.Tensor], name: str, bias: str | None = None) -> Weight:
        """``table[name]`` with its ``.scales``/``.mins`` companions when quantized."""
        return cls(table[name], table.get(name + ".scales"), table.get(name + ".mins"), table.get(bias or ""))

    def descriptor(self) -> list[int]:
        """The extension's 8 int64: dtype, data, scales, mins, bias, bias dtype, out, 0."""
        b = self.bias
        return [
            self.kind,
            self.data.data_ptr(),
            self.scales.data_ptr() if self.scales is not None else 0,
            self.mins.data_ptr() if self.mins is not None else 0,
            b.data_ptr() if b is not None else 0,
            float_code(b.dtype) if b is not None else 0,
            self.out_features,
            0,
        ]

    def dequantize(self) -> torch.Tensor:
        """fp32 (out, in): the reference the kernels are tested against."""
        kind = self.kind
        if kind in (F32, BF16):
            return self.data.float()
        assert self.scales is not None
        s = self.scales.float().repeat_interleave(_GROUP, dim=1)
        if kind == Q8_0:
            return self.data.float() * s
        assert self.mins is not None
        q = torch.stack((self.data & 15, self.data >> 4), dim=-1).reshape(self.out_features, -1)
        return q.float() * s + self.mins.float().repeat_interleave(_GROUP, dim=1)


def descriptors(weights: Sequence[Weight]) -> torch.Tensor:
    """int64 (n, 8): what ``linear`` reads (keep it, and the weights, alive while in use)."""
    return torch.tensor([w.descriptor() for w in weights], dtype=torch.int64)


def _rows(x: torch.Tensor, width: int, name: str) -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] != width:
        raise CpuKernelError(f"{name} must be float32 (rows, {width}) with unit column stride")


def _threads(threads: int | None) -> int:
    return torch.get_num_threads() if threads is None else threads


def linear(
    ext: ModuleType,
    x: torch.Tensor,
    weights: Sequence[Weight],
    out: torch.Tensor | None = None,
    *,
    accumulate: bool = False,
    round_bf16: bool = False,
    swiglu: bool = False,
    x_bf16: bool = False,
    x_q8: bool = False,
    threads: int | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for each weight, side by side (swiglu: ``silu(gate) * up``).

    ``x_bf16``: every x value is a bfloat16 (as a bf16 model's activations are), so bf16
    weights may use bf16 dot products (the AVX-512 path); other x would be rounded.
    ``x_q8``: q8_0 weights may meet x quantized to int8 per group of 32 (the AVX2 path's
    integer dot products, as llama.cpp's Q8_0 does; see ck.h's CK_X_Q8)."""
    if not weights:
        raise CpuKernelError("linear needs at least one weight")
    k = weights[0].in_features
    if any(w.in_features != k for w in weights):
        raise CpuKernelError("all weights of one call share in_features")
    _rows(x, k, "x")
    cols = weights[0].out_features if swiglu else sum(w.out_features for w in weights)
    if out is None:
        if accumulate:
            raise CpuKernelError("accumulate needs an out tensor")
        out = torch.empty(x.shape[0], cols, dtype=torch.float32)
    _rows(out, cols, "out")
    if out.shape[0] != x.shape[0]:
        raise CpuKernelError("out must have one row per row of x")
    desc = descriptors(weights)
    flags = (ACCUMULATE if accumulate else 0) | (ROUND_BF16 if round_bf16 else 0)
    flags |= (X_BF16 if x_bf16 else 0) | (X_Q8 if x_q8 else 0)
    ext.linear(
        _threads(threads), desc.data_ptr(), len(weights), x.data_ptr(), x.stride(0), x.shape[0], k,
        out.data_ptr(), out.stride(0), flags, int(swiglu),
    )  # fmt: skip
    return out


def rms_norm(
    ext: ModuleType, x: torch.Tensor, weight: torch.Tensor, eps: float, *, round_bf16: bool = False
) -> torch.Tensor:
    """``rms_norm(x) * weight`` per row, fp32 out."""
    e = int(weight.shape[0])
    _rows(x, e, "x")
    if not weight.is_contiguous():
        raise CpuKernelError("the norm weight must be contiguous")
    out = torch.empty(x.shape[0], e, dtype=torch.float32)
    ext.rms_norm(
        x.data_ptr(), x.stride(0), 0, out.data_ptr(), e, weight.data_ptr(), float_code(weight.dtype),
        x.shape[0], e, eps, int(round_bf16),
    )  # fmt: skip
    return out


def rope_table(inv_freq: torch.Tensor, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (positions, D/2), float32, computed as the torch path computes them."""
    freqs = torch.arange(positions).float()[:, None] * inv_freq.float()[None, :]
    return freqs.cos().contiguous(), freqs.sin().contiguous()


def rope(
    ext: ModuleType,
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    round_bf16: bool = False,
) -> None:
    """Rotate x (N, heads, D) float32 in place by the positions (N,) int64."""
    if x.dtype != torch.float32 or x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise CpuKernelError("x must be float32 (N, heads, D) with contiguous heads")
    n, heads, d = x.shape
    _check_positions(positions, n, cos, sin, d)
    ext.rope(
        x.data_ptr(), x.stride(0), heads, d, positions.data_ptr(), n, cos.data_ptr(), sin.data_ptr(),
        int(round_bf16),
    )  # fmt: skip


def _check_positions(positions: torch.Tensor, n: int, cos: torch.Tensor, sin: torch.Tensor, d: int) -> None:
    if positions.dtype != torch.int64 or tuple(positions.shape) != (n,) or not positions.is_contiguous():
        raise CpuKernelError("positions must be contiguous int64 (N,)")
    for t in (cos, sin):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.dim() != 2 or t.shape[1] != d // 2:
            raise CpuKernelError("cos/sin must be contiguous float32 (max_position, D/2)")
    if n and (int(positions.min()) < 0 or int(positions.max()) >= cos.shape[0]):
        raise CpuKernelError("a position is outside the cos/sin table")


@dataclass(frozen=True)
class KVLayout:
    """Where one layer's K and V live in a (num_blocks, L, 2, BS, H_kv, D) cache tensor."""

    address: int  # kv_blocks[0, layer, 0, 0, 0, 0]
    dtype: int
    block_stride: int  # elements
    block_size: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, kv_blocks: torch.Tensor, layer: int) -> KVLayout:
        kv = kv_blocks
        if kv.dim() != 6 or kv.device.type != "cpu" or kv.dtype not in (torch.float32, torch.bfloat16):
            raise CpuKernelError("kv_blocks must be a float32/bfloat16 CPU tensor (NB, L, 2, BS, H_kv, D)")
        _, layers, _, bs, hkv, d = kv.shape
        if kv.stride()[1:] != (2 * bs * hkv * d, bs * hkv * d, hkv * d, d, 1):
            raise CpuKernelError("each block of kv_blocks must be contiguous")
        if not 0 <= layer < layers:
            raise CpuKernelError(f"layer {layer} is out of range")
        address = kv.data_ptr() + layer * kv.stride(1) * kv.element_size()
        return cls(address, float_code(kv.dtype), kv.stride(0), bs, hkv, d)


def kv_write(
    ext: ModuleType,
    kv_blocks: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Store k and v (N, H_kv, D) float32 at the slots (N,) int64 of ``layer``."""
    lay = KVLayout.of(kv_blocks, layer)
    row = lay.kv_heads * lay.head_dim
    n = int(slots.shape[0])
    for t in (k, v):
        if t.dtype != torch.float32 or tuple(t.shape) != (n, lay.kv_heads, lay.head_dim):
            raise CpuKernelError("k and v must be float32 (N, H_kv, D)")
    if k.stride() != v.stride() or k.stride()[1:] != (lay.head_dim, 1):
        raise CpuKernelError("k and v must share strides, heads contiguous")
    if slots.dtype != torch.int64 or not slots.is_contiguous():
        raise CpuKernelError("slots must be contiguous int64")
    if n and (int(slots.min()) < 0 or int(slots.max()) >= kv_blocks.shape[0] * lay.block_size):
        raise CpuKernelError("a slot is outside the cache")
    ext.kv_write(
        k.data_ptr(), v.data_ptr(), k.stride(0), lay.address, lay.dtype, lay.block_stride, lay.block_size,
        row, slots.data_ptr(), n,
    )  # fmt: skip


def paged_decode_attention(
    ext: ModuleType,
    q: torch.Tensor,
    kv_blocks: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    rows: torch.Tensor | None = None,
    *,
    round_bf16: bool = False,
    threads: int | None = None,
) -> torch.Tensor:
    """Attention of q (N, H, D) float32 over each row's context, read in place: (N, H*D).

    Row i attends to the first ``context_lens[i]`` tokens of the sequence whose block table
    is ``block_tables[rows[i]]`` (default: row i)."""
    lay = KVLayout.of(kv_blocks, layer)
    if q.dtype != torch.float32 or q.dim() != 3 or q.stride()[1:] != (q.shape[2], 1):
        raise CpuKernelError("q must be float32 (N, H, D) with contiguous heads")
    n, heads, d = q.shape
    if d != lay.head_dim or heads % lay.kv_heads:
        raise CpuKernelError("q's heads must be a multiple of the cache's, with its head_dim")
    if rows is None:
        rows = torch.arange(n)
    tables = block_tables.contiguous()
    for name, t in (("context_lens", context_lens), ("rows", rows)):
        if t.dtype != torch.int64 or tuple(t.shape) != (n,) or not t.is_contiguous():
            raise CpuKernelError(f"{name} must be contiguous int64 (N,)")
    if tables.dtype != torch.int64 or tables.dim() != 2:
        raise CpuKernelError("block_tables must be int64 (B, width)")
    if n and (int(rows.min()) < 0 or int(rows.max()) >= tables.shape[0]):
        raise CpuKernelError("a row is outside the block tables")
    if tables.numel() and (int(tables.min()) < 0 or int(tables.max()) >= kv_blocks.shape[0]):
        raise CpuKernelError("a block table names a block outside the cache")
    out = torch.empty(n, heads * d, dtype=torch.float32)
    ext.paged_decode_attention(
        _threads(threads), q.data_ptr(), q.stride(0), lay.address, lay.dtype, lay.block_stride,
        lay.block_size, heads, lay.kv_heads, d, tables.data_ptr(), tables.shape[1], rows.data_ptr(),
        context_lens.data_ptr(), n, out.data_ptr(), heads * d, d**-0.5, int(round_bf16),
    )  # fmt: skip
    return out


def embedding(ext: ModuleType, weight: Weight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (N,) int64 of the weight, as float32 (N, in_features)."""
    if ids.dtype != torch.int64 or ids.dim() != 1 or not ids.is_contiguous():
        raise CpuKernelError("ids must be contiguous int64 (N,)")
    e = weight.in_features
    out = torch.empty(ids.shape[0], e, dtype=torch.float32)
    desc = descriptors([weight])
    ext.embedding(desc.data_ptr(), ids.data_ptr(), ids.shape[0], e, out.data_ptr(), e)
    return out
