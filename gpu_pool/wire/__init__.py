"""The pool protocol on the Unix socket, shared by the daemon and :mod:`gpu_pool.client`.

:mod:`~gpu_pool.wire.protocol` frames versioned msgpack messages (never pickle),
:mod:`~gpu_pool.wire.messages` validates each request into a typed, bounded message, and
:mod:`~gpu_pool.wire.fdpass` passes descriptors (the arena and KV memfds) with ``SCM_RIGHTS``.
"""
