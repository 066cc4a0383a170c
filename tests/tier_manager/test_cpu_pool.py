import os
import random
import stat
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import shm_bytes_used
from tierstack.config import MiB, CpuPoolConfig
from tierstack.errors import CpuPoolFullError, InvalidArgumentError
from tierstack.services.tier_manager.arena_files import ARENA_PREFIX
from tierstack.services.tier_manager.cpu_pool import CpuPool


def _arenas(shm_dir):
    return sorted(p for p in shm_dir.iterdir() if p.name.startswith(ARENA_PREFIX))


def _least_start_seconds(shm_dir, size: int, tries: int = 5) -> float:
    """The quickest of `tries` starts (and closes) of a pool capped at `size` bytes: the
    least is the start's own cost, whatever else the machine runs."""
    least = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        with CpuPool(CpuPoolConfig(size=size, shm_dir=str(shm_dir))) as pool:
            least = min(least, time.perf_counter() - start)
            assert pool.capacity == size and pool.arenas == [] and _arenas(shm_dir) == []
        assert list(shm_dir.iterdir()) == []  # the lock file goes too
    return least


def test_nothing_is_reserved_at_start_and_a_64_gib_cap_starts_at_once(shm_dir):
    """A 64 GiB cap starts as quickly as a 4 MiB one: measured against it in the same test,
    not against the clock. Work that grows with the cap (reserving or touching its memory:
    seconds) is thousands of times the small pool's start."""
    _least_start_seconds(shm_dir, 4 * MiB, tries=1)  # imports and first-use costs, uncounted
    small = _least_start_seconds(shm_dir, 4 * MiB)
    large = _least_start_seconds(shm_dir, 64 << 30)
    assert large < 20 * small, (large, small)


def test_large_buffers_get_arenas_of_their_own_small_ones_share_and_idle_ones_go_back(shm_dir):
    config = CpuPoolConfig(size=5 * MiB, shm_dir=str(shm_dir), keep_empty_seconds=60)
    with CpuPool(config) as pool:
        shared = pool.shared_arena
        assert shared == 80 * 1024 and pool.shared_limit == 20 * 1024  # 1/64 of a small pool
        a, b = pool.allocate(2 * MiB), pool.allocate(5_000)
        c = pool.allocate(5_000)  # small: in b's arena, after it
        assert [x.size for x in pool.arenas] == [2 * MiB, shared]
        assert (c.arena, c.offset) == (b.arena, 8192)  # rounded to 4 KiB pages
        for info in pool.arenas:
            st = os.stat(info.path)
            assert stat.S_IMODE(st.st_mode) == 0o600 and pool.instance_id in info.path
        assert shm_bytes_used(shm_dir) == 2 * MiB + shared
        assert pool.used_bytes == 2 * MiB + 2 * 8192
        pool.free(a)
        assert pool.used_bytes == 2 * 8192 and pool.arena_bytes == 2 * MiB + shared
        again = pool.allocate(2 * MiB - 5)  # same rounded size: the empty arena is reused
        assert again.arena == a.arena and pool.created == 2
        pool.free(again)
        pool.free(b)
        assert pool.trim(now=time.monotonic() + 61) == 1  # idle past keep_empty_seconds
        assert pool.epoch == 1 and [x.index for x in pool.arenas] == [c.arena]
        assert shm_bytes_used(shm_dir) == shared
        d = pool.allocate(2 * MiB)
        assert d.arena not in (a.arena, b.arena)  # an id is never reused for another file


def test_the_cap_is_never_exceeded_and_empty_arenas_make_room_first(shm_dir):
    config = CpuPoolConfig(size=4 * MiB, shm_dir=str(shm_dir), keep_empty_seconds=3600)
    with CpuPool(config) as pool:
        held = [pool.allocate(MiB) for _ in range(4)]
        with pytest.raises(CpuPoolFullError, match=r"raise cpu_pool.size \(or the host budget\)"):
            pool.allocate(1)
        pool.free(held.pop())
        pool.free(held.pop())
        big = pool.allocate(2 * MiB)  # the two empty 1 MiB arenas are returned for it
        assert pool.arena_bytes == 4 * MiB and pool.epoch == 2
        for b in held + [big]:
            pool.view(b)[:] = b"\xab" * b.nbytes
        assert shm_bytes_used(shm_dir) <= 4 * MiB
        with pytest.raises(CpuPoolFullError, match="larger than the whole CPU pool"):
            pool.allocate(5 * MiB)
        with pytest.raises(InvalidArgumentError):
            pool.allocate(0)


