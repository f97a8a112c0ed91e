"""An instance's KV quota: every request of its concurrency at the model's full context, at
most half the arena (runtime.kv_quota)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.kv_quota import instance_kv_quota

GIB = 1 << 30
# SmolLM2-135M in bf16: 16-token blocks of 30 layers x K and V x 3 heads x 64 dims x 2 bytes.
SMOLLM2 = {"block_size": 16, "kv_block_bytes": 16 * 30 * 2 * 3 * 64 * 2}


def test_concurrency_times_the_full_context_in_whole_blocks() -> None:
    # 8192 tokens = 512 blocks per request; 4 requests: 2048 blocks of 368,640 bytes.
    assert instance_kv_quota(SMOLLM2, 8192, 4, 4 * GIB) == 4 * 512 * 368_640
    # A context that is not a multiple of the block size rounds up to a whole block.
    assert instance_kv_quota(SMOLLM2, 8193, 1, 4 * GIB) == 513 * 368_640


def test_capped_at_half_the_arena() -> None:
    assert instance_kv_quota(SMOLLM2, 8192, 64, GIB) == GIB // 2


@pytest.mark.parametrize(
    ("context", "concurrency", "arena"), [(0, 1, GIB), (1, 0, GIB), (1, 1, 0), (-5, 1, GIB)]
)
def test_bad_inputs_are_refused(context: int, concurrency: int, arena: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        instance_kv_quota(SMOLLM2, context, concurrency, arena)


@given(
    block_size=st.integers(1, 256),
    block_bytes=st.integers(1, 1 << 22),
    context=st.integers(1, 1 << 17),
    concurrency=st.integers(1, 1000),
    arena=st.integers(1, 1 << 40),
)
def test_quota_is_the_smaller_of_the_full_demand_and_half_the_arena(
    block_size: int, block_bytes: int, context: int, concurrency: int, arena: int
) -> None:
    profile = {"block_size": block_size, "kv_block_bytes": block_bytes}
    quota = instance_kv_quota(profile, context, concurrency, arena)
    blocks_per_request = -(-context // block_size)
    assert blocks_per_request * block_size >= context > (blocks_per_request - 1) * block_size
    assert quota == min(concurrency * blocks_per_request * block_bytes, arena // 2)
    assert quota <= arena // 2
    # More concurrency never lowers the quota.
    assert instance_kv_quota(profile, context, concurrency + 1, arena) >= quota
