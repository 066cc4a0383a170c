import os
import threading
from pathlib import Path

import numpy as np
import pytest

from tierstack.config import KiB, MiB, AioConfig, NvmePoolConfig
from tierstack.errors import DataCorruptionError, FailedPreconditionError, NvmePoolFullError
from tierstack.services.tier_manager.nvme_pool import DATA_FILE, NvmePool


ENGINE = {"name": "auto"}


@pytest.fixture(params=["native", "threads"], autouse=True)
def engine(request):
    """Every test here runs on both IO engines: the native loop and the Python fallback."""
    ENGINE["name"] = request.param
    yield request.param
    ENGINE["name"] = "auto"


def make_pool(paths, size=32 * MiB, block=256 * KiB) -> NvmePool:
    return NvmePool(NvmePoolConfig(
        paths=[str(p) for p in paths], size=size,
        aio=AioConfig(block_size=block, queue_depth=4, thread_count=2, engine=ENGINE["name"])))


def test_engine_is_the_one_asked_for(tmp_path, engine):
    pool = make_pool([tmp_path / "a"])
    try:
        assert pool.engine.backend == engine
    finally:
        pool.close()


def test_native_checksums_equal_the_crc32c_package():
    import crc32c
    from tierstack.services.tier_manager.io_engine import load_native_blockio
    lib = load_native_blockio()
    for n in [0, 1, 7, 8, 9, 4095, 1 << 20, 1234567]:
        data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
        assert lib.tsio_crc32c(0, data.ctypes.data, n) == crc32c.crc32c(data.tobytes())


def test_unaligned_and_read_only_buffers(tmp_path):
    pool = make_pool([tmp_path / "a"])
    try:
        raw = bytearray(700_001)
        data = memoryview(raw)[1:]  # odd address: cannot be an O_DIRECT buffer
        data[:] = random_bytes(700_000, 9)
        ext = pool.allocate(700_000)
        crcs = pool.write(ext, bytes(data))  # bytes: read-only
        out = memoryview(bytearray(700_003))[3:]
        pool.read(ext, out, crcs)
        assert out == data
        assert pool.engine.stats.bytes_read == pool.engine.stats.bytes_written >= 700_000
    finally:
        pool.close()


def random_bytes(n: int, seed: int) -> memoryview:
    return memoryview(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


def test_files_are_opened_with_o_direct_on_a_real_disk(tmp_path):
    pool = make_pool([tmp_path / "a"])
    try:
        assert pool.direct_io
        flags = int(Path(f"/proc/self/fdinfo/{pool.files[0].fd}").read_text().split()[3], 8)
        assert flags & os.O_DIRECT
    finally:
        pool.close()


def test_data_files_grow_in_chunks_to_the_cap_and_give_back_their_free_tail(tmp_path, monkeypatch):
    from tierstack.services.tier_manager import nvme_pool
    monkeypatch.setattr(nvme_pool, "GROWTH", 1 * MiB)
    pool = make_pool([tmp_path / "a", tmp_path / "b"], size=16 * MiB)
    files = [tmp_path / d / DATA_FILE for d in "ab"]
    try:
        assert [os.path.getsize(f) for f in files] == [0, 0]  # nothing reserved at start
        small = pool.allocate(300 * KiB)  # 2 blocks of 256 KiB: one per drive
        assert [os.path.getsize(f) for f in files] == [MiB, MiB]
        big = [pool.allocate(2 * MiB) for _ in range(3)]  # 6 MiB: 3 MiB per drive
        assert pool.file_bytes <= 8 * MiB and all(os.path.getsize(f) <= 4 * MiB for f in files)
        crcs = pool.write(big[0], random_bytes(2 * MiB, 4))
        with pytest.raises(NvmePoolFullError, match="raise nvme_pool.size"):
            pool.allocate(12 * MiB)  # above the cap: the files never pass 8 MiB each
        assert all(os.path.getsize(f) <= 8 * MiB for f in files)
        for e in big[1:]:
            pool.free(e)
        pool.free(small)
        # The tail past the last extent in use goes back (one chunk of slack is kept).
        assert all(os.path.getsize(f) <= 3 * MiB for f in files)
        out = bytearray(2 * MiB)
        pool.read(big[0], memoryview(out), crcs)  # what is kept is intact
        assert out == random_bytes(2 * MiB, 4).tobytes()
    finally:
        pool.close()


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 256 * KiB, 256 * KiB + 1, 3 * MiB + 12345])
def test_round_trip_is_bit_exact_across_striped_drives(tmp_path, nbytes):
    pool = make_pool([tmp_path / "a", tmp_path / "b", tmp_path / "c"])
    try:
        data = random_bytes(nbytes, nbytes)
        extent = pool.allocate(nbytes)
        crcs = pool.write(extent, data)
        pool.sync([extent])
        out = bytearray(nbytes)
        pool.read(extent, memoryview(out), crcs)
        assert out == data.tobytes()
        if extent.nblocks >= 3:
            assert len({d for d, _ in extent.stripes}) == 3  # every drive holds a share
    finally:
        pool.close()


