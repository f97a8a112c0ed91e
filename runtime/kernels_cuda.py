"""CUDA kernels of the paged-attention engine: KV write and paged decode attention.

Both work directly on torch CUDA tensors: the kernels are :class:`cupy.RawKernel`s that get
raw device addresses (``tensor.data_ptr()``) and run on torch's current stream, so they are
ordered with the torch ops around them and the torch caching allocator may free a temporary
as soon as the launch is enqueued (its memory is only reused by later work on that stream).

* :func:`write_kv` stores the new K and V of one layer into the paged cache at given slots
  (``slot = block * BS + offset``), through the strides of ``kv_blocks``: the cache may be a
  strided view over the pool arena whose blocks lie ``block_bytes`` apart
  (:func:`runtime.engine.kv_storage.arena_kv_view`).
* :func:`paged_decode_attention` is one query token per sequence attending to its whole
  cached context, read block by block through the sequence's row of the block table: the
  CUDA counterpart of the gather in :meth:`runtime.models.llama.LlamaModel._decode_attention`
  (Tangram's E-Attention: attention over non-contiguous physical blocks, no gather copy).

``kv_blocks`` has shape (num_blocks, L, 2, BS, H_kv, D) as everywhere in the runtime.
Supported dtypes: float32, float16, bfloat16; arithmetic is float32.

Half types without headers: the kernels include no CUDA header (``cuda_fp16.h`` and
``cuda_bf16.h`` are not on NVRTC's default include path everywhere, and pip-installed CuPy
does not always ship them), so 16-bit values are moved as ``unsigned short`` bits in two
tag structs. fp16 converts with the PTX ``cvt`` instructions that ``__half2float`` and
``__float2half_rn`` compile to; bf16 is the top half of a float32, widened by a shift and
narrowed with round-to-nearest-even (NaN kept quiet), as ``__float2bfloat16_rn`` does.
:func:`write_kv` only moves bits, so it has one kernel per element size (2 or 4 bytes).

CuPy is imported lazily, inside the functions: this module imports where CuPy or a GPU is
missing, and calling a kernel there raises :class:`~gpu_pool.errors.BackendUnavailable`.
Each ``RawKernel`` is built once per process (:func:`functools.cache`); CuPy compiles it with
NVRTC per device on first launch and keeps the binary in its on-disk kernel cache
(:func:`warm_up` moves that compile to start-up).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from gpu_pool.cuda_backend import require_cupy, require_device
from gpu_pool.errors import BackendUnavailable

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256

# write_kv: a grid-stride loop over the N * H_kv * D elements, one thread per element (K and
# V both). 4096 blocks of 256 threads is several times what an H100 keeps resident; bigger
# writes loop.
WRITE_KV_THREADS = 256
WRITE_KV_MAX_BLOCKS = 4096

# paged_decode_attention: one thread block per (head, sequence), 8 warps of 32 threads.
ATTENTION_WARPS = 8
ATTENTION_THREADS = ATTENTION_WARPS * 32
# gridDim.y (the sequences) is limited to 65535 by CUDA.
MAX_DECODE_BATCH = 65535

_HELPERS_SOURCE = r"""
// 16-bit floats as raw bits in tag structs: no CUDA header needed (see the module docstring).
struct ember_f16 { unsigned short bits; };
struct ember_bf16 { unsigned short bits; };

__device__ __forceinline__ float ember_to_float(float x) { return x; }

__device__ __forceinline__ float ember_to_float(ember_f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}

__device__ __forceinline__ float ember_to_float(ember_bf16 x) {
    return __uint_as_float(static_cast<unsigned int>(x.bits) << 16);
}

__device__ __forceinline__ void ember_store(float* p, float f) { *p = f; }

__device__ __forceinline__ void ember_store(ember_f16* p, float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    p->bits = h;
}

