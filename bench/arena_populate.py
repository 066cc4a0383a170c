"""How fast the CPU pool makes an arena: several threads writing its pages (today's
shared_mapping.populate) against one thread (posix_fallocate, then mmap with MAP_POPULATE:
the pool before 2026-12-07), interleaved, medians of --reps. On the project's machines,
virtual machines all, a new arena's cost is the first write of host memory, and a
1.3e9-parameter job's first optimizer step makes ~16 GB of arenas (fp32 masters and two
moments). With CUDA, also how long page-locking a mapping of it takes (cudaHostRegister,
which every worker does once per arena it maps: worker/store/arenas.py).

    python3 bench/arena_populate.py --size 2GiB --reps 5
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

from tierstack.config import parse_size
from tierstack.services.tier_manager import shared_mapping
from tierstack.services.tier_manager.shared_mapping import SharedMapping


def make_arena(directory: Path, size: int, way: str) -> float:
    """Seconds to make one arena of `size` bytes, every page written, the way named."""
    path = directory / f"tierstack-populate-bench-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        start = time.perf_counter()
        if way == "threads":
            os.ftruncate(fd, size)
            mapping = SharedMapping(fd, size)
        else:
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        seconds = time.perf_counter() - start
        mapping.close()
        return seconds
    finally:
        os.close(fd)
        path.unlink()


def page_lock_seconds(directory: Path, size: int) -> float | None:
    """Seconds cudaHostRegister takes over a populated arena's mapping; None without CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    import ctypes
    path = directory / f"tierstack-populate-bench-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        SharedMapping(fd, size)  # the daemon's side: pages there
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(m))
        torch.cuda.init()
        start = time.perf_counter()
        torch.cuda.cudart().cudaHostRegister(address, size, 0)
        seconds = time.perf_counter() - start
        torch.cuda.cudart().cudaHostUnregister(address)
        return seconds
    finally:
        os.close(fd)
        path.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB", help="one arena's size")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default="/dev/shm", help="a tmpfs, as cpu_pool.shm_dir")
    args = parser.parse_args(argv)
    size, directory = parse_size(args.size), Path(args.dir)
    seconds: dict[str, list[float]] = {"threads": [], "one_thread": []}
    for _ in range(args.reps):
        for way in seconds:  # interleaved: the machine's drift hits both alike
            seconds[way].append(make_arena(directory, size, way))
    gbps = {way: size / statistics.median(s) / 1e9 for way, s in seconds.items()}
    for way, s in seconds.items():
        print(f"{way:>10}: {gbps[way]:6.2f} GB/s  (runs: {', '.join(f'{size / x / 1e9:.2f}' for x in s)})")
    lock = page_lock_seconds(directory, size)
    result = {"size": size, "reps": args.reps, "threads": shared_mapping.POPULATE_THREADS,
              "populate_gbps_threads": round(gbps["threads"], 3),
              "populate_gbps_one_thread": round(gbps["one_thread"], 3),
              "threads_vs_one_thread": round(gbps["threads"] / gbps["one_thread"], 3),
              "page_lock_gbps": round(size / lock / 1e9, 3) if lock else None}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
