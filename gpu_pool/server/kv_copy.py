"""Prefix KV copies between the arena and a session's KV memory (:mod:`gpu_pool.server.prefix_kv`).

On a CPU pool each session's KV blocks live in memory of its own (:mod:`gpu_pool.arena.kv_memory`):
publishing copies a block from there into the arena, restoring copies it back. On CUDA the KV
blocks are the arena's own: a copy is a move within it. The daemon copies, so no KV bytes cross
the socket, and it holds its lock over the copies: nothing may move or evict those regions.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from gpu_pool.errors import PoolError

if TYPE_CHECKING:
    from gpu_pool.arena.base import BaseArena
    from gpu_pool.arena.kv_memory import SessionKV
    from gpu_pool.server.prefix_kv import BlockCopy

# Copies up to this many bytes run on a CPU pool's event loop (they hold it for at most ~0.4 ms);
# larger ones, and a CUDA pool's, go to a thread. A restore is on a cold start's first request,
# and the thread hop cost more than the copy: two SmolLM2 blocks (720 KiB, into fresh KV pages)
# copy in 0.27 ms, and the restore's round trip went from 1.32 to 0.72 ms median here.
INLINE_COPY_BYTES = 1 << 20


class KVCopier:
    """Copies blocks for one arena; ``private_kv``: sessions' KV blocks live in their own memory."""

    def __init__(self, arena: BaseArena, private_kv: bool) -> None:
        self.arena = arena
        self.private_kv = private_kv

    async def copy(self, kv: SessionKV | None, copies: list[BlockCopy], publish: bool) -> None:
        """Session KV ``kv`` -> arena (``publish``) or back: inline when small
        (:data:`INLINE_COPY_BYTES`) on a CPU pool, else in a thread (a device copy may wait
        for the device: never on the loop)."""
        if self.private_kv and sum(c.size for c in copies) <= INLINE_COPY_BYTES:
            self._copy_blocks(kv, copies, publish)
        else:
            await asyncio.to_thread(self._copy_blocks, kv, copies, publish)

    def _copy_blocks(self, kv: SessionKV | None, copies: list[BlockCopy], publish: bool) -> None:
        for c in copies:
            if not self.private_kv:
                self.arena.move(c.dst, c.src, c.size)
            elif kv is None:
                raise PoolError("the session has no KV memory")
            elif publish:
                self.arena.copy_from_fd(kv.fd, c.src, c.dst, c.size)
            else:
                self.arena.copy_to_fd(kv.fd, c.dst, c.src, c.size)