def test_any_mix_of_sizes_fits_while_the_arenas_leave_room_and_their_number_stays_bounded(shm_dir):
    """4000 random allocations and frees of sizes from 1 byte to 1 MiB (a few large, most
    small) in a 16 MiB pool: every allocation made while the arenas in use leave room for
    one more arena of the largest kind (a large buffer's own, or a 256 KiB shared one)
    succeeds with no eviction, the arenas' bytes never exceed the cap, and the arenas stay
    within `max_arenas`, far fewer than the buffers."""
    cap, largest = 16 * MiB, MiB
    rng = random.Random(13)
    evictions = []
    pool = CpuPool(CpuPoolConfig(size=cap, shm_dir=str(shm_dir), keep_empty_seconds=3600),
                   on_full=lambda n: evictions.append(n) or False)
    held, tried, most, arenas = [], 0, 0, 0
    with pool:
        room = max(largest, pool.shared_arena)

        def in_use() -> int:  # the bytes of arenas that hold a buffer (empty ones can go)
            return sum(a.size for a in pool.arenas) - sum(
                a.size for a in pool.arenas if not any(b.arena == a.index for b in held))

        for _ in range(4000):
            if held and (rng.random() < 0.45 or in_use() > cap - room):
                pool.free(held.pop(rng.randrange(len(held))))
                continue
            n = rng.choice([rng.randint(1, 8192), rng.randint(1, 200_000), rng.randint(1, largest)])
            assert in_use() <= cap - room
            held.append(pool.allocate(n))  # must not fail
            tried += 1
            most, arenas = max(most, len(held)), max(arenas, len(pool.arenas))
            assert pool.arena_bytes <= cap and len(pool.arenas) <= pool.max_arenas
        assert evictions == [] and tried > 1500 and arenas < most  # the small ones share
        assert shm_bytes_used(shm_dir) <= cap


