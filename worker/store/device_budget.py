"""The worker's device-memory budget: layers on the device never hold more than this."""

from __future__ import annotations

import threading

from tierstack.errors import DeviceBudgetError


class DeviceBudget:
    """Counts the bytes of layer blocks on the device against a fixed capacity."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise DeviceBudgetError(f"device budget must be positive, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()

    def resize(self, capacity: int) -> None:
        """A new capacity (the engine's placement sizes it after its probe step)."""
        with self._lock:
            if capacity <= 0 or capacity < self.used:
                raise DeviceBudgetError(
                    f"device budget of {capacity} bytes cannot hold the {self.used} bytes of "
                    f"layers on the device now")
            self.capacity = capacity

    def try_reserve(self, nbytes: int) -> bool:
        with self._lock:
            if self.used + nbytes > self.capacity:
                return False
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            return True

    def reserve(self, nbytes: int, what: str) -> None:
        if not self.try_reserve(nbytes):
            raise DeviceBudgetError(
                f"{what} needs {nbytes} bytes on the device but only "
                f"{self.capacity - self.used} of the {self.capacity}-byte budget are free; "
                f"release layers first (release_layer) or raise device_budget")

    def free(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes
            assert self.used >= 0, "device budget freed more than it reserved"
