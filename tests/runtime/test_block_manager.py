"""The block manager's prefix cache: accounting invariants, property-tested.

A simulated KV memory records, for every slot written, the token prefix whose last token it
holds; after every operation each live sequence must see exactly its own prefix in every slot
it counts as computed, so a hit for a different prefix (or a write into a shared block) fails.
The prefix store beside it is the pure-Python stand-in for the pool's ``kv_publish`` /
``kv_restore`` (the pool's own are tested against a real daemon in tests/gpu_pool).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import given, settings

from runtime.engine.block_manager import BlockManager, RangeBlockSource, block_hash, root_hash
from runtime.engine.sampling import SamplingParams
from runtime.engine.sequence import Sequence

PARAMS = SamplingParams(max_tokens=64, ignore_eos=True)
Slots = dict[int, tuple[int, ...]]  # slot in a block -> token prefix whose KV it holds


@dataclass
class World:
    """Physical KV contents shared by the manager's blocks and a cross-instance store."""

    kv: dict[int, Slots] = field(default_factory=dict)
    store: dict[bytes, Slots] = field(default_factory=dict)
    recent: list[bytes] = field(default_factory=list)  # the last restore from a first block
    num_restores: int = 0


class SharingSource(RangeBlockSource):
    def __init__(self, num_blocks: int, world: World) -> None:
        super().__init__(num_blocks)
        self.world = world
        self.total = num_blocks

    @property
    def shares_prefixes(self) -> bool:
        return True

    def restore(self, hashes: list[bytes], block_ids: list[int], first: bool = False) -> int:
        self.world.num_restores += 1
        if first:
            self.world.recent = list(hashes)
        n = 0
        for h, b in zip(hashes, block_ids, strict=True):
            if h not in self.world.store:
                break
            self.world.kv[b] = dict(self.world.store[h])
            n += 1
        return n

    def publish(self, hashes: list[bytes], block_ids: list[int]) -> None:
        for h, b in zip(hashes, block_ids, strict=True):
            self.world.store.setdefault(h, dict(self.world.kv[b]))


def admit(bm: BlockManager, seq: Sequence) -> None:
    assert bm.can_allocate(seq)
    bm.allocate(seq)


