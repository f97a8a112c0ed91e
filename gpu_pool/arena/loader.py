"""Grouping of load copies (Tangram §4): few, large, parallel copies.

Pure Python. Jobs that are adjacent both in the store file and in the arena coalesce into
one copy; copies larger than ``max_chunk`` split so that every worker thread has work;
small copies batch into groups of at least ``min_group`` bytes (Tangram's empirical 8 MB)
so that per-copy overhead is amortised.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpu_pool.arena.base import CopyJob

MIN_GROUP_BYTES = 8 << 20
MAX_CHUNK_BYTES = 64 << 20


def coalesce(jobs: Iterable[CopyJob]) -> list[CopyJob]:
    """Merge jobs contiguous in both source file and arena (input order is kept otherwise)."""
    out: list[CopyJob] = []
    for job in sorted(jobs, key=lambda j: (j.file, j.src)):
        if job.nbytes == 0:
            continue
        last = out[-1] if out else None
        if (
            last is not None
            and last.file == job.file
            and last.src + last.nbytes == job.src
            and last.dst + last.nbytes == job.dst
        ):
            out[-1] = CopyJob(last.file, last.src, last.dst, last.nbytes + job.nbytes)
        else:
            out.append(job)
    return out


def group_copies(
    jobs: Iterable[CopyJob], min_group: int = MIN_GROUP_BYTES, max_chunk: int = MAX_CHUNK_BYTES
) -> list[list[CopyJob]]:
    """Coalesced, chunked and batched copy groups; each group is one unit of parallel work."""
    if min_group <= 0 or max_chunk <= 0:
        raise ValueError("min_group and max_chunk must be > 0")
    groups: list[list[CopyJob]] = []
    batch: list[CopyJob] = []
    batch_bytes = 0
    for job in coalesce(jobs):
        for start in range(0, job.nbytes, max_chunk):
            n = min(max_chunk, job.nbytes - start)
            piece = CopyJob(job.file, job.src + start, job.dst + start, n)
            if n >= min_group:
                groups.append([piece])
                continue
            batch.append(piece)
            batch_bytes += n
            if batch_bytes >= min_group:
                groups.append(batch)
                batch, batch_bytes = [], 0
    if batch:
        groups.append(batch)
    return groups