__device__ __forceinline__ void ember_store(ember_bf16* p, float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        u |= 0x00400000u;  // NaN: keep the sign, make sure it stays a (quiet) NaN after truncation
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    }
    p->bits = static_cast<unsigned short>(u >> 16);
}
"""

# One grid-stride loop over the N * H_kv * D elements of k and v (contiguous (N, H_kv, D)).
# Element i is token n, kv head h, dim d; it goes to block slot / BS, offset slot % BS, through
# the cache's strides (in elements). Slots outside [0, num_blocks * BS) are skipped: negative
# ones are padding (vLLM's convention), larger ones would write outside the cache.
# T is an unsigned integer of the element's size: the kernel moves bits, whatever the dtype.
WRITE_KV_SOURCE = r"""
template <typename T>
__device__ __forceinline__ void ember_write_kv(
    T* k_cache, T* v_cache, const T* k, const T* v, const long long* slots,
    long long num_tokens, long long num_kv_heads, long long head_dim,
    long long block_size, long long num_blocks,
    long long s_block, long long s_token, long long s_head, long long s_dim)
{
    const long long per_token = num_kv_heads * head_dim;
    const long long total = num_tokens * per_token;
    const long long num_slots = num_blocks * block_size;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
         i += stride) {
        const long long n = i / per_token;
        const long long r = i - n * per_token;
        const long long h = r / head_dim;
        const long long d = r - h * head_dim;
        const long long slot = slots[n];
        if (slot < 0 || slot >= num_slots) {
            continue;
        }
        const long long dst = (slot / block_size) * s_block + (slot % block_size) * s_token
            + h * s_head + d * s_dim;
        k_cache[dst] = k[i];
        v_cache[dst] = v[i];
    }
}

#define EMBER_WRITE_KV_ENTRY(NAME, T)                                                        \
extern "C" __global__ void NAME(                                                             \
    unsigned long long k_cache, unsigned long long v_cache,                                  \
    unsigned long long k, unsigned long long v, unsigned long long slots,                    \
    long long num_tokens, long long num_kv_heads, long long head_dim,                        \
    long long block_size, long long num_blocks,                                              \
    long long s_block, long long s_token, long long s_head, long long s_dim)                 \
{                                                                                            \
    ember_write_kv<T>(reinterpret_cast<T*>(k_cache), reinterpret_cast<T*>(v_cache),          \
        reinterpret_cast<const T*>(k), reinterpret_cast<const T*>(v),                        \
        reinterpret_cast<const long long*>(slots), num_tokens, num_kv_heads, head_dim,       \
        block_size, num_blocks, s_block, s_token, s_head, s_dim);                            \
}

EMBER_WRITE_KV_ENTRY(ember_write_kv_b16, unsigned short)
EMBER_WRITE_KV_ENTRY(ember_write_kv_b32, unsigned int)
"""

# Paged decode attention. Grid (H, B): block (head, seq) computes
#     out[seq, head] = softmax(scale * q[seq, head] . K[t]) @ V[t] over t < context_lens[seq],
# with K/V of kv head head / group (GQA, group = H / H_kv) read from physical block
# block_tables[seq, t / BS] at offset t % BS.
#
# Work split: the block's 8 warps take tokens round-robin (warp w: t = w, w + 8, ...). Within a
# warp, lane l holds dims l, l + 32, ... (up to 8 of them for D <= 256) of the scaled query
# and of its running output, so a K or V row is read by 32 consecutive lanes (coalesced). The
# score of a token is a warp-wide sum (shuffles); every lane then has it, so the online-softmax
# state (running max m, running sum l) is the same in all lanes of a warp:
#     m' = max(m, s);  a = exp(m - m');  p = exp(s - m');  l = l * a + p;  acc = acc * a + p * v
# (m starts at -inf, so the first token gives a = 0). At the end the 8 partial states are
# merged through shared memory with the global max M:
#     out = sum_w exp(m_w - M) acc_w / sum_w exp(m_w - M) l_w
# Warps that saw no token have m_w = -inf, l_w = 0, acc_w = 0 and contribute nothing.
#
# Shared memory (static): 8 x 256 floats of partial outputs (8 KiB) plus 3 x 8 words of
# per-warp max, sum and error flag: about 8.1 KiB per block, no dynamic shared memory.
#
# Safety: the context is clamped to the table's width (max_blocks * BS), and a block number
# outside [0, num_blocks) is never dereferenced: the (head, seq) output is set to NaN instead,
# so a corrupt table shows up as NaN rather than as a wild read. A context <= 0 gives zeros.
DECODE_ATTENTION_SOURCE = (
    _HELPERS_SOURCE
    + r"""
