"""A shared mapping of a file that keeps no file descriptor open.

Python's `mmap.mmap` keeps a duplicate of the file's descriptor for the mapping's life,
so a process with one mapping per arena hits `ulimit -n` (1,024 is common) after about a
thousand arenas, whatever their size. Here the file is mapped with libc's mmap(2)
through ctypes and the caller closes its descriptor at once: a mapping costs one entry of
vm.max_map_count and no descriptor. The mapping lives as long as any view of it does
(views hold the ctypes array they slice, whose finalizer unmaps), so a view used after
`close` is still valid memory, never a crash.

Its pages are populated (faulted in for writing) at creation, by several threads at once
(`populate`): on the project's machines, virtual machines all, the first touch of host
memory is the cost (the guest's pages are backed as they are first written: 1-3 GB/s a
thread on the dev machine and the GPU machines), and a 1.3e9-parameter job's first
optimizer step makes ~16 GB of arenas. One thread's MAP_POPULATE made that many seconds
of every job's warm-up.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import weakref

libc = ctypes.CDLL(None, use_errno=True)
"""libc's mmap(2) and munmap(2), typed (also the optimizer's scratch rings': adamw_stream.py)."""
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.munmap.restype = ctypes.c_int
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.restype = ctypes.c_int
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MAP_FAILED = ctypes.c_void_p(-1).value
MADV_POPULATE_WRITE = 23
"""Linux 5.14+: fault a range in for writing, an error (not SIGBUS) where a page cannot be had."""
POPULATE_THREADS = min(8, os.cpu_count() or 1)
"""Threads that populate one mapping (ctypes drops the GIL in madvise)."""
POPULATE_SLICE = 16 << 20
"""No thread populates less than this (~5 ms of work; a thread costs ~0.1 ms to start): a
1.3e9-parameter LLaMA block's moment, 216 MB, gets all 8."""


class PopulateError(OSError):
    """The memory behind a mapping could not be had (a full tmpfs, no huge pages left,
    a memory limit): errno ENOSPC or ENOMEM."""


def populate(address: int, size: int, threads: int = POPULATE_THREADS) -> bool:
    """Fault in every page of [address, address + size) for writing, up to `threads`
    slices at once. False where the kernel lacks MADV_POPULATE_WRITE (then nothing was
    done: the caller populates the old way); PopulateError where the memory is not there."""
    page = mmap.PAGESIZE
    n = max(1, min(threads, size // POPULATE_SLICE))
    step = -(-size // n // page) * page
    slices = [(address + off, min(step, size - off)) for off in range(0, size, step)]
    errors: list[int] = []

    def run(start: int, length: int) -> None:
        if libc.madvise(start, length, MADV_POPULATE_WRITE) != 0:
            errors.append(ctypes.get_errno())

    workers = [threading.Thread(target=run, args=s, name="tierstack-populate") for s in slices[1:]]
    for w in workers:
        w.start()
    run(*slices[0])
    for w in workers:
        w.join()
    if not errors:
        return True
    if errno.EINVAL in errors and len(errors) == len(slices):
        return False  # an old kernel: no slice was populated
    err = errno.ENOMEM if errno.ENOMEM in errors else errno.ENOSPC  # EFAULT: would SIGBUS
    raise PopulateError(err, os.strerror(err))


def _unmap(address: int, size: int) -> None:
    libc.munmap(address, size)


def _map(fd: int, size: int, flags: int) -> int:
    address = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if address in (None, MAP_FAILED):
        err = ctypes.get_errno() or errno.ENOMEM
        raise OSError(err, os.strerror(err))
    return address


class SharedMapping:
    """`size` bytes of an open file, mapped shared and read-write, every page populated
    (the file's blocks allocated: a file that cannot hold them raises PopulateError)."""

    def __init__(self, fd: int, size: int) -> None:
        address = _map(fd, size, mmap.MAP_SHARED)
        try:
            done = populate(address, size)
        except BaseException:
            libc.munmap(address, size)
            raise
        if not done:  # no MADV_POPULATE_WRITE: reserve the blocks, then one thread maps them
            libc.munmap(address, size)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise PopulateError(e.errno, e.strerror) from None
                raise
            address = _map(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        self.size = size
        array = (ctypes.c_char * size).from_address(address)
        weakref.finalize(array, _unmap, address, size)
        self._bytes: memoryview | None = memoryview(array).cast("B")

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A writable view of bytes [offset, offset + nbytes) (no copy)."""
        if self._bytes is None:
            raise ValueError("the mapping is closed")
        return self._bytes[offset:offset + nbytes]

    def close(self) -> None:
        """Let go of the mapping: it is unmapped once no view of it is left."""
        self._bytes = None
