import os
import stat
import subprocess
import sys
import threading

import pytest

from tests.conftest import shm_bytes_used
from tierstack.config import MiB, CpuPoolConfig
from tierstack.errors import CpuPoolFullError, InvalidArgumentError
from tierstack.services.tier_manager.cpu_pool import CpuPool


def test_arenas_are_private_files_sized_to_the_budget(shm_dir):
    with CpuPool(CpuPoolConfig(size=5 * MiB, arena_size=2 * MiB, shm_dir=str(shm_dir))) as pool:
        assert [a.size for a in pool.arenas] == [2 * MiB, 2 * MiB, 1 * MiB]
        for a in pool.arenas:
            st = os.stat(a.path)
            assert stat.S_IMODE(st.st_mode) == 0o600
            assert pool.instance_id in a.path
        assert shm_bytes_used(shm_dir) == 5 * MiB
    assert list(shm_dir.iterdir()) == []


def test_pool_never_exceeds_its_size(shm_dir):
    with CpuPool(CpuPoolConfig(size=4 * MiB, arena_size=1 * MiB, shm_dir=str(shm_dir))) as pool:
        held = [pool.allocate(300_000) for _ in range(12)]  # 3 x 303 KiB per arena
        with pytest.raises(CpuPoolFullError, match="raise cpu_pool.size"):
            pool.allocate(300_000)
        assert pool.used_bytes <= pool.capacity == 4 * MiB
        for b in held:
            pool.view(b)[:] = b"\xab" * b.nbytes
        assert shm_bytes_used(shm_dir) <= 4 * MiB
        with pytest.raises(CpuPoolFullError, match="arena_size"):
            pool.allocate(2 * MiB)
        with pytest.raises(InvalidArgumentError):
            pool.allocate(0)


def test_buffers_are_aligned_and_do_not_overlap(shm_dir):
    with CpuPool(CpuPoolConfig(size=4 * MiB, arena_size=2 * MiB, shm_dir=str(shm_dir))) as pool:
        bufs = [pool.allocate(n) for n in (1, 4095, 4097, 100_000, 12345)]
        for i, b in enumerate(bufs):
            assert b.offset % 4096 == 0
            pool.view(b)[:] = bytes([i]) * b.nbytes
        for i, b in enumerate(bufs):
            assert bytes(pool.view(b)) == bytes([i]) * b.nbytes


def test_eviction_callback_is_asked_before_failing(shm_dir):
    held = []

    def evict(nbytes: int) -> bool:
        if not held:
            return False
        pool.free(held.pop(0))
        return True

    pool = CpuPool(CpuPoolConfig(size=2 * MiB, arena_size=2 * MiB, shm_dir=str(shm_dir)),
                   on_full=evict)
    with pool:
        held.extend(pool.allocate(512 * 1024) for _ in range(4))
        extra = pool.allocate(512 * 1024)  # needs one eviction
        assert len(held) == 3 and extra is not None


def test_another_process_maps_an_arena_and_sees_the_bytes(shm_dir):
    with CpuPool(CpuPoolConfig(size=2 * MiB, arena_size=2 * MiB, shm_dir=str(shm_dir))) as pool:
        buf = pool.allocate(4096)
        pool.view(buf)[:] = bytes(range(256)) * 16
        arena = pool.arenas[buf.arena]
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
        "p=CpuPool(CpuPoolConfig(size=1<<20, arena_size=1<<20, shm_dir=sys.argv[1]));"
        "os._exit(0)"  # crash: no close, arenas left behind
    )
    subprocess.run([sys.executable, "-c", code, str(shm_dir)], check=True)
    assert len(list(shm_dir.iterdir())) == 1
    live = CpuPool(CpuPoolConfig(size=1 << 20, arena_size=1 << 20, shm_dir=str(shm_dir)))
    try:
        assert [p.name for p in shm_dir.iterdir()] == [os.path.basename(live.arenas[0].path)]
        # A second pool must not reclaim the arenas of a living one.
        with CpuPool(CpuPoolConfig(size=1 << 20, arena_size=1 << 20, shm_dir=str(shm_dir))):
            assert os.path.exists(live.arenas[0].path)
    finally:
        live.close()


def test_concurrent_allocation_stays_within_budget(shm_dir):
    with CpuPool(CpuPoolConfig(size=8 * MiB, arena_size=2 * MiB, shm_dir=str(shm_dir))) as pool:
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

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert not errors
        for seed, b in got:
            assert bytes(pool.view(b)) == bytes([seed]) * b.nbytes
        assert pool.used_bytes <= pool.capacity
