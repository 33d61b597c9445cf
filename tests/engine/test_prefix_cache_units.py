"""The prefix cache's pieces alone: the bounded sketch, the ref-counted block index, retention plans."""

from __future__ import annotations

from splitserve.engine.prefix_cache.block_pool import CachingBlockAllocator
from splitserve.engine.prefix_cache.retention import RetentionPolicy, SeenSketch


def test_the_sketch_is_bounded_and_forgets_the_oldest():
    sketch = SeenSketch(capacity=4)
    for i in range(10):
        sketch.add(bytes([i]))
    assert len(sketch) == 4
    assert bytes([0]) not in sketch and all(bytes([i]) in sketch for i in range(6, 10))
    sketch.add(bytes([6]))  # seen again: the most recent now
    sketch.add(bytes([10]))
    assert bytes([6]) in sketch and bytes([7]) not in sketch


def _allocator(num_blocks: int, num_taken: int) -> tuple[CachingBlockAllocator, list[bytes], list[int]]:
    """An allocator, the names it evicts (in order), and `num_taken` blocks a request holds."""
    blocks = CachingBlockAllocator(num_blocks)
    evicted: list[bytes] = []
    blocks.on_evict = evicted.append
    taken = blocks.allocate(num_taken)
    assert taken is not None
    return blocks, evicted, taken


def test_kept_blocks_are_freed_only_by_eviction_and_shared_ones_never():
    blocks, evicted, a = _allocator(6, 4)
    assert blocks.insert(b"u0", a[:2], 32) and blocks.insert(b"u1", a[2:4], 32)
    assert not blocks.insert(b"u0", a[2:4], 32)  # a name is indexed once
    blocks.free(a)  # the request ends: its blocks stay kept, idle, and count as free
    assert blocks.num_free_blocks == 6 and blocks.lookup(b"u0") is not None
    blocks.share(a[:2])  # another request hits u0
    assert blocks.num_free_blocks == 4
    got = blocks.allocate(4)  # needs the idle u1's blocks: u1 is evicted, u0 (shared) is not
    assert got is not None and evicted == [b"u1"] and blocks.lookup(b"u0") is not None
    assert set(got) & set(a[:2]) == set()
    assert blocks.allocate(1) is None  # all-or-nothing: nothing is evicted for a refused allocation
    assert evicted == [b"u1"]
    blocks.free(got)
    blocks.free(a[:2])
    assert blocks.num_free_blocks == 6
    assert all(blocks.ref_count(b) == 0 for b in range(6))


def test_deepest_units_are_evicted_first():
    blocks, evicted, ids = _allocator(3, 3)
    for i, b in enumerate(ids):
        blocks.insert(bytes([i]), [b], 16)
    blocks.free(ids)
    blocks.allocate(1)
    assert evicted == [bytes([2])]  # the chain's root stays usable longest


def test_retention_plans_prompt_end_interval_and_second_sighting_junction():
    sketch = SeenSketch()
    policy = RetentionPolicy(unit=32, interval=64, selective=True, sketch=sketch)
    chain = [bytes([i]) for i in range(6)]  # 192 tokens of whole units
    assert policy.plan(chain, 0, 200, lambda key: False) == [64, 128, 192, 200]
    policy.record(chain)
    other = [*chain[:3], b"x", b"y"]  # shares 3 units (96 tokens), then differs
    assert policy.plan(other, 0, 170, lambda key: False) == [64, 96, 128, 170]
    assert policy.plan(other, 100, 170, lambda key: False) == [128, 170]  # only past the hit
    assert policy.plan(other, 0, 170, lambda key: False, first_admission=False) == [64, 128, 170]
    plain = RetentionPolicy(unit=32, interval=0, selective=False, sketch=SeenSketch())
    assert plain.plan(chain, 0, 200, lambda key: True) == [200]


def test_pre_end_is_the_last_unit_boundary_before_the_last_token():
    policy = RetentionPolicy(unit=32, interval=0, selective=False, sketch=SeenSketch())
    assert policy.pre_end(0, 200) == 192
    assert policy.pre_end(0, 192) == 160  # the end itself is no use: its last token is computed
    assert policy.pre_end(0, 33) == 32
    assert policy.pre_end(0, 32) is None  # nothing before the first unit
    assert policy.pre_end(192, 200) is None  # not past the hit
