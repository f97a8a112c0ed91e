"""CUDA arena: one ``cudaMalloc`` block on one GPU, shared with workers over CUDA IPC.

Daemon side, :class:`CudaArena` owns the allocation (made with CuPy, zeroed), moves bytes
inside it with the overlap-safe kernel of :mod:`gpu_pool.arena.kernels`, and loads store-file
ranges into it: each copy group runs on a worker thread with its own non-blocking CUDA
stream, reads the file range with ``os.preadv`` into pinned host memory (or finds it in the
:class:`~gpu_pool.arena.host_cache.PinnedHostCache`) and copies it to the device with
``cudaMemcpyAsync``, so disk reads of one group overlap host-to-device copies of others.

Client side, :func:`attach_cuda` opens the arena's IPC handle in a worker process and
returns a 1-D ``uint8`` torch tensor over the whole arena; tensors are views of it (zero
copy). CUDA allows opening a handle only in a process other than the one that exported it,
so a worker can attach, the daemon itself cannot (it already has the memory).

The IPC handle names the start of the ``cudaMalloc`` allocation, so the arena is allocated
with :class:`cupy.cuda.Memory` (a plain ``cudaMalloc``) rather than through CuPy's memory pool,
whose pointers may lie inside a larger block. CuPy is imported lazily: this module imports
without it, and :class:`CudaArena` / :func:`attach_cuda` raise
:class:`~gpu_pool.errors.BackendUnavailable` where CuPy or a CUDA device is missing.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from gpu_pool.arena import kernels
from gpu_pool.arena.base import BaseArena, CopyJob, read_exactly
from gpu_pool.arena.host_cache import CacheKey, FileSignature, PinnedBuffer, PinnedHostCache
from gpu_pool.cuda_backend import require_cupy, require_device
from gpu_pool.errors import BackendUnavailable, ConfigError, LoadError, PoolError

if TYPE_CHECKING:
    import torch

# cudaMemcpyKind values from CUDA's driver_types.h (stable across CUDA versions).
_HOST_TO_DEVICE = 1
_DEVICE_TO_HOST = 2
# cudaIpcMemLazyEnablePeerAccess: map peer memory lazily (only matters across GPUs).
_IPC_LAZY_ENABLE_PEER_ACCESS = 1
# sizeof(cudaIpcMemHandle_t).
IPC_HANDLE_BYTES = 64


class CudaArena(BaseArena):
    """An arena of ``capacity`` bytes on CUDA device ``device_index``.

    ``host_cache_bytes`` bounds the pinned host cache of loaded store ranges (0 disables
    it), ``num_threads`` is the number of load groups run at once, ``scratch_bytes`` the size
    of the device buffer that small-distance overlapping moves stage through (allocated
    once, beside the arena; 0 allocates a temporary one per such move instead).
    Every public method returns only after the device work it started has finished.
    """

    # Device-to-device copies run at a large fraction of HBM bandwidth (~1 TB/s even for a
    # simple kernel on an H100): moves are far cheaper than reloading over PCIe there.
    move_bandwidth = 1e12

    def __init__(
        self,
        device_index: int,
        capacity: int,
        host_cache_bytes: int = 1 << 30,
        num_threads: int = 4,
        *,
        scratch_bytes: int = kernels.STAGE_BYTES,
    ) -> None:
        if capacity <= 0:
            raise ValueError("arena capacity must be > 0")
        if num_threads <= 0:
            raise ValueError("num_threads must be > 0")
        if host_cache_bytes < 0 or scratch_bytes < 0:
            raise ValueError("host_cache_bytes and scratch_bytes must be >= 0")
        cp = require_cupy()
        require_device(cp, device_index)
        self._cp = cp
        self._device_index = device_index
        self.device = f"cuda:{device_index}"
        self.capacity = capacity
        self._closed = False
        with cp.cuda.Device(device_index):
            self._stream = cp.cuda.Stream(non_blocking=True)
            self._mem: Any = self._allocate(capacity, "arena")
            self._base = int(self._mem.ptr)
            self._scratch: Any = (
                self._allocate(scratch_bytes, "move scratch buffer") if scratch_bytes else None
            )
            self._scratch_bytes = scratch_bytes
            # cudaMalloc hands out whatever the memory held before; a pool promises zeros.
            cp.cuda.runtime.memsetAsync(self._base, 0, capacity, self._stream.ptr)
            try:
                # NVRTC compiles synchronously inside the launch call, so failures surface here.
                kernels.warm_up(self._stream)
            except Exception as exc:
                raise BackendUnavailable(
                    f"cannot compile the CUDA move kernel on {self.device} (CuPy needs NVRTC, "
                    f"e.g. the nvidia-cuda-nvrtc-cu12 package): {exc}"
                ) from exc
            self._stream.synchronize()
            self._ipc_handle = bytes(cp.cuda.runtime.ipcGetMemHandle(self._base))
        self._cache = PinnedHostCache(host_cache_bytes)
        # Serializes move/read: they share self._stream and the one scratch buffer, and two
        # interleaved staged moves would overwrite each other's scratch contents.
        self._lock = threading.Lock()
        # One non-blocking stream per load thread, created on the thread's first group.
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix=f"ember-cuda{device_index}-load")

    # -- BaseArena -------------------------------------------------------------------------

    def handle(self) -> dict[str, Any]:
        """``{"kind": "cuda_ipc", "device", "size", "ipc_handle"}``; map it with :func:`attach_cuda`."""
        return {
            "kind": "cuda_ipc",
            "device": self._device_index,
            "size": self.capacity,
            "ipc_handle": self._ipc_handle,
        }

    def move(self, dst: int, src: int, nbytes: int) -> None:
        """Overlap-safe copy of ``nbytes`` from offset ``src`` to offset ``dst`` (memmove semantics)."""
        self._check_open()
        self._check_range(src, nbytes)
        self._check_range(dst, nbytes)
        if nbytes == 0 or dst == src:
            return
        with self._lock, self._cp.cuda.Device(self._device_index):
            kernels.move(
                self._base,
                dst,
                src,
                nbytes,
                self._stream,
                scratch=None if self._scratch is None else int(self._scratch.ptr),
                scratch_bytes=self._scratch_bytes or kernels.STAGE_BYTES,
            )
            self._stream.synchronize()

    def load(self, groups: Sequence[Sequence[CopyJob]]) -> None:
        """Copy store-file ranges into the arena, groups in parallel; returns when all are in.

        Raises :class:`LoadError` naming the file when a file cannot be opened or read in
        full; the other groups still finish (or fail) before it is raised.
        """
        self._check_open()
        for group in groups:
            for job in group:
                self._check_range(job.dst, job.nbytes)
                if job.src < 0:
                    raise ValueError(f"negative offset {job.src} in store file {job.file}")
        fds: dict[str, int] = {}
        signatures: dict[str, FileSignature] = {}
        try:
            for group in groups:
                for job in group:
                    if job.nbytes == 0 or job.file in fds:
                        continue
                    try:
                        fd = os.open(job.file, os.O_RDONLY | os.O_CLOEXEC)
                    except OSError as exc:
                        raise LoadError(f"cannot open store file {job.file}: {exc.strerror}") from None
                    fds[job.file] = fd
                    st = os.fstat(fd)
                    signatures[job.file] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            futures = [
                self._pool.submit(self._run_group, group, fds, signatures)
                for group in groups
                if any(job.nbytes for job in group)
            ]
            # Wait for every group, not only up to the first failure: the others still use the
            # file descriptors closed below and the arena the caller may reuse.
            first_error: BaseException | None = None
            for future in futures:
                error = future.exception()
                if error is not None and first_error is None:
                    first_error = error
            if first_error is not None:
                if isinstance(first_error, PoolError):
                    raise first_error
                raise LoadError(f"loading into {self.device} failed: {first_error}") from first_error
        finally:
            for fd in fds.values():
                os.close(fd)

    def read(self, offset: int, nbytes: int) -> bytes:
        """A host copy of the arena's bytes ``[offset, offset + nbytes)``."""
        self._check_open()
        self._check_range(offset, nbytes)
        if nbytes == 0:
            return b""
        out = np.empty(nbytes, dtype=np.uint8)
        with self._lock, self._cp.cuda.Device(self._device_index):
            self._cp.cuda.runtime.memcpyAsync(
                int(out.ctypes.data), self._base + offset, nbytes, _DEVICE_TO_HOST, self._stream.ptr
            )
            self._stream.synchronize()
        return out.tobytes()

    def close(self) -> None:
        """Free the arena, the scratch buffer and the host cache (idempotent).

        Workers must have closed their IPC mappings first: CUDA leaves the behaviour of an
        importer's mapping undefined once the exporting process frees the memory.
        """
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock, self._cp.cuda.Device(self._device_index):
            self._stream.synchronize()
            self._cache.clear()
            # Dropping the last references runs cudaFree (cupy.cuda.Memory is RAII).
            self._scratch = None
            self._mem = None

    # -- statistics ------------------------------------------------------------------------

    @property
    def device_index(self) -> int:
        """The CUDA device ordinal (in this process's CUDA_VISIBLE_DEVICES numbering)."""
        return self._device_index

    @property
    def host_cache_hits(self) -> int:
        """Load jobs served from the pinned host cache."""
        return self._cache.hits

    @property
    def host_cache_misses(self) -> int:
        """Load jobs that had to read their store file."""
        return self._cache.misses

    @property
    def host_cache_bytes(self) -> int:
        """Bytes held by the pinned host cache now."""
        return self._cache.index.used_bytes

    # -- internals -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"the {self.device} arena is closed")

    def _allocate(self, nbytes: int, what: str) -> Any:
        """``cudaMalloc`` of ``nbytes`` on the current device as a :class:`cupy.cuda.Memory`."""
        cp = self._cp
        try:
            return cp.cuda.Memory(nbytes)
        except Exception as exc:  # CUDARuntimeError(cudaErrorMemoryAllocation) and friends
            try:
                free, total = cp.cuda.runtime.memGetInfo()
                room = f"{free} of {total} bytes free"
            except Exception:
                room = "free memory unknown"
            raise ConfigError(
                f"cannot allocate the {what} of {nbytes} bytes on {self.device} ({room}): {exc}"
            ) from exc

    def _thread_stream(self) -> Any:
        """This load thread's stream (created on the arena's device, which must be current)."""
        stream = getattr(self._local, "stream", None)
        if stream is None:
            # Non-blocking: no implicit synchronization with the legacy default stream, which
            # other code in the daemon (or CuPy itself) may use.
            stream = self._cp.cuda.Stream(non_blocking=True)
            self._local.stream = stream
        return stream

    def _run_group(
        self, group: Sequence[CopyJob], fds: dict[str, int], signatures: dict[str, FileSignature]
    ) -> None:
        """Load one group on this thread's stream; returns after its copies completed."""
        cp = self._cp
        # Pinned buffers whose copies are in flight: a buffer released earlier could return to
        # CuPy's pinned pool and be refilled while the DMA engine still reads it.
        in_flight: list[PinnedBuffer] = []
        with cp.cuda.Device(self._device_index):
            stream = self._thread_stream()
            try:
                for job in group:
                    if job.nbytes == 0:
                        continue
                    key: CacheKey = (job.file, job.src, job.nbytes)
                    signature = signatures[job.file]
                    buffer = self._cache.get(key, signature)
                    if buffer is None:
                        buffer = self._read_job(fds[job.file], job)
                        self._cache.put(key, signature, buffer)
                    in_flight.append(buffer)
                    try:
                        cp.cuda.runtime.memcpyAsync(
                            self._base + job.dst, buffer.ptr, job.nbytes, _HOST_TO_DEVICE, stream.ptr
                        )
                    except Exception as exc:
                        raise LoadError(
                            f"copying {job.nbytes} bytes of store file {job.file} (byte {job.src}) to "
                            f"{self.device} arena offset {job.dst} failed: {exc}"
                        ) from exc
            finally:
                try:
                    stream.synchronize()
                finally:
                    in_flight.clear()

    def _read_job(self, fd: int, job: CopyJob) -> PinnedBuffer:
        """Read the job's file range into a new pinned buffer (all of it, or LoadError)."""
        try:
            buffer = self._cache.allocate(job.nbytes)
        except Exception as exc:
            raise LoadError(
                f"cannot allocate {job.nbytes} bytes of pinned host memory for store file {job.file}: {exc}"
            ) from exc
        view = buffer.view()
        try:
            read_exactly(fd, job, view)
        finally:
            view.release()
        return buffer


