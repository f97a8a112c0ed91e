"""Measured iteration times of a model at registration: LLM-Mesh's time tables (§5.2).

Prefill is timed for one prompt at powers-of-two lengths (16, 32, ... up to the context or
``max_prefill_tokens``), decode for batches of 1, 4 and 16 sequences at 64 and 512 tokens of
context: the points :class:`runtime.mesh.time_table.TimeTable` interpolates between. Each
point is one pass through the forward instances use (the CPU decode kernels included), after
untimed passes that pay the one-time costs. Longer prompts stop once one prefill takes more
than ``max_point_s``, so a large model costs seconds here, not minutes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from runtime.mesh.time_table import TimeTable

if TYPE_CHECKING:
    import torch

    from runtime.models.llama import LlamaModel

DECODE_BATCHES = (1, 4, 16)
DECODE_LENGTHS = (64, 512)
CHEAP_S = 0.25  # a point faster than this is timed three times
MIN_PREFILL_POINTS = 3  # measured before a slow point may end the prefill sweep


def measure_time_table(
    model: LlamaModel,
    kv_dtype: torch.dtype,
    block_size: int,
    max_prefill_tokens: int = 1024,
    max_point_s: float = 1.0,
) -> TimeTable:
    """The time table of ``model`` (whose weights are bound) on this machine's CPU."""
    import torch

    from runtime.models.llama import Batch

    cfg = model.config
    context = cfg.max_position_embeddings
    longest = min(max_prefill_tokens, context)
    lengths = [n for n in (16 << i for i in range(12)) if n <= longest] or [min(16, context)]
    decode_lengths = tuple(min(n, context - 1) for n in DECODE_LENGTHS)
    if decode_lengths[0] == decode_lengths[-1]:
        decode_lengths = decode_lengths[:1]
    blocks_per_seq = -(-max(*lengths, max(decode_lengths) + 1) // block_size)
    kv = torch.zeros(max(DECODE_BATCHES) * blocks_per_seq, *cfg.kv_block_shape(block_size), dtype=kv_dtype)

    def tables(batch: int) -> torch.Tensor:  # sequence i owns blocks [i * per, (i + 1) * per)
        return torch.arange(batch * blocks_per_seq).view(batch, blocks_per_seq)

    def once(batch: Batch) -> float:
        t0 = time.perf_counter()
        model.forward(batch, kv)
        return time.perf_counter() - t0

    def timed(batch: Batch) -> float:
        """The fastest of three passes when one is cheap (another process's burst on a shared
        core would otherwise stay in the table and make admissions refuse what fits)."""
        first = once(batch)
        return min(first, once(batch), once(batch)) if first < CHEAP_S else first

    def prefill(n: int) -> Batch:
        pos = torch.arange(n)
        return Batch(pos % cfg.vocab_size, pos, pos, [n], [n], tables(1))

    def decode(b: int, length: int) -> Batch:
        table = tables(b)
        pos = torch.full((b,), length - 1)
        slots = table[:, (length - 1) // block_size] * block_size + (length - 1) % block_size
        return Batch(pos % cfg.vocab_size, pos, slots, [1] * b, [length] * b, table)

    # One-time costs (thread pool, allocator growth, kernel setup) go to untimed passes.
    for _ in range(2):
        once(prefill(lengths[0]))
        once(decode(1, decode_lengths[0]))

    prefill_lengths: list[int] = []
    prefill_s: list[float] = []
    for n in lengths:
        seconds = timed(prefill(n))
        prefill_lengths.append(n)
        prefill_s.append(seconds)
        if seconds > max_point_s and len(prefill_lengths) >= MIN_PREFILL_POINTS:
            break
    grid = [[timed(decode(b, length)) for length in decode_lengths] for b in DECODE_BATCHES]
    return TimeTable(
        tuple(prefill_lengths),
        tuple(_capped_by_later(prefill_s)),
        DECODE_BATCHES,
        decode_lengths,
        _capped_grid(grid),
    )


def _capped_by_later(values: list[float]) -> list[float]:
    """Each value at most every later one: more work never takes less time, so a point above
    a larger one is a burst of another process (an outlier upwards would make admissions
    refuse requests the device can serve)."""
    out = list(values)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def _capped_grid(grid: list[list[float]]) -> tuple[tuple[float, ...], ...]:
    """:func:`_capped_by_later` along lengths, then along batch sizes."""
    rows = [_capped_by_later(row) for row in grid]
    columns = [_capped_by_later(list(col)) for col in zip(*rows, strict=True)]
    return tuple(tuple(col[b] for col in columns) for b in range(len(rows)))
