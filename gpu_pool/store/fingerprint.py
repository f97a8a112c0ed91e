"""Content fingerprints of tensors: xxh3-128 over dtype, shape and bytes.

Two tensors with the same fingerprint are the same tensor for the pool, so models that
share a tensor (a common embedding, a base model under adapters) share one resident copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash


def fingerprint(dtype: str, shape: Sequence[int], data: bytes | bytearray | memoryview) -> str:
    """Hex fingerprint (32 characters) of a tensor's dtype, shape and raw bytes."""
    h = xxhash.xxh3_128()
    h.update(f"{dtype}|{','.join(str(int(d)) for d in shape)}|".encode())
    h.update(data)
    return h.hexdigest()
