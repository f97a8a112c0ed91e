"""The pool's device memory and how processes see it.

:mod:`~gpu_pool.arena.base` is what the daemon needs from a device (:class:`BaseArena`):
:mod:`~gpu_pool.arena.cpu` (a sealed memfd that clients map read-only) and
:mod:`~gpu_pool.arena.cuda` (a CuPy allocation shared over CUDA IPC, with the overlap-safe move of
:mod:`~gpu_pool.arena.kernels` and the pinned :mod:`~gpu_pool.arena.host_cache`).
:mod:`~gpu_pool.arena.loader` groups load copies into few large parallel ones;
:mod:`~gpu_pool.arena.kv_memory` holds each session's private KV pages on CPU; and
:mod:`~gpu_pool.arena.mapping` is the client side: the arena and KV memory mapped as torch tensors.
"""
