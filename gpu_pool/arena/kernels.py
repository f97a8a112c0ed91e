"""CUDA kernels of the pool and the overlap-safe in-arena move built on them.

The move is what Partitioned-Gain Packing (Tangram Alg. 1) executes when it slides inactive
tensors aside: source and destination are ranges of the same arena and may overlap. CUDA
has no device-side ``memmove``: ``cudaMemcpy`` on overlapping ranges is undefined, and the
threads of one kernel launch run in no defined order. So a move is split into *steps*, each
a copy between two ranges that do not overlap, and the steps are launched on one stream in
an order in which no step overwrites a byte that a later step still has to read. Kernels
launched on one stream run one after another, so that order is the order they take effect.

:func:`plan_move` (pure Python, tested on CPU) makes the steps; :func:`move` launches them
with the ``ember_move_bytes`` kernel. CuPy is imported lazily, inside the functions, so this
module imports where CuPy or a GPU is missing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu_pool.cuda_backend import require_cupy

MOVE_KERNEL_NAME = "ember_move_bytes"

# One grid-stride copy kernel. Pointers and size arrive as 64-bit integers (the host passes
# numpy.uint64 values, so no pointer is ever narrowed or sign-converted on the way).
# When dst and src have the same alignment modulo 16 (the usual case: the allocator places
# tensors on aligned offsets), the bulk moves as 16-byte vectors, which on an H100 reaches
# close to the HBM bandwidth, with at most 15 single bytes before and after; otherwise every
# byte moves on its own (correct, just slower). The 16-byte type is declared here with
# alignas rather than taken from CUDA's uint4 so the source needs no header or NVRTC builtin:
# a 16-byte aligned struct of four 32-bit words compiles to one 128-bit load and store.
# The kernel assumes that [dst, dst + nbytes) and [src, src + nbytes) do not overlap;
# the host (plan_move) guarantees it for every launch.
MOVE_KERNEL_SOURCE = r"""
struct alignas(16) ember_vec16 {
    unsigned int x, y, z, w;
};

