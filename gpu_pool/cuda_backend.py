"""Whether the CUDA backend can run here: CuPy importable and the device present.

Shared by the pool's CUDA arena and kernels and by the runtime's CUDA kernels, so that both
fail the same way (:class:`~gpu_pool.errors.BackendUnavailable`, saying how to fix it). CuPy
is imported only when a check runs, never at import time.
"""

from __future__ import annotations

from typing import Any

from gpu_pool.errors import BackendUnavailable

__all__ = ["require_cupy", "require_device"]


def require_cupy() -> Any:
    """Import and return CuPy, or raise :class:`BackendUnavailable` saying how to get it."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CUDA library CuPy needs failing to load
        raise BackendUnavailable(
            f"the CUDA backend needs CuPy (the 'cuda' extra: cupy-cuda12x); importing it failed: {exc}"
        ) from exc
    return cupy


def require_device(cp: Any, device_index: int) -> int:
    """Check that CUDA device ``device_index`` exists; return the number of visible devices."""
    try:
        count = int(cp.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CUDARuntimeError: no driver, no device, driver too old
        raise BackendUnavailable(f"no usable CUDA device: {exc}") from exc
    if count <= 0:
        raise BackendUnavailable("no CUDA device is visible to this process")
    if not 0 <= device_index < count:
        raise BackendUnavailable(
            f"CUDA device {device_index} does not exist: {count} device(s) visible "
            f"(indices follow CUDA_VISIBLE_DEVICES of this process)"
        )
    return count