#define EMBER_ATTN_WARPS 8
#define EMBER_ATTN_THREADS (EMBER_ATTN_WARPS * 32)
#define EMBER_MAX_HEAD_DIM 256
#define EMBER_DIMS_PER_LANE (EMBER_MAX_HEAD_DIM / 32)

__device__ __forceinline__ float ember_warp_sum(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        x += __shfl_xor_sync(0xffffffffu, x, offset);
    }
    return x;
}

template <typename T>
__device__ __forceinline__ void ember_paged_decode_attention(
    T* __restrict__ out, const T* __restrict__ q,
    const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    const long long* __restrict__ block_tables, const long long* __restrict__ context_lens,
    long long max_blocks, long long num_heads, long long group, long long head_dim,
    long long block_size, long long num_blocks,
    long long s_block, long long s_token, long long s_head, long long s_dim, float scale)
{
    __shared__ float s_max[EMBER_ATTN_WARPS];
    __shared__ float s_sum[EMBER_ATTN_WARPS];
    __shared__ int s_bad[EMBER_ATTN_WARPS];
    __shared__ float s_acc[EMBER_ATTN_WARPS][EMBER_MAX_HEAD_DIM];

    const long long head = blockIdx.x;
    const long long seq = blockIdx.y;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const float neg_inf = __uint_as_float(0xff800000u);
    const float nan = __uint_as_float(0x7fc00000u);

    T* o = out + (seq * num_heads + head) * head_dim;
    long long ctx = context_lens[seq];
    if (ctx > max_blocks * block_size) {
        ctx = max_blocks * block_size;
    }
    if (ctx <= 0) {  // the same for every thread of the block, so no barrier is skipped unevenly
        for (long long d = threadIdx.x; d < head_dim; d += blockDim.x) {
            ember_store(o + d, 0.0f);
        }
        return;
    }

    const T* qh = q + (seq * num_heads + head) * head_dim;
    float qr[EMBER_DIMS_PER_LANE];
    float acc[EMBER_DIMS_PER_LANE];
#pragma unroll
    for (int i = 0; i < EMBER_DIMS_PER_LANE; ++i) {
        const long long d = lane + 32 * i;
        qr[i] = d < head_dim ? ember_to_float(qh[d]) * scale : 0.0f;
        acc[i] = 0.0f;
    }

    const long long* table = block_tables + seq * max_blocks;
    const long long head_offset = (head / group) * s_head;
    float m = neg_inf;
    float l = 0.0f;
    int bad = 0;
    for (long long t = warp; t < ctx; t += EMBER_ATTN_WARPS) {
        const long long block = table[t / block_size];  // the same in every lane: no divergence
        if (block < 0 || block >= num_blocks) {
            bad = 1;
            continue;
        }
        const long long base = block * s_block + (t % block_size) * s_token + head_offset;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < EMBER_DIMS_PER_LANE; ++i) {
            const long long d = lane + 32 * i;
            if (d < head_dim) {
                s += qr[i] * ember_to_float(k_cache[base + d * s_dim]);
            }
        }
        s = ember_warp_sum(s);  // all 32 lanes take part: blockDim.x is a multiple of 32
        const float m_new = fmaxf(m, s);
        const float alpha = expf(m - m_new);
        const float p = expf(s - m_new);
        l = l * alpha + p;
#pragma unroll
        for (int i = 0; i < EMBER_DIMS_PER_LANE; ++i) {
            const long long d = lane + 32 * i;
            if (d < head_dim) {
                acc[i] = acc[i] * alpha + p * ember_to_float(v_cache[base + d * s_dim]);
            }
        }
        m = m_new;
    }

    if (lane == 0) {
        s_max[warp] = m;
        s_sum[warp] = l;
        s_bad[warp] = bad;
    }
