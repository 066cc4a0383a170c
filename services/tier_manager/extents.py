"""Fixed-capacity extent allocation, shared by the CPU pool's arenas and the NVMe files.

An `ExtentAllocator` hands out aligned byte ranges of one address space and knows
nothing of tensors. Invariant: the free list is sorted by offset, its extents never
overlap, never touch (neighbours are coalesced on free) and lie inside the capacity.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Extent:
    """A byte range [offset, offset + length) of one arena or one file."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


class ExtentAllocator:
    """Best-fit allocator of `alignment`-aligned extents inside [0, capacity)."""

    def __init__(self, capacity: int, alignment: int) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.capacity = capacity // alignment * alignment
        self.alignment = alignment
        self._lock = threading.Lock()
        self._starts: list[int] = [0] if self.capacity else []
        self._lengths: dict[int, int] = {0: self.capacity} if self.capacity else {}
        self._free_bytes = self.capacity

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    @property
    def used_bytes(self) -> int:
        return self.capacity - self._free_bytes

    def high_water(self) -> int:
        """The end of the highest used byte (0 when nothing is used): the space above it
        is one free tail."""
        with self._lock:
            if not self._starts:
                return self.capacity
            last = self._starts[-1]
            return last if last + self._lengths[last] == self.capacity else self.capacity

    def free_ranges(self) -> list[Extent]:
        """The free extents now, by offset."""
        with self._lock:
            return [Extent(start, self._lengths[start]) for start in self._starts]

    def largest_free(self) -> int:
        with self._lock:
            return max(self._lengths.values(), default=0)

    def allocate(self, nbytes: int) -> Extent | None:
        """The smallest free extent that fits `nbytes` (rounded up), or None if none does."""
        if nbytes <= 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        need = align_up(nbytes, self.alignment)
        with self._lock:
            best_start, best_len = -1, 0
            for start, length in self._lengths.items():
                if need <= length and (best_start < 0 or length < best_len):
                    best_start, best_len = start, length
                    if length == need:
                        break
            if best_start < 0:
                return None
            self._remove(best_start)
            if best_len > need:
                self._insert(best_start + need, best_len - need)
            self._free_bytes -= need
            return Extent(best_start, need)

    def reserve(self, extent: Extent) -> None:
        """Mark a specific extent used (manifest recovery); it must be entirely free."""
        self._check_bounds(extent)
        with self._lock:
            i = bisect.bisect_right(self._starts, extent.offset) - 1
            if i < 0:
                raise ValueError(f"extent {extent} is not free")
            start = self._starts[i]
            length = self._lengths[start]
            if extent.end > start + length:
                raise ValueError(f"extent {extent} is not free (overlaps a used extent)")
            self._remove(start)
            if extent.offset > start:
                self._insert(start, extent.offset - start)
            if start + length > extent.end:
                self._insert(extent.end, start + length - extent.end)
            self._free_bytes -= extent.length

    def free(self, extent: Extent) -> None:
        """Return an extent; neighbouring free extents merge with it."""
        self._check_bounds(extent)
        with self._lock:
            i = bisect.bisect_left(self._starts, extent.offset)
            offset, length = extent.offset, extent.length
            if i < len(self._starts) and self._starts[i] < extent.end:
                raise RuntimeError(f"double free of {extent}: it overlaps a free extent")
            if i > 0:
                prev = self._starts[i - 1]
                prev_end = prev + self._lengths[prev]
                if prev_end > offset:
                    raise RuntimeError(f"double free of {extent}: it overlaps a free extent")
                if prev_end == offset:
                    offset, length = prev, length + self._lengths[prev]
                    self._remove(prev)
            if extent.end in self._lengths:
                length += self._lengths[extent.end]
                self._remove(extent.end)
            self._insert(offset, length)
            self._free_bytes += extent.length

    def _check_bounds(self, extent: Extent) -> None:
        if (
            extent.offset < 0
            or extent.length <= 0
            or extent.end > self.capacity
            or extent.offset % self.alignment
            or extent.length % self.alignment
        ):
            raise ValueError(
                f"extent {extent} is not an aligned range of this allocator "
                f"(capacity {self.capacity}, alignment {self.alignment})"
            )

    def _insert(self, start: int, length: int) -> None:
        bisect.insort(self._starts, start)
        self._lengths[start] = length

    def _remove(self, start: int) -> None:
        del self._starts[bisect.bisect_left(self._starts, start)]
        del self._lengths[start]
