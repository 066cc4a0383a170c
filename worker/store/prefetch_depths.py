"""How far ahead a layer store works: the scheduler's half of the plan that reaches a worker.

`depth` layers ahead are brought to the device; `read_ahead` layers ahead are hinted to
the tier manager, whose NVMe reads then start early. A plan's depths (worker/
plan_follower.py) take effect only at a layer boundary, the next `ensure_layer`, never
under a transfer.
"""

from __future__ import annotations

import threading


class PrefetchDepths:
    """The depths in effect, the plan they came from, and a plan waiting for a boundary."""

    def __init__(self, depth: int = 2, read_ahead: int = 2) -> None:
        self.depth = depth
        self.read_ahead = read_ahead
        self.plan_version = 0
        self.switches: list[tuple[int, int, int]] = []  # (boundary, plan version, depth)
        self._pending: tuple[int, int, int] | None = None
        self._lock = threading.Lock()

    def set_fixed(self, depth: int) -> None:
        """Depths chosen by the caller (no plan yet): both `depth`."""
        self.depth = self.read_ahead = depth

    def propose(self, version: int, depth: int, read_ahead: int, staging_buffers: int = 0,
                reset: bool = False) -> None:
        """Adopt a plan's depths at the next layer boundary.

        NVMe read hints beyond the device window are capped at `staging_buffers - 1`
        (0: no cap): one staging buffer holds the layer being copied, and a hint the CPU
        pool cannot hold would be read, evicted unused and read again. `reset` forgets
        the versions seen (the scheduler restarted and counts from 1 again).
        """
        if staging_buffers:
            read_ahead = min(read_ahead, depth + max(staging_buffers - 1, 0))
        with self._lock:
            if reset:
                self.plan_version, self._pending = 0, None
                return
            newest = max(self.plan_version, self._pending[0] if self._pending else 0)
            if version > newest:
                self._pending = (version, depth, max(read_ahead, depth))

    def at_boundary(self, boundary: int) -> None:
        """A layer boundary (the `boundary`-th ensure_layer): a pending plan takes effect."""
        if self._pending is None:  # the common case costs one attribute read
            return
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            self.adopt(boundary, *pending)

    def adopt(self, boundary: int, version: int, depth: int, read_ahead: int) -> None:
        """Take a plan's depths now (the caller is at a boundary)."""
        self.plan_version, self.depth, self.read_ahead = version, depth, read_ahead
        self.switches.append((boundary, version, depth))