def test_concurrent_writers_and_readers(tmp_path):
    pool = make_pool([tmp_path / "a", tmp_path / "b"], size=64 * MiB)
    errors = []

    def worker(seed: int) -> None:
        try:
            for i in range(6):
                n = int(np.random.default_rng(seed * 100 + i).integers(1, 2 * MiB))
                data = random_bytes(n, seed * 100 + i)
                ext = pool.allocate(n)
                crcs = pool.write(ext, data)
                out = bytearray(n)
                pool.read(ext, memoryview(out), crcs)
                if out != data.tobytes():
                    errors.append((seed, i))
                pool.free(ext)
        except Exception as e:  # noqa: BLE001 - surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    try:
        assert errors == []
        assert pool.used_bytes == 0
    finally:
        pool.close()


def test_full_pool_gives_a_clear_error_and_keeps_what_it_holds(tmp_path):
    pool = make_pool([tmp_path / "a"], size=4 * MiB)
    try:
        first = pool.allocate(3 * MiB)
        crcs = pool.write(first, random_bytes(3 * MiB, 1))
        with pytest.raises(NvmePoolFullError, match="raise nvme_pool.size"):
            pool.allocate(2 * MiB)
        out = bytearray(3 * MiB)
        pool.read(first, memoryview(out), crcs)
        assert out == random_bytes(3 * MiB, 1).tobytes()
    finally:
        pool.close()


def test_flipped_byte_on_disk_is_detected(tmp_path):
    pool = make_pool([tmp_path / "a"])
    try:
        ext = pool.allocate(600 * KiB)
        crcs = pool.write(ext, random_bytes(600 * KiB, 2))
        pool.sync([ext])
        drive, stripe = ext.stripes[0]
        with open(tmp_path / "a" / DATA_FILE, "r+b") as f:  # corrupt block 1 behind our back
            f.seek(stripe.offset + 256 * KiB + 77)
            b = f.read(1)
            f.seek(stripe.offset + 256 * KiB + 77)
            f.write(bytes([b[0] ^ 0x10]))
        out = bytearray(600 * KiB)
        with pytest.raises(DataCorruptionError, match="block 1"):
            pool.read(ext, memoryview(out), crcs)
    finally:
        pool.close()


def test_filesystem_without_o_direct_works_with_a_warning(mounted, caplog):
    # ramfs has no direct IO at all (tmpfs gained it in Linux 6.6).
    pool = make_pool([mounted("ramfs")], size=4 * MiB)
    try:
        assert not pool.direct_io
        assert "without O_DIRECT" in caplog.text
        ext = pool.allocate(300 * KiB)
        crcs = pool.write(ext, random_bytes(300 * KiB, 3))
        out = bytearray(300 * KiB)
        pool.read(ext, memoryview(out), crcs)
        assert out == random_bytes(300 * KiB, 3).tobytes()
    finally:
        pool.close()


