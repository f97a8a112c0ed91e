"""The model store: canonical, mmap-able model files plus their manifest (public).

:func:`write` builds a store entry from named torch tensors, :func:`read` returns its
:class:`~gpu_pool.manifest.Manifest`, :func:`read_metadata` what else the writer recorded (a
model's quantization) and :func:`verify` re-hashes it (all in :mod:`~gpu_pool.store.entry`);
:mod:`~gpu_pool.store.fingerprint` is the content hash that lets models share resident tensors,
and :mod:`~gpu_pool.store.trust` is how the daemon checks a client's manifest against the store
entries it trusts.
"""

from gpu_pool.store.entry import DATA_ALIGN, MANIFEST_FILE, TENSORS_FILE, read, read_metadata, verify, write

__all__ = ["DATA_ALIGN", "MANIFEST_FILE", "TENSORS_FILE", "read", "read_metadata", "verify", "write"]