#pragma unroll
    for (int i = 0; i < EMBER_DIMS_PER_LANE; ++i) {
        const long long d = lane + 32 * i;
        if (d < head_dim) {
            s_acc[warp][d] = acc[i];
        }
    }
    __syncthreads();

    float gmax = neg_inf;
    int any_bad = 0;
#pragma unroll
    for (int w = 0; w < EMBER_ATTN_WARPS; ++w) {
        gmax = fmaxf(gmax, s_max[w]);
        any_bad |= s_bad[w];
    }
    float total = 0.0f;
    float weight[EMBER_ATTN_WARPS];
#pragma unroll
    for (int w = 0; w < EMBER_ATTN_WARPS; ++w) {
        weight[w] = s_sum[w] > 0.0f ? expf(s_max[w] - gmax) : 0.0f;
        total += s_sum[w] * weight[w];
    }
    const float inv_total = 1.0f / total;
    for (long long d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float value = 0.0f;
#pragma unroll
        for (int w = 0; w < EMBER_ATTN_WARPS; ++w) {
            value += s_acc[w][d] * weight[w];
        }
        ember_store(o + d, any_bad ? nan : value * inv_total);
    }
}

#define EMBER_ATTENTION_ENTRY(NAME, T)                                                       \
extern "C" __global__ void __launch_bounds__(EMBER_ATTN_THREADS) NAME(                       \
    unsigned long long out, unsigned long long q,                                            \
    unsigned long long k_cache, unsigned long long v_cache,                                  \
    unsigned long long block_tables, unsigned long long context_lens,                        \
    long long max_blocks, long long num_heads, long long group, long long head_dim,          \
    long long block_size, long long num_blocks,                                              \
    long long s_block, long long s_token, long long s_head, long long s_dim, float scale)    \
{                                                                                            \
    ember_paged_decode_attention<T>(reinterpret_cast<T*>(out), reinterpret_cast<const T*>(q), \
        reinterpret_cast<const T*>(k_cache), reinterpret_cast<const T*>(v_cache),            \
        reinterpret_cast<const long long*>(block_tables),                                    \
        reinterpret_cast<const long long*>(context_lens), max_blocks, num_heads, group,      \
        head_dim, block_size, num_blocks, s_block, s_token, s_head, s_dim, scale);           \
}

EMBER_ATTENTION_ENTRY(ember_paged_decode_attention_f32, float)
EMBER_ATTENTION_ENTRY(ember_paged_decode_attention_f16, ember_f16)
EMBER_ATTENTION_ENTRY(ember_paged_decode_attention_bf16, ember_bf16)
"""
)

WRITE_KV_KERNELS = {2: "ember_write_kv_b16", 4: "ember_write_kv_b32"}  # by element size
ATTENTION_KERNELS = {
    torch.float32: "ember_paged_decode_attention_f32",
    torch.float16: "ember_paged_decode_attention_f16",
    torch.bfloat16: "ember_paged_decode_attention_bf16",
}


# -- kernels and launching ---------------------------------------------------------------------


@functools.cache
def _kernel(source_name: str, name: str) -> Any:
    """The :class:`cupy.RawKernel` ``name`` of ``source_name`` (CuPy compiles it per device)."""
    cp = require_cupy()
    source = {"write_kv": WRITE_KV_SOURCE, "attention": DECODE_ATTENTION_SOURCE}[source_name]
    return cp.RawKernel(source, name)


@functools.cache
def _check_device(index: int) -> None:
    """CuPy imports and CUDA device ``index`` exists (checked once per device and process)."""
    require_device(require_cupy(), index)


class _StreamHandle:
    """A raw ``cudaStream_t`` behind the CUDA stream protocol, for ``cupy.cuda.Stream.from_external``."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)  # (protocol version, handle)


