"""The daemon's own heap, kept flat: few malloc arenas, free pages handed back.

glibc gives each thread that allocates its own malloc arena (up to 8 per core) and keeps
freed pages in them. The daemon's gRPC handlers, IO threads and the optimizer's compute
thread allocate and free short-lived buffers at different times, so its private memory
would drift upwards by a few MB over a long run with no leak at all. Two arenas serve its
threads without contention that shows, and a periodic `malloc_trim` returns what the
arenas hold free, so what the host's budget sees is what the daemon uses.
Outside glibc both calls do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # mallopt's parameter number in glibc's malloc.h
MALLOC_ARENAS = 2


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
        return None
    return libc


_LIBC = _libc()


def bound_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas for this process (call before the threads start)."""
    if _LIBC is None:
        return False
    ok = bool(_LIBC.mallopt(_M_ARENA_MAX, arenas))
    if not ok:
        log.debug("mallopt(M_ARENA_MAX, %d) refused", arenas)
    return ok


def trim_heap() -> None:
    """Hand the malloc arenas' free pages back to the host."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