def forward(world: World, bm: BlockManager, seq: Sequence) -> None:
    """What the model does: write the uncached positions' KV, then the engine commits."""
    tokens = seq.token_ids
    for p in range(seq.num_cached, len(tokens)):
        block = seq.block_table[p // bm.block_size]
        world.kv.setdefault(block, {})[p % bm.block_size] = tuple(tokens[: p + 1])
    seq.num_cached = len(seq)
    bm.commit(seq)


def check(world: World, bm: BlockManager, source: SharingSource, live: list[Sequence]) -> None:
    held = set(bm.ref)
    free, evictable, spare = set(bm.free), set(bm.evictable), set(source._free)
    assert len(free) == len(bm.free) and len(spare) == len(source._free)
    parts = [held, free, evictable, spare]
    assert sum(map(len, parts)) == source.total, "a block is in two places or lost"
    assert set().union(*parts) == set(range(source.total))
    counts: dict[int, int] = {}
    for seq in live:
        assert len(set(seq.block_table)) == len(seq.block_table)
        for b in seq.block_table:
            counts[b] = counts.get(b, 0) + 1
    assert counts == bm.ref, "ref counts must equal holders"
    for h, b in bm.cached.items():
        assert bm.hash_of[b] == h and b not in free and b not in spare
    assert all(b in bm.hash_of for b in evictable)
    for seq in live:
        tokens = seq.token_ids
        for p in range(seq.num_cached):
            slot = world.kv.get(seq.block_table[p // bm.block_size], {}).get(p % bm.block_size)
            assert slot == tuple(tokens[: p + 1]), f"seq {seq.seq_id} reads another prefix's KV at {p}"


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(1, 3), min_size=1, max_size=14)),
        st.tuples(st.just("decode"), st.integers(0, 7), st.integers(1, 3)),
        st.tuples(st.just("finish"), st.integers(0, 7)),
        st.tuples(st.just("flush"), st.just(0)),
        st.tuples(st.just("trim"), st.integers(0, 4)),
        # A new instance over the same store, which comes with up to N blocks of the prefix the
        # last instance restored from a first block (the pool's prefetch with an acquire).
        st.tuples(st.just("restart"), st.integers(0, 3)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, block_size=st.integers(1, 4), num_blocks=st.integers(4, 24), refill=st.integers(1, 4))
def test_prefix_cache_accounting(ops: list[tuple], block_size: int, num_blocks: int, refill: int) -> None:
    world = World()
    source = SharingSource(num_blocks, world)
    bm = BlockManager(source, block_size, refill, model_key="m")
    live: list[Sequence] = []
    ids = iter(range(1, 10_000))
    for op in ops:
        kind = op[0]
        if kind == "add":
            seq = Sequence(next(ids), list(op[1]), PARAMS)
            if bm.can_allocate(seq):
                bm.allocate(seq)
                assert seq.cached_tokens == seq.num_cached < len(seq)
                assert seq.num_cached % block_size == 0
                live.append(seq)
                forward(world, bm, seq)
        elif kind == "decode" and live:
            seq = live[op[1] % len(live)]
            seq.output_ids.append(op[2])
            if bm.can_append(seq):
                bm.append(seq)
                forward(world, bm, seq)
            else:
                seq.output_ids.pop()
        elif kind == "finish" and live:
            bm.deallocate(live.pop(op[1] % len(live)))
        elif kind == "flush":
            bm.flush_publish()
        elif kind == "trim":
            bm.trim(op[1])
        elif kind == "restart":
            bm.flush_publish()
            for seq in live:
                bm.deallocate(seq)
            live.clear()
            bm.trim(0)
            world.kv.clear()
            bm = BlockManager(source, block_size, refill, model_key="m")
            prefetch(world, bm, source, op[1])
        check(world, bm, source, live)


def prefetch(world: World, bm: BlockManager, source: SharingSource, max_blocks: int) -> None:
    """What the pool does for an acquire's prefix: the stored run of the remembered hashes, in
    blocks of their own, adopted filled."""
    run = list(itertools.takewhile(lambda h: h in world.store, world.recent))[:max_blocks]
    blocks = source.acquire(len(run)) if run else None
    if blocks is not None:
        for h, b in zip(run, blocks, strict=True):
            world.kv[b] = dict(world.store[h])
        bm.adopt_prefix(blocks, run)


def test_adopted_prefix_blocks_are_hits_counted_as_restored_without_a_restore() -> None:
    """A new instance's engine holds the prefix its acquire brought (``adopt_prefix``): a prompt
    that starts with it reuses those blocks without asking the source, and the request and the
    stats count them as restored; a prompt that does not restores from its first block."""
    world = World()
    source = SharingSource(16, world)
    first = BlockManager(source, 2, model_key="m")
    seq = Sequence(1, [1, 2, 3, 4, 5], PARAMS)  # two full blocks
    admit(first, seq)
    assert world.num_restores == 1 and world.recent == seq.block_hashes[:2]
    forward(world, first, seq)
    first.flush_publish()
    first.deallocate(seq)
    first.trim(0)  # the first instance ends: its memory is gone
    world.kv.clear()
    hashes = list(seq.block_hashes[:2])
    second = BlockManager(source, 2, model_key="m")
    prefetch(world, second, source, 8)
    assert set(second.cached) == set(hashes) and len(second.evictable) == 2
    again = Sequence(2, [1, 2, 3, 4, 9], PARAMS)
    admit(second, again)
    assert world.num_restores == 1, "the adopted blocks were hits: no restore"
    assert again.cached_tokens == 4 and second.stats.restored_tokens == 4 and second.stats.hit_tokens == 0
    check(world, second, source, [again])
    forward(world, second, again)
    other = Sequence(3, [7, 7, 7, 7, 7], PARAMS)
    admit(second, other)
    assert world.num_restores == 2 and world.recent == other.block_hashes[:2]
    later = Sequence(4, [1, 2, 3, 4, 6], PARAMS)  # the same blocks again: plain hits now
    admit(second, later)
    assert second.stats.restored_tokens == 4 and second.stats.hit_tokens == 4


def test_a_repeated_prompt_reuses_its_full_blocks_and_computes_its_last_token() -> None:
    bm = BlockManager(RangeBlockSource(16), 4)
    first = Sequence(1, list(range(10, 22)), PARAMS)  # 12 tokens: 3 full blocks
    admit(bm, first)
    assert first.num_cached == 0 and first.cached_tokens == 0
    first.num_cached = len(first)
    bm.commit(first)
    again = Sequence(2, list(range(10, 22)), PARAMS)
    admit(bm, again)
    # The third block is full but holds the last token, whose logits the step needs.
    assert again.num_cached == again.cached_tokens == 8
    assert again.block_table[:2] == first.block_table[:2] and again.block_table[2] != first.block_table[2]
    longer = Sequence(3, [*range(10, 22), 7], PARAMS)
    admit(bm, longer)
    assert longer.num_cached == 12 and longer.block_table[:3] == first.block_table[:3]
    assert bm.ref[first.block_table[0]] == 3


def test_other_models_and_other_prefixes_miss() -> None:
    a = BlockManager(RangeBlockSource(8), 2, model_key="model-a")
    b = BlockManager(RangeBlockSource(8), 2, model_key="model-b")
    assert root_hash("model-a") != root_hash("model-b")
    assert block_hash(a.root, [1, 2]) != block_hash(b.root, [1, 2])
    # Same last block, different parent: a different hash.
    assert block_hash(block_hash(a.root, [1, 2]), [3, 4]) != block_hash(block_hash(a.root, [9, 2]), [3, 4])
    seq = Sequence(1, [1, 2, 3, 4, 5], PARAMS)
    admit(a, seq)
    seq.num_cached = len(seq)
    a.commit(seq)
    other = Sequence(2, [1, 2, 9, 4, 5], PARAMS)
    admit(a, other)
    assert other.num_cached == 2  # the first block only


def test_released_prefix_blocks_are_reclaimed_least_recent_first() -> None:
    bm = BlockManager(RangeBlockSource(4), 2, refill_blocks=4)
    seq = Sequence(1, [1, 2, 3, 4, 5], PARAMS)  # 3 blocks, 2 full
    admit(bm, seq)
    seq.num_cached = len(seq)
    bm.commit(seq)
    first, second, tail = seq.block_table
    bm.deallocate(seq)
    assert list(bm.evictable) == [second, first] and tail in bm.free
    other = Sequence(2, [9, 9, 9, 9, 9, 9], PARAMS)  # 3 blocks: 2 free ones, then 1 reclaimed
    admit(bm, other)
    assert other.num_cached == 0 and second in other.block_table and first not in other.block_table
    assert list(bm.evictable) == [first] and list(bm.cached.values()) == [first]
    # A hit on the last evictable block cannot also be reclaimed to give its sequence a 2nd block.
    assert not bm.can_allocate(Sequence(3, [1, 2, 3], PARAMS))
