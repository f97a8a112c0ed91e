"""Parsed manifests by the hash of their encoding (the daemon's acquire fast path)."""

from __future__ import annotations

from collections import OrderedDict

import xxhash

from gpu_pool.manifest import Manifest
from gpu_pool.wire.protocol import decode_reply


class ManifestCache:
    """Parsed manifests by the xxh3 of their encoding: a worker fleet sends the same few
    manifests over and over, and validating ~300 entries costs ~1 ms."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Manifest] = OrderedDict()

    def get(self, encoded: bytes) -> Manifest:
        key = xxhash.xxh3_128_hexdigest(encoded)
        hit = self._items.get(key)
        if hit is not None:
            self._items.move_to_end(key)
            return hit
        manifest = Manifest.from_dict(decode_reply(encoded))
        self._items[key] = manifest
        if len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return manifest