def test_a_hundred_thousand_buffers_under_ulimit_n_1024_take_a_few_arenas_and_no_descriptors(shm_dir):
    """One arena per buffer needed a descriptor each (Python's mmap keeps one): every
    allocation failed after ~1,000. Now 100,000 buffers of 4 KiB share a few arenas, and the
    process's descriptors do not grow with them."""
    code = f"""
import os, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
from tierstack.config import CpuPoolConfig
from tierstack.services.tier_manager.cpu_pool import CpuPool
before = len(os.listdir("/proc/self/fd"))
with CpuPool(CpuPoolConfig(size=1 << 30, shm_dir={str(shm_dir)!r})) as pool:
    held = [pool.allocate(4096) for _ in range(100_000)]
    for i in (0, 777, 99_999):
        pool.view(held[i])[:8] = i.to_bytes(8, "little")
    assert all(int.from_bytes(pool.view(held[i])[:8], "little") == i for i in (0, 777, 99_999))
    print(len(pool.arenas), pool.max_arenas, len(os.listdir("/proc/self/fd")) - before)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    arenas, bound, descriptors = map(int, out.stdout.split())
    assert arenas == 25 and arenas <= bound  # 100,000 x 4 KiB in 16 MiB shared arenas
    assert descriptors <= 2  # the pool's lock file; no arena keeps one


def test_eviction_callback_is_asked_before_failing(shm_dir):
    held = []

    def evict(nbytes: int) -> bool:
        if not held:
            return False
        pool.free(held.pop(0))
        return True

    pool = CpuPool(CpuPoolConfig(size=2 * MiB, shm_dir=str(shm_dir)), on_full=evict)
    with pool:
        held.extend(pool.allocate(512 * 1024) for _ in range(4))
        extra = pool.allocate(512 * 1024)  # needs one eviction
        assert len(held) == 3 and extra is not None


def test_another_process_maps_an_arena_and_sees_the_bytes(shm_dir):
    with CpuPool(CpuPoolConfig(size=2 * MiB, shm_dir=str(shm_dir))) as pool:
        buf = pool.allocate(4096)
        pool.view(buf)[:] = bytes(range(256)) * 16
        arena = {a.index: a for a in pool.arenas}[buf.arena]
        code = (
            "import mmap,sys; f=open(sys.argv[1],'r+b'); m=mmap.mmap(f.fileno(),0);"
            "o=int(sys.argv[2]); assert m[o:o+4096]==bytes(range(256))*16; m[o]=7"
        )
        subprocess.run([sys.executable, "-c", code, arena.path, str(buf.offset)], check=True)
        assert pool.view(buf)[0] == 7  # the worker's write is visible: one shared mapping


def test_stale_arenas_of_a_crashed_pool_are_reclaimed(shm_dir):
    code = (
        "import os,sys; from tierstack.config import CpuPoolConfig;"
        "from tierstack.services.tier_manager.cpu_pool import CpuPool;"
        "p=CpuPool(CpuPoolConfig(size=1<<20, shm_dir=sys.argv[1])); p.allocate(40_000); p.allocate(50_000);"
        "os._exit(0)"  # crash: no close, arenas and lock file left behind
    )
    subprocess.run([sys.executable, "-c", code, str(shm_dir)], check=True)
    assert len(_arenas(shm_dir)) == 2 and len(list(shm_dir.iterdir())) == 3
    live = CpuPool(CpuPoolConfig(size=1 << 20, shm_dir=str(shm_dir)))
    try:
        live.allocate(4096)
        assert [p.name for p in _arenas(shm_dir)] == [os.path.basename(live.arenas[0].path)]
        # A second pool must not reclaim the arenas of a living one.
        with CpuPool(CpuPoolConfig(size=1 << 20, shm_dir=str(shm_dir))):
            assert os.path.exists(live.arenas[0].path)
    finally:
        live.close()
    assert list(shm_dir.iterdir()) == []


def test_concurrent_allocation_stays_within_budget(shm_dir):
    with CpuPool(CpuPoolConfig(size=8 * MiB, shm_dir=str(shm_dir), keep_empty_seconds=0)) as pool:
        errors, got = [], []

        def worker(seed: int) -> None:
            for i in range(50):
                try:
                    b = pool.allocate(4096 * (1 + (seed * 7 + i) % 40))
                except CpuPoolFullError:
                    continue
                pool.view(b)[:] = bytes([seed]) * b.nbytes
                got.append((seed, b))
                if i % 3 == 0:
                    if bytes(pool.view(b)) != bytes([seed]) * b.nbytes:
                        errors.append(b)
                    got.remove((seed, b))
                    pool.free(b)
                assert pool.arena_bytes <= pool.capacity

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert not errors
        for seed, b in got:
            assert bytes(pool.view(b)) == bytes([seed]) * b.nbytes
        assert pool.used_bytes <= pool.capacity


def test_only_a_new_arena_s_first_buffer_is_marked_zeroed(shm_dir):
    """A caller that wants zeros skips writing them only where the bytes are a new file's."""
    config = CpuPoolConfig(size=8 * MiB, shm_dir=str(shm_dir), keep_empty_seconds=60)
    with CpuPool(config) as pool:
        first = pool.allocate(2 * MiB)
        assert first.zeroed and bytes(pool.view(first)) == bytes(first.nbytes)
        pool.view(first)[:] = b"\xab" * first.nbytes
        pool.free(first)
        again = pool.allocate(2 * MiB)  # the kept empty arena, its old bytes in it
        assert again.arena == first.arena and not again.zeroed
        small, neighbour = pool.allocate(5_000), pool.allocate(5_000)
        assert small.zeroed and not neighbour.zeroed  # a shared arena's later holes may be reused