def _torch_stream(cp: Any, index: int) -> Any:
    """Torch's current stream on device ``index`` as a CuPy stream object (no stream is created)."""
    ptr = int(torch.cuda.current_stream(index).cuda_stream)
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is not None:  # CuPy >= 14, where ExternalStream is deprecated (and warns)
        return from_external(_StreamHandle(ptr))
    return cp.cuda.ExternalStream(ptr, index)


def _launch(
    source_name: str, name: str, device: torch.device, grid: tuple[int, ...], args: tuple[Any, ...]
) -> None:
    """Launch a kernel on ``device`` on torch's current stream there (asynchronous)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    _check_device(index)
    cp = require_cupy()
    with cp.cuda.Device(index):
        block = (WRITE_KV_THREADS,) if source_name == "write_kv" else (ATTENTION_THREADS,)
        _kernel(source_name, name)(grid, block, args, stream=_torch_stream(cp, index))


def warm_up(device: torch.device | int | None = None) -> None:
    """Compile (or load from CuPy's kernel cache) every kernel for ``device`` now.

    The first launch otherwise pays NVRTC's compile time (hundreds of milliseconds the first
    time on a machine). ``device``: a CUDA device or its index; ``None`` is torch's current one.
    """
    if device is None:
        index = torch.cuda.current_device()
    elif isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"warm_up needs a CUDA device, got {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
    else:
        index = operator.index(device)
    _check_device(index)
    cp = require_cupy()
    with cp.cuda.Device(index):
        # ``RawKernel.kernel`` compiles (or loads) and caches the kernel for the current device.
        for name in WRITE_KV_KERNELS.values():
            _ = _kernel("write_kv", name).kernel
        for name in ATTENTION_KERNELS.values():
            _ = _kernel("attention", name).kernel


# -- validation --------------------------------------------------------------------------------


def _require_tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _check_kv_blocks(kv_blocks: Any, layer: Any) -> tuple[torch.Tensor, int]:
    kv = _require_tensor("kv_blocks", kv_blocks)
    if kv.ndim != 6 or kv.shape[2] != 2:
        raise ValueError(f"kv_blocks must have shape (num_blocks, L, 2, BS, H_kv, D), got {tuple(kv.shape)}")
    if kv.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"kv_blocks dtype must be float32, float16 or bfloat16, got {kv.dtype}")
    if isinstance(layer, bool):
        raise ValueError(f"layer must be an int, got {layer!r}")
    try:
        layer = operator.index(layer)
    except TypeError:
        raise ValueError(f"layer must be an int, got {type(layer).__name__}") from None
    if not 0 <= layer < kv.shape[1]:
        raise ValueError(f"layer {layer} is out of range for a cache of {kv.shape[1]} layers")
    return kv, layer


def _check_cuda(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if tensor.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor, got one on {tensor.device}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, but kv_blocks is on {device}")


def _is_integer(tensor: torch.Tensor) -> bool:
    return tensor.dtype in (torch.int32, torch.int64)


def _layer_pointers(kv: torch.Tensor, layer: int) -> tuple[int, int]:
    """Device addresses of ``kv[0, layer, 0, 0, 0, 0]`` (K) and ``kv[0, layer, 1, 0, 0, 0]`` (V)."""
    itemsize = kv.element_size()
    k_ptr = kv.data_ptr() + layer * kv.stride(1) * itemsize
    return k_ptr, k_ptr + kv.stride(2) * itemsize


# -- public API --------------------------------------------------------------------------------


def write_kv(
    kv_blocks: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store the new K and V of ``layer`` in the paged cache: ``kv_blocks[s // BS, layer, :, s % BS]``.

    ``kv_blocks``: (num_blocks, L, 2, BS, H_kv, D) CUDA tensor, any strides (e.g. a view over
    the pool arena); ``k``, ``v``: (N, H_kv, D) of the same dtype and device (made contiguous
    if they are not); ``slots``: (N,) int32/int64 on the same device, ``block * BS + offset``.
    Slots outside ``[0, num_blocks * BS)`` are skipped (negative: padding). Two equal slots
    in one call leave either token's K/V, as with torch indexing. Asynchronous, on torch's
    current stream.

    Raises ValueError for a bad shape, dtype or device, and
    :class:`~gpu_pool.errors.BackendUnavailable` without CuPy or a CUDA device.
    """
    kv, layer = _check_kv_blocks(kv_blocks, layer)
    k = _require_tensor("k", k)
    v = _require_tensor("v", v)
    slots = _require_tensor("slots", slots)
    _, _, _, block_size, num_kv_heads, head_dim = kv.shape
    if k.ndim != 3 or tuple(k.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k must have shape (N, {num_kv_heads}, {head_dim}), got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    if slots.ndim != 1 or slots.shape[0] != k.shape[0]:
        raise ValueError(f"slots must have shape ({k.shape[0]},), got {tuple(slots.shape)}")
    if k.dtype != kv.dtype or v.dtype != kv.dtype:
        raise ValueError(f"k and v must have the cache's dtype {kv.dtype}, got {k.dtype} and {v.dtype}")
    if not _is_integer(slots):
        raise ValueError(f"slots must be int32 or int64, got {slots.dtype}")
    for name, tensor in (("kv_blocks", kv), ("k", k), ("v", v), ("slots", slots)):
        _check_cuda(name, tensor, kv.device)
    num_tokens = k.shape[0]
    total = num_tokens * num_kv_heads * head_dim
    if total == 0:
        return
    k = k.contiguous()  # (N, H_kv, D)
    v = v.contiguous()  # (N, H_kv, D)
    slots = slots.to(torch.int64).contiguous()  # (N,)
    k_ptr, v_ptr = _layer_pointers(kv, layer)
    blocks = min(WRITE_KV_MAX_BLOCKS, -(-total // WRITE_KV_THREADS))
    args = (
        np.uint64(k_ptr),
        np.uint64(v_ptr),
        np.uint64(k.data_ptr()),
        np.uint64(v.data_ptr()),
        np.uint64(slots.data_ptr()),
        np.int64(num_tokens),
        np.int64(num_kv_heads),
        np.int64(head_dim),
        np.int64(block_size),
        np.int64(kv.shape[0]),
        np.int64(kv.stride(0)),
        np.int64(kv.stride(3)),
        np.int64(kv.stride(4)),
        np.int64(kv.stride(5)),
    )
    _launch("write_kv", WRITE_KV_KERNELS[kv.element_size()], kv.device, (blocks,), args)


def paged_decode_attention(
    q: torch.Tensor,
    kv_blocks: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor | Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context: (B, H, D) in q's dtype.

    ``q``: (B, H, D) CUDA tensor, D <= 256, H a multiple of H_kv (grouped-query attention:
    query head h reads kv head ``h // (H // H_kv)``); ``kv_blocks``: (num_blocks, L, 2, BS,
    H_kv, D) of q's dtype and device, any strides; ``block_tables``: (B, max_blocks)
    int32/int64 on the device, physical block numbers; ``context_lens``: (B,) int32/int64 on
    the device, or a sequence of ints: sequence i attends to its first ``context_lens[i]``
    tokens, in blocks ``block_tables[i, :ceil(context_lens[i] / BS)]`` (the new token's K/V
    must already be written, see :func:`write_kv`). ``scale`` defaults to ``D ** -0.5``.

    Softmax is computed online in float32 (max-subtracted, so it does not overflow). On the
    device, a context longer than the table's width is clamped to it, a context <= 0 gives
    zeros, and a block number outside ``[0, num_blocks)`` in the context gives NaN for that
    sequence (it is never dereferenced). Launch: grid (H, B), 256 threads (8 warps) per
    block, ~8.1 KiB static shared memory, on torch's current stream (asynchronous).

    Raises ValueError for a bad shape, dtype, device or (host-side) context length, and
    :class:`~gpu_pool.errors.BackendUnavailable` without CuPy or a CUDA device.
    """
    q = _require_tensor("q", q)
    kv, layer = _check_kv_blocks(kv_blocks, layer)
    block_tables = _require_tensor("block_tables", block_tables)
    num_blocks, _, _, block_size, num_kv_heads, head_dim = kv.shape
    if q.ndim != 3:
        raise ValueError(f"q must have shape (B, H, D), got {tuple(q.shape)}")
    batch, num_heads, q_dim = q.shape
    if q_dim != head_dim:
        raise ValueError(f"q has head dim {q_dim}, but the cache has {head_dim}")
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    if num_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_heads}) must be a positive multiple of kv heads ({num_kv_heads})"
        )
    if q.dtype != kv.dtype:
        raise ValueError(f"q ({q.dtype}) and kv_blocks ({kv.dtype}) must have the same dtype")
    if batch > MAX_DECODE_BATCH:
        raise ValueError(f"at most {MAX_DECODE_BATCH} sequences per call, got {batch}")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or block_tables.shape[1] == 0:
        raise ValueError(
            f"block_tables must have shape ({batch}, max_blocks >= 1), got {tuple(block_tables.shape)}"
        )
    if not _is_integer(block_tables):
        raise ValueError(f"block_tables must be int32 or int64, got {block_tables.dtype}")
    max_blocks = block_tables.shape[1]
    if isinstance(context_lens, torch.Tensor):
        if context_lens.shape != (batch,):
            raise ValueError(f"context_lens must have shape ({batch},), got {tuple(context_lens.shape)}")
        if not _is_integer(context_lens):
            raise ValueError(f"context_lens must be int32 or int64, got {context_lens.dtype}")
        ctx_tensor: torch.Tensor | None = context_lens
        lens: list[int] = []
    else:
        lens = [operator.index(n) for n in context_lens]
        if len(lens) != batch:
            raise ValueError(f"context_lens has {len(lens)} entries for {batch} sequences")
        capacity = max_blocks * block_size
        for i, n in enumerate(lens):
            if not 0 <= n <= capacity:
                raise ValueError(
                    f"context_lens[{i}] = {n} is outside 0..{capacity} (block table width x block size)"
                )
        ctx_tensor = None
    scale = head_dim**-0.5 if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    for name, tensor in (("kv_blocks", kv), ("q", q), ("block_tables", block_tables)):
        _check_cuda(name, tensor, kv.device)
    if ctx_tensor is not None:
        _check_cuda("context_lens", ctx_tensor, kv.device)

    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)  # (B, H, D)
    if batch == 0:
        return out
    q = q.contiguous()  # (B, H, D)
    tables = block_tables.to(torch.int64).contiguous()  # (B, max_blocks)
    if ctx_tensor is None:
        ctx_tensor = torch.tensor(lens, dtype=torch.int64, device=kv.device)  # (B,)
    else:
        ctx_tensor = ctx_tensor.to(torch.int64).contiguous()  # (B,)
    k_ptr, v_ptr = _layer_pointers(kv, layer)
    args = (
        np.uint64(out.data_ptr()),
        np.uint64(q.data_ptr()),
        np.uint64(k_ptr),
        np.uint64(v_ptr),
        np.uint64(tables.data_ptr()),
        np.uint64(ctx_tensor.data_ptr()),
        np.int64(max_blocks),
        np.int64(num_heads),
        np.int64(num_heads // num_kv_heads),
        np.int64(head_dim),
        np.int64(block_size),
        np.int64(num_blocks),
        np.int64(kv.stride(0)),
        np.int64(kv.stride(3)),
        np.int64(kv.stride(4)),
        np.int64(kv.stride(5)),
        np.float32(scale),
    )
    _launch("attention", ATTENTION_KERNELS[q.dtype], kv.device, (num_heads, batch), args)
    return out


__all__ = [
    "ATTENTION_THREADS",
    "MAX_HEAD_DIM",
    "SUPPORTED_DTYPES",
    "BackendUnavailable",
    "paged_decode_attention",
    "warm_up",
    "write_kv",
]
