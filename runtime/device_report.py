"""The device record the node agent publishes for each pool (the scheduler's device report).

The scheduler places instances with it (Tangram Eq. 3 over live residency: free, evictable
and per-model resident bytes, the measured load bandwidth) and ``/v1/cluster`` shows it,
with the agent's pre-warmed workers and their failing starts (:meth:`WarmPool.report
<runtime.warm_pool.WarmPool.report>`).
"""

from __future__ import annotations

from typing import Any


def read_stats(socket_path: str) -> dict[str, Any]:
    """The pool's stats (blocking: a short session of its own)."""
    from gpu_pool.client import PoolClient

    with PoolClient(socket_path, timeout=5.0) as client:
        return client.stats()


def device_record(node: str, device: str, stats: dict[str, Any], workers: dict[str, Any]) -> dict[str, Any]:
    """The record of ``node``'s ``device`` from its pool's ``stats`` and the agent's ``workers``
    report (merged in as is)."""
    return {
        "node": node,
        "device": device,
        "capacity_bytes": stats["capacity_bytes"],
        "free_bytes": stats["free_bytes"],
        "evictable_bytes": max(0, stats["resident_bytes"] - stats["pinned_bytes"]),
        "resident_bytes": stats["resident_bytes"],
        "pinned_bytes": stats["pinned_bytes"],
        "kv_bytes": stats["kv_bytes"],
        "prefix_bytes": stats.get("prefix_bytes", 0),  # published prefix KV (evictable)
        "bytes_loaded": stats["bytes_loaded"],
        "bytes_reused": stats["bytes_reused"],
        "bytes_moved": stats["bytes_moved"],
        "load_bandwidth": stats["load_bandwidth"],
        "sessions": stats["sessions"],
        "models": {m: v["resident_bytes"] for m, v in stats["models"].items()},
        **workers,
    }
