"""What a session's last release unpinned, so that it can be pinned again without the manifest.

A standby (``runtime.assignment``) acquires its model while it is prepared, keeps views on
those placements and releases them: the model stays an inactive resident the planner may
evict or move. Its activation must pin the same tensors again and learn whether they are
still where its views point. A plain acquire sends the whole manifest (272 entries for
SmolLM2) and gets every placement back: 1.3-1.8 ms of the daemon's and the worker's time on
a 2-core host, on the cold path. The store keeps a :class:`Released` of each session's last
release instead, and ``ReuseStore.reacquire`` pins it again when every tensor is still the
same record at the same offset (none evicted, moved or reloaded since); otherwise the caller
acquires the manifest the usual way. The daemon checks the manifest against the model store
first, as it checks every acquire's (``PoolDaemon._on_reacquire``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpu_pool.manifest import Manifest

if TYPE_CHECKING:
    from gpu_pool.server.reuse_store import TensorRecord


@dataclass(frozen=True, slots=True)
class Released:
    """The tensors of a session's last acquired manifest, as its release left them."""

    manifest: Manifest  # the (trusted) manifest of the session's last acquire
    records: tuple[tuple[TensorRecord, int], ...]  # each unique tensor's record and its offset then
    bytes_reused: int  # the unique tensors' bytes: what pinning them again reuses

    @classmethod
    def of(
        cls, manifest: Manifest, keys: Mapping[str, str], tensors: Mapping[str, TensorRecord]
    ) -> Released | None:
        """What releasing ``manifest`` (its tensors' store ``keys`` by name) leaves in
        ``tensors``; None when a tensor is gone (a session-private one is dropped by the
        release: only a plain acquire brings it back)."""
        records: dict[str, tuple[TensorRecord, int]] = {}
        for key in keys.values():
            rec = tensors.get(key)
            if rec is None or rec.session_private is not None:
                return None
            records[key] = (rec, rec.offset)
        nbytes = sum(rec.entry.nbytes for rec, _ in records.values())
        return cls(manifest, tuple(records.values()), nbytes)

    def unchanged(self, tensors: Mapping[str, TensorRecord]) -> bool:
        """Whether every tensor is still the record it was, at the same offset, and loaded."""
        return all(
            tensors.get(rec.key) is rec and rec.offset == offset and not rec.loading
            for rec, offset in self.records
        )

    @property
    def keys(self) -> list[str]:
        return [rec.key for rec, _ in self.records]
