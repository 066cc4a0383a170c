import random

import pytest

from tierstack.services.tier_manager.extents import Extent, ExtentAllocator


def test_allocations_are_aligned_disjoint_and_inside_capacity():
    alloc = ExtentAllocator(1 << 20, 4096)
    rng = random.Random(0)
    held: list[Extent] = []
    for _ in range(2000):
        if held and rng.random() < 0.45:
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            e = alloc.allocate(rng.randint(1, 40_000))
            if e is not None:
                held.append(e)
        spans = sorted(held)
        for a, b in zip(spans, spans[1:]):
            assert a.end <= b.offset
        assert all(e.offset % 4096 == 0 and e.end <= alloc.capacity for e in held)
        assert alloc.used_bytes == sum(e.length for e in held)
    for e in held:
        alloc.free(e)
    assert alloc.free_bytes == alloc.capacity
    assert alloc.largest_free() == alloc.capacity  # everything coalesced back


def test_full_allocator_returns_none_and_double_free_is_caught():
    alloc = ExtentAllocator(16 * 4096, 4096)
    e = alloc.allocate(16 * 4096)
    assert e == Extent(0, 16 * 4096)
    assert alloc.allocate(1) is None
    alloc.free(e)
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(e)


def test_reserve_marks_recovered_extents_used():
    alloc = ExtentAllocator(64 * 4096, 4096)
    alloc.reserve(Extent(8 * 4096, 4 * 4096))
    with pytest.raises(ValueError, match="not free"):
        alloc.reserve(Extent(10 * 4096, 4096))
    got = [alloc.allocate(4096) for _ in range(60)]
    assert all(g is not None and not (8 * 4096 <= g.offset < 12 * 4096) for g in got)
    assert alloc.allocate(4096) is None


def test_unaligned_extents_are_rejected():
    alloc = ExtentAllocator(64 * 4096, 4096)
    with pytest.raises(ValueError, match="aligned"):
        alloc.free(Extent(100, 4096))