@pytest.mark.parametrize("madvise", ["populate", "unsupported"])
def test_an_arena_s_pages_are_all_there_at_creation(shm_dir, monkeypatch, madvise):
    # Several threads write an arena's pages at creation (shared_mapping.populate); a
    # kernel without MADV_POPULATE_WRITE (an unknown advice is EINVAL) gets the old way.
    from tierstack.services.tier_manager import shared_mapping
    if madvise == "unsupported":
        monkeypatch.setattr(shared_mapping, "MADV_POPULATE_WRITE", 0x7fff)
    size = 3 * shared_mapping.POPULATE_SLICE + 4096  # slices of unequal length
    with CpuPool(CpuPoolConfig(size=size, shm_dir=str(shm_dir))) as pool:
        buffer = pool.allocate(size)
        (path,) = _arenas(shm_dir)
        assert os.stat(path).st_blocks * 512 >= size  # no hole left for a later fault
        view = pool.view(buffer)
        assert view[0] == view[size // 2] == view[size - 1] == 0
        view[size - 1] = 7
        assert pool.view(buffer)[size - 1] == 7


@pytest.fixture
def small_tmpfs(mounted):
    """A real 8 MiB tmpfs, unmounted after the test (conftest's `mounted` skips, saying
    why, where this user cannot mount one: root is needed)."""
    return mounted("tmpfs", "size=8m")


def test_an_arena_larger_than_the_whole_tmpfs_is_refused_in_one_line_and_loses_nothing(small_tmpfs):
    with CpuPool(CpuPoolConfig(size=256 * MiB, shm_dir=str(small_tmpfs))) as pool:
        kept = pool.allocate(4 * MiB)
        pool.view(kept)[:3] = b"abc"
        with pytest.raises(CpuPoolFullError, match=f"larger than the whole filesystem.*{small_tmpfs} "
                                                   r"\(8388608 bytes\); grow the tmpfs"):
            pool.allocate(130 * MiB)  # past the 8 MiB tmpfs: no room could ever hold it
        assert bytes(pool.view(kept)[:3]) == b"abc" and len(_arenas(small_tmpfs)) == 1
        after = pool.allocate(2 * MiB)
        assert pool.used_bytes == 6 * MiB and after.zeroed


def test_a_pool_larger_than_its_tmpfs_evicts_at_the_tmpfs_s_room_as_at_its_cap(small_tmpfs):
    """The pool's room is the smaller of its cap (64 MiB) and what the tmpfs (8 MiB) can
    still give: past the tmpfs it asks its owner to evict, as it does at its cap (it used
    to try the arena and fail with 'No space left on device' whatever could have gone)."""
    held = []

    def evict(nbytes: int) -> bool:
        if not held:
            return False
        pool.free(held.pop(0))
        return True

    config = CpuPoolConfig(size=64 * MiB, shm_dir=str(small_tmpfs), keep_empty_seconds=3600)
    with CpuPool(config, on_full=evict) as pool:
        assert pool.free_bytes == 8 * MiB  # the tmpfs's room, not the cap's 64 MiB
        held.extend(pool.allocate(2 * MiB) for _ in range(4))  # the tmpfs is full now
        assert pool.free_bytes == 0
        for i in range(6):  # each evicts the oldest; its empty arena is returned for the new
            held.append(pool.allocate(2 * MiB))
        assert len(held) == 4 and shm_bytes_used(small_tmpfs) <= 8 * MiB
        held.clear()  # nothing evictable from here on
        with pytest.raises(CpuPoolFullError, match=r"is full \(.*nothing evictable: lower "
                                                   r"cpu_pool.size to what the filesystem holds or "
                                                   r"grow the tmpfs"):
            pool.allocate(2 * MiB)


def test_small_buffers_share_arenas_sized_from_the_tmpfs_when_it_is_smaller_than_the_cap(small_tmpfs):
    """A 4 GiB cap would share 64 MiB arenas, larger than the whole 8 MiB tmpfs: they are
    sized from the tmpfs instead (1/64 of it), so small buffers fit."""
    with CpuPool(CpuPoolConfig(size=4 << 30, shm_dir=str(small_tmpfs))) as pool:
        assert pool.shared_arena == 8 * MiB // 64
        small = [pool.allocate(5_000) for _ in range(3)]
        assert len({b.arena for b in small}) == 1 and pool.arena_bytes == pool.shared_arena


def test_a_tmpfs_someone_else_fills_is_room_the_pool_does_not_count_on(small_tmpfs):
    """Room is what the filesystem can give now: a file another process wrote there
    leaves less, and a request past that is refused at once (no arena half made)."""
    filler = small_tmpfs / "someone-else"
    filler.write_bytes(b"\1" * (5 * MiB))
    with CpuPool(CpuPoolConfig(size=64 * MiB, shm_dir=str(small_tmpfs))) as pool:
        assert pool.free_bytes <= 3 * MiB
        kept = pool.allocate(2 * MiB)
        with pytest.raises(CpuPoolFullError, match="is full"):
            pool.allocate(2 * MiB)
        assert len(_arenas(small_tmpfs)) == 1 and pool.arena_bytes == 2 * MiB  # none half made
        assert kept.arena == pool.arenas[0].index
        filler.unlink()
        pool.allocate(2 * MiB)  # room again


def test_huge_pages_that_run_out_mid_arena_are_a_full_pool_not_an_error(hugetlbfs):
    """A hugetlbfs mounted without a size states no room (statvfs: 0 blocks), so the pool
    finds out as it writes an arena's pages: that is met as a full pool, evicting first
    and refusing with the fix when nothing can go."""
    held, evicted = [], []

    def evict(nbytes: int) -> bool:
        if not held:
            return False
        evicted.append(held.pop(0))
        pool.free(evicted[-1])
        return True

    config = CpuPoolConfig(size=256 * MiB, shm_dir=str(hugetlbfs), keep_empty_seconds=0)
    with CpuPool(config, on_full=evict) as pool:
        held.append(pool.allocate(24 * MiB))  # 12 of the 16 huge pages reserved
        held.append(pool.allocate(16 * MiB))  # 8 more than are left: the first goes
        assert len(evicted) == 1 and len(held) == 1
        held.clear()
        with pytest.raises(CpuPoolFullError, match="reserve more huge pages"):
            pool.allocate(24 * MiB)