# -- client side ---------------------------------------------------------------------------


class _IpcMapping:
    """One opening of an arena's IPC handle in this process; closed when garbage collected.

    It is the ``owner`` of the :class:`cupy.cuda.UnownedMemory` that :func:`attach_cuda`
    wraps around the mapped pointer, which makes the mapping live exactly as long as the
    tensors over it (see :func:`attach_cuda` for the reference chain).
    """

    __slots__ = ("__weakref__", "device", "ptr", "token")

    def __init__(self, ptr: int, device: int, token: int) -> None:
        self.ptr = ptr
        self.device = device
        self.token = token


class _IpcRegistry:
    """The IPC handles this process has open, by handle bytes.

    CUDA lets a process open a given IPC handle only once at a time (a second
    ``cudaIpcOpenMemHandle`` fails with "already mapped"), so a second attach to the same
    arena reuses the open mapping; the mapping closes when its last tensor is gone.
    """

    def __init__(self) -> None:
        # Reentrant: a finalizer may run (and take the lock) inside a locked section of the
        # same thread when garbage collection happens to trigger there.
        self._lock = threading.RLock()
        self._open: dict[bytes, tuple[int, int, int, weakref.ref[_IpcMapping]]] = {}
        self._tokens = itertools.count(1)

    def acquire(self, cp: Any, raw: bytes, device: int) -> _IpcMapping:
        with self._lock:
            entry = self._open.get(raw)
            if entry is not None:
                ptr, _, _, ref = entry
                owner = ref()
                if owner is not None:
                    return owner
                # The previous owner was collected but its finalizer has not closed the handle
                # yet (it waits for this lock in another thread): adopt the open mapping; that
                # finalizer then sees a newer token and leaves it open.
            else:
                try:
                    ptr = int(cp.cuda.runtime.ipcOpenMemHandle(raw, _IPC_LAZY_ENABLE_PEER_ACCESS))
                except Exception as exc:
                    raise BackendUnavailable(
                        f"cannot open the CUDA IPC handle of the cuda:{device} arena: {exc}. The handle "
                        f"must come from a live pool daemon in another process: CUDA does not let the "
                        f"exporting process open its own handle"
                    ) from exc
            owner = _IpcMapping(ptr, device, next(self._tokens))
            self._open[raw] = (ptr, device, owner.token, weakref.ref(owner))
            finalizer = weakref.finalize(owner, self._release, cp, raw, owner.token)
            # At interpreter exit the process's CUDA context goes away with every mapping;
            # closing then would only race CuPy's own teardown.
            finalizer.atexit = False
            return owner

    def _release(self, cp: Any, raw: bytes, token: int) -> None:
        with self._lock:
            entry = self._open.get(raw)
            if entry is None or entry[2] != token:
                return
            del self._open[raw]
            ptr, device = entry[0], entry[1]
            # Runs from garbage collection: there is nobody to report a failure to, and
            # raising here would only print an "exception ignored" message.
            try:
                with cp.cuda.Device(device):
                    cp.cuda.runtime.ipcCloseMemHandle(ptr)
            except Exception:
                pass