def test_a_disk_too_small_for_the_pool_says_so_when_it_fills_and_keeps_what_it_holds(mounted):
    small = mounted("tmpfs", "size=2m")
    pool = make_pool([small], size=8 * MiB)  # the cap is above the disk: nothing reserved yet
    try:
        kept = pool.allocate(MiB)
        crcs = pool.write(kept, random_bytes(MiB, 5))
        with pytest.raises(NvmePoolFullError, match="disk under the NVMe pool is full"):
            pool.allocate(2 * MiB)
        out = bytearray(MiB)
        pool.read(kept, memoryview(out), crcs)
        assert out == random_bytes(MiB, 5).tobytes()
    finally:
        pool.close()


def test_a_deep_aio_config_keeps_its_staging_within_staging_bytes_and_moves_bytes_right(
        tmp_path, monkeypatch, staging_made):
    """DeepSpeed's `"queue_depth": 32, "thread_count": 8` asked for two staging buffers per
    request in flight: 512 huge pages, 1 GiB of host memory. The engine keeps at most
    STAGING_BYTES of them, and batches from several threads at once, far more requests
    than buffers, still round-trip bit for bit."""
    from tierstack.services.tier_manager import io_engine

    monkeypatch.setattr(io_engine, "STAGING_BYTES", 8 * MiB)  # 4 buffers of a huge page each
    pool = NvmePool(NvmePoolConfig(
        paths=[str(tmp_path / "a")], size=64 * MiB,
        aio=AioConfig(block_size=256 * KiB, queue_depth=32, thread_count=8, engine=ENGINE["name"])))
    errors = []

    def worker(seed: int) -> None:
        try:
            data = random_bytes(4 * MiB + 123, seed)
            ext = pool.allocate(len(data))
            crcs = pool.write(ext, data)
            out = bytearray(len(data))
            pool.read(ext, memoryview(out), crcs)
            if out != data.tobytes():
                errors.append(seed)
        except Exception as e:  # noqa: BLE001 - surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    try:
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert errors == []
        assert pool.engine.staging_buffers == 4
        assert 1 <= len(staging_made) <= 4, len(staging_made)
    finally:
        pool.close()


def test_a_pool_opened_on_a_file_it_has_not_adopted_refuses_to_allocate_and_keeps_the_bytes(tmp_path):
    """Issue 38: a second pool on the first pool's file believed it empty, and its first
    allocation shrank the file under the first pool's tensors. Now it refuses in one line
    naming the file and the way out, until what it keeps is reserved (then fit_files)."""
    first = make_pool([tmp_path / "d"], size=512 * MiB)
    data = [random_bytes(70 * MiB, seed) for seed in (1, 2)]
    try:
        extents = [first.allocate(len(t)) for t in data]
        checksums = [first.write(e, t) for e, t in zip(extents, data)]
        first.sync(extents)
    finally:
        first.close()
    data_file = next((tmp_path / "d").iterdir())
    size = data_file.stat().st_size
    assert size > 2 * 64 * MiB  # more than twice GROWTH free to the old allocator: it shrank
    second = make_pool([tmp_path / "d"], size=512 * MiB)
    try:
        with pytest.raises(FailedPreconditionError, match="has not adopted .*--recover") as info:
            second.allocate(4096)
        assert "\n" not in str(info.value) and data_file.stat().st_size == size
        for extent in extents:  # what it keeps: then the rest of the file is free
            second.reserve(extent)
        second.fit_files()
        for extent, t, crc in zip(extents, data, checksums):
            back = memoryview(bytearray(len(t)))
            second.read(extent, back, crc)  # a checksum mismatch would raise here
            assert back == t
        second.allocate(4096)
    finally:
        second.close()
