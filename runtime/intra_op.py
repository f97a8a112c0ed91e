"""Intra-op threads in a worker: only the engine's thread runs parallel regions.

libgomp, the OpenMP runtime of torch and of the CPU kernels, keeps a team's threads spinning
between two parallel regions only while the process's OpenMP threads do not outnumber its
CPUs. Past that it cuts the spin to ~100 iterations, so every region wakes its team through a
futex and the engine's second thread starts each one late. A pool thread that once ran a
parallel torch op (an engine built in ``asyncio.to_thread``, a sync handler) keeps a team of
its own for the rest of its life: on 2 cores the engine's team of 2 plus that one make 4.
Measured on SmolLM2 bf16, batch-1 decode: 56-58 tok/s with such a thread alive against 86-93
without, the process using 1.4 of its 2 cores; every served instance was in that state.

So a worker's pool threads run torch's intra-op work inline (:func:`serial_thread`, their
initializer), and the engine's thread keeps its own count. ATen keeps one process-wide count
that each thread adopts on its first parallel op, and setting a thread's count sets that one
too: the engine's thread adopts the default before any pool thread starts
(:func:`claim_engine_thread`, first thing a worker does), and :func:`set_engine_threads` and
:func:`serial_thread` adopt before they set, so no later change can undo theirs.
"""

from __future__ import annotations


def claim_engine_thread() -> None:
    """Adopt the default count (the cores, or ``OMP_NUM_THREADS``) on the calling thread, the
    one that will step the engine, before a pool thread lowers the process-wide count."""
    import torch

    torch.get_num_threads()


def serial_thread() -> None:
    """Make the calling thread run torch's intra-op work in itself (a pool's initializer)."""
    _own_threads(1)


def set_engine_threads(num_threads: int) -> None:
    """Give the calling thread, which steps the engine, ``num_threads`` intra-op threads."""
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    _own_threads(num_threads)


def _own_threads(num_threads: int) -> None:
    import torch

    torch.get_num_threads()  # ATen's per-thread adoption of the process-wide count, first
    torch.set_num_threads(num_threads)