extern "C" __global__ void ember_move_bytes(
    unsigned long long dst_addr, unsigned long long src_addr, unsigned long long nbytes)
{
    unsigned char* dst = reinterpret_cast<unsigned char*>(dst_addr);
    const unsigned char* src = reinterpret_cast<const unsigned char*>(src_addr);
    const unsigned long long first =
        static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;

    // Bytes [0, head) move one at a time, then nvec 16-byte vectors, then bytes
    // [tail, nbytes). Without a common alignment, head covers everything.
    unsigned long long head = nbytes;
    unsigned long long nvec = 0ULL;
    if (((dst_addr ^ src_addr) & 15ULL) == 0ULL) {
        head = (16ULL - (dst_addr & 15ULL)) & 15ULL;
        if (head > nbytes) {
            head = nbytes;
        }
        nvec = (nbytes - head) >> 4;
    }
    const unsigned long long tail = head + (nvec << 4);

    ember_vec16* dvec = reinterpret_cast<ember_vec16*>(dst + head);
    const ember_vec16* svec = reinterpret_cast<const ember_vec16*>(src + head);
    for (unsigned long long i = first; i < nvec; i += stride) {
        dvec[i] = svec[i];
    }
    for (unsigned long long i = first; i < head; i += stride) {
        dst[i] = src[i];
    }
    for (unsigned long long i = tail + first; i < nbytes; i += stride) {
        dst[i] = src[i];
    }
}
"""

THREADS_PER_BLOCK = 256
# Grid-stride loops let a bounded grid cover any size. 4096 blocks of 256 threads is about
# four times what an H100 (132 SMs x 2048 threads) keeps resident, enough to hide latency.
MAX_BLOCKS = 4096
# Overlapping moves whose distance |dst - src| is at least this many bytes (16 MiB) run as
# chunks of `distance` bytes straight inside the arena: each launch moves >= 16 MiB, so launch
# overhead (a few microseconds) is negligible against the copy (>= ~10 us at ~3 TB/s).
DIRECT_MIN_DISTANCE = 16 << 20
# Smaller distances stage through a scratch buffer of this many bytes (64 MiB): two launches
# per 64 MiB instead of one launch per `distance` bytes (a 1 GiB slide by 4 KiB would
# otherwise be 262,144 launches).
STAGE_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class CopyStep:
    """One kernel launch: copy ``nbytes`` from address ``src`` to address ``dst`` (no overlap)."""

    dst: int
    src: int
    nbytes: int


def needs_scratch(dst: int, src: int, nbytes: int, direct_min_distance: int = DIRECT_MIN_DISTANCE) -> bool:
    """Whether :func:`plan_move` must stage this move through a scratch buffer."""
    distance = abs(dst - src)
    return 0 < distance < nbytes and distance < direct_min_distance


def _pieces(total: int, size: int, ascending: bool) -> list[tuple[int, int]]:
    """``(offset, length)`` pieces of at most ``size`` bytes covering ``[0, total)``, in order."""
    pieces = [(off, min(size, total - off)) for off in range(0, total, size)]
    return pieces if ascending else pieces[::-1]


def plan_move(
    dst: int,
    src: int,
    nbytes: int,
    *,
    scratch: int | None = None,
    scratch_bytes: int = STAGE_BYTES,
    direct_min_distance: int = DIRECT_MIN_DISTANCE,
) -> list[CopyStep]:
    """Steps that copy ``[src, src + nbytes)`` to ``[dst, dst + nbytes)`` with memmove semantics.

    ``dst``, ``src`` and ``scratch`` are addresses (bytes); ``scratch`` is a separate buffer of
    ``scratch_bytes`` that must not overlap either range; it is needed only when
    :func:`needs_scratch` says so. Executing the steps in list order, each as a plain
    non-overlapping copy, leaves at ``dst`` the bytes ``src`` held before the first step.

    Why the order is safe, with distance ``d = |dst - src|`` and ``0 < d < nbytes``:

    * ``dst < src`` (moving down): go through the range in ascending pieces of at most ``d``
      bytes. Piece ``[o, o + n)`` writes ``[dst + o, dst + o + n) = [src + o - d, src + o + n - d)``:
      it ends at or below ``src + o``, so it does not overlap its own source (``n <= d``), and
      it only covers source bytes below ``src + o``, which earlier pieces already copied.
    * ``dst > src`` (moving up): the mirror image, pieces in descending order. Piece
      ``[o, o + n)`` writes ``[src + o + d, src + o + n + d)``: it starts at or above
      ``src + o + n`` and only covers source bytes above it, already copied.
    * ``d < direct_min_distance``: pieces of ``d`` bytes would mean ``nbytes / d`` launches,
      so instead each piece of up to ``scratch_bytes`` is copied src -> scratch, then
      scratch -> dst, in the same safe order: when a piece is read into scratch, no earlier
      step has written over it (same argument, the writes stay on the already-copied side),
      and the scratch buffer overlaps neither range. Reusing one scratch buffer is safe
      because the steps run in order on one stream.
    """
    if nbytes < 0:
        raise ValueError(f"cannot move {nbytes} bytes")
    if scratch_bytes <= 0 or direct_min_distance <= 0:
        raise ValueError("scratch_bytes and direct_min_distance must be > 0")
    if nbytes == 0 or dst == src:
        return []
    distance = abs(dst - src)
    if distance >= nbytes:
        return [CopyStep(dst, src, nbytes)]
    ascending = dst < src
    if distance >= direct_min_distance:
        return [CopyStep(dst + off, src + off, n) for off, n in _pieces(nbytes, distance, ascending)]
    if scratch is None:
        raise ValueError(f"a move by {distance} bytes (< {direct_min_distance}) needs a scratch buffer")
    lo, hi = min(dst, src), max(dst, src) + nbytes
    if scratch < hi and lo < scratch + scratch_bytes:
        raise ValueError("the scratch buffer overlaps the ranges it stages")
    steps: list[CopyStep] = []
    for off, n in _pieces(nbytes, scratch_bytes, ascending):
        steps.append(CopyStep(scratch, src + off, n))
        steps.append(CopyStep(dst + off, scratch, n))
    return steps


def launch_blocks(dst: int, src: int, nbytes: int) -> int:
    """Blocks of :data:`THREADS_PER_BLOCK` threads for one ``ember_move_bytes`` launch."""
    # One thread per 16-byte vector when the pointers share an alignment, else per byte;
    # the grid-stride loops handle whatever a bounded grid does not cover.
    items = nbytes // 16 + 1 if (dst ^ src) & 15 == 0 else nbytes
    return max(1, min(MAX_BLOCKS, -(-items // THREADS_PER_BLOCK)))


@functools.cache
def move_kernel() -> Any:
    """The ``ember_move_bytes`` :class:`cupy.RawKernel` (CuPy compiles it per device on first use)."""
    cp = require_cupy()
    return cp.RawKernel(MOVE_KERNEL_SOURCE, MOVE_KERNEL_NAME)


def copy_bytes(dst: int, src: int, nbytes: int, stream: Any) -> None:
    """Launch one non-overlapping device copy on ``stream`` (asynchronous; current device)."""
    if nbytes <= 0:
        return
    move_kernel()(
        (launch_blocks(dst, src, nbytes),),
        (THREADS_PER_BLOCK,),
        (np.uint64(dst), np.uint64(src), np.uint64(nbytes)),
        stream=stream,
    )


def warm_up(stream: Any) -> None:
    """Compile (or load from CuPy's kernel cache) the move kernel for the current device now.

    A launch with zero bytes touches no memory; it moves NVRTC's compile time (hundreds of
    milliseconds the first time on a machine) from the first real move to start-up.
    """
    move_kernel()((1,), (THREADS_PER_BLOCK,), (np.uint64(0), np.uint64(0), np.uint64(0)), stream=stream)


def move(
    arena_base_ptr: int,
    dst: int,
    src: int,
    nbytes: int,
    stream: Any,
    *,
    scratch: int | None = None,
    scratch_bytes: int = STAGE_BYTES,
) -> None:
    """Enqueue an overlap-safe move of ``nbytes`` from arena offset ``src`` to offset ``dst``.

    ``arena_base_ptr`` is the arena's device address, ``stream`` a :class:`cupy.cuda.Stream`
    (``None``: the current stream); the current device must be the arena's. The launches are
    asynchronous: the caller synchronizes ``stream`` before relying on the bytes. Moves with a
    small overlap distance stage through ``scratch`` (a device address of ``scratch_bytes``
    bytes); without one, a temporary buffer is allocated and the stream is synchronized before
    it is freed. Range checks against the arena's size are the caller's job.
    """
    if dst < 0 or src < 0:
        raise ValueError(f"negative arena offset (dst={dst}, src={src})")
    temporary = None
    if scratch is None and needs_scratch(dst, src, nbytes):
        cp = require_cupy()
        scratch_bytes = min(scratch_bytes, nbytes)
        temporary = cp.cuda.Memory(scratch_bytes)
        scratch = int(temporary.ptr)
    steps = plan_move(
        arena_base_ptr + dst, arena_base_ptr + src, nbytes, scratch=scratch, scratch_bytes=scratch_bytes
    )
    try:
        for step in steps:
            copy_bytes(step.dst, step.src, step.nbytes, stream)
    finally:
        if temporary is not None:
            # The launches still read and write the temporary buffer; free it only after them.
            if stream is None:
                require_cupy().cuda.get_current_stream().synchronize()
            else:
                stream.synchronize()
            del temporary