@functools.cache
def _ipc_registry() -> _IpcRegistry:
    """The process-wide registry, created on first use (IPC mappings are per process)."""
    return _IpcRegistry()


def attach_cuda(handle: Mapping[str, Any]) -> torch.Tensor:
    """Map a CUDA arena from its ``hello`` handle: a 1-D ``uint8`` tensor over all of it.

    Must run in a process other than the pool daemon that made the handle (CUDA refuses to
    open a handle in its exporting process). Attaching twice to one arena reuses the open
    mapping. The mapping stays open as long as the returned tensor or any view of it lives:
    ``torch.Tensor`` (and its views, which share its storage) -> the DLPack context torch keeps
    -> the ``cupy.ndarray`` -> its ``MemoryPointer`` -> ``UnownedMemory`` -> the owner object,
    whose collection calls ``cudaIpcCloseMemHandle``. So drop every tensor before the daemon
    frees the arena.
    """
    if handle.get("kind") != "cuda_ipc":
        raise ValueError(f"not a CUDA arena handle: kind {handle.get('kind')!r}")
    try:
        device = int(handle["device"])
        size = int(handle["size"])
        raw = bytes(handle["ipc_handle"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed CUDA arena handle: {exc!r}") from exc
    if len(raw) != IPC_HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(raw)}")
    if size <= 0:
        raise ValueError(f"arena size must be > 0, got {size}")
    cp = require_cupy()
    require_device(cp, device)
    import torch
    from torch.utils.dlpack import from_dlpack

    if torch.version.cuda is None:
        raise BackendUnavailable(f"this torch build ({torch.__version__}) has no CUDA support")
    with cp.cuda.Device(device):
        mapping = _ipc_registry().acquire(cp, raw, device)
        memory = cp.cuda.UnownedMemory(mapping.ptr, size, mapping, device)
        array = cp.ndarray((size,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(memory, 0))
        tensor: torch.Tensor = from_dlpack(array)
    return tensor
