"""A shared mapping of a file that keeps no file descriptor open.

Python's `mmap.mmap` keeps a duplicate of the file's descriptor for the mapping's life,
so a process with one mapping per arena hits `ulimit -n` (1,024 is common) after about a
thousand arenas, whatever their size. Here the file is mapped with libc's mmap(2)
through ctypes and the caller closes its descriptor at once: a mapping costs one entry of
vm.max_map_count and no descriptor. The mapping lives as long as any view of it does
(views hold the ctypes array they slice, whose finalizer unmaps), so a view used after
`close` is still valid memory, never a crash.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import weakref

libc = ctypes.CDLL(None, use_errno=True)
"""libc's mmap(2) and munmap(2), typed (also the optimizer's scratch rings': adamw_stream.py)."""
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.munmap.restype = ctypes.c_int
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
MAP_FAILED = ctypes.c_void_p(-1).value


def _unmap(address: int, size: int) -> None:
    libc.munmap(address, size)


class SharedMapping:
    """`size` bytes of an open file, mapped shared and read-write (every page populated)."""

    def __init__(self, fd: int, size: int) -> None:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        address = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
        if address in (None, MAP_FAILED):
            err = ctypes.get_errno() or errno.ENOMEM
            raise OSError(err, os.strerror(err))
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
