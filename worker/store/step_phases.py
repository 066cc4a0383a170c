"""Where a training step's time goes, phase by phase, when someone asks.

A `PhaseClock` keeps running totals of seconds per phase name: the engine's forward,
backward and optimizer call (its main thread), and a partitioned store's collectives
(all_gather, reduce_scatter, all_reduce) and waits for its tiers (tier_wait: the
communication thread waiting for this rank's shard to come from the CPU pool or NVMe).
Readers take differences of `totals()` around a step, as they do with byte counters
(worker/engine/training_loop.py's run_steps).

Two kinds of span, because the work is of two kinds:
- `host(name)`: the calling thread's wall time (time.perf_counter). A wait for the
  tier manager blocks a thread, so its wall time is the wait.
- `device(name, stream)`: on CUDA a pair of timing events on `stream`, resolved when
  `totals()` is read (the events have passed by then: run_steps synchronises after each
  step), so an NCCL collective or a kernel-launching forward counts the time the device
  spent on it, not the microseconds its launch took on the host. Without CUDA
  (gloo, CPU compute) the call does the work, so it is a host span.

Nobody pays when nobody asks: engines and stores hold `NO_PHASES`, whose spans are one
shared object that does nothing.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import torch


class _NoSpan:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_SPAN = _NoSpan()


class NoPhases:
    """The clock nobody asked for: every span is free and nothing is recorded."""

    def host(self, name: str) -> _NoSpan:
        return _NO_SPAN

    def device(self, name: str, stream=None) -> _NoSpan:
        return _NO_SPAN

    def totals(self) -> dict[str, float]:
        return {}


NO_PHASES = NoPhases()


class _HostSpan:
    def __init__(self, clock: "PhaseClock", name: str) -> None:
        self.clock, self.name = clock, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.clock._add(self.name, time.perf_counter() - self.start)


class _DeviceSpan:
    def __init__(self, clock: "PhaseClock", name: str, stream) -> None:
        self.clock, self.name, self.stream = clock, name, stream

    def __enter__(self) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.start.record(self.stream)

    def __exit__(self, *exc: object) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.stream)
        with self.clock._lock:
            self.clock._pending.append((self.name, self.start, end))


class PhaseClock:
    """Running seconds per phase of one rank's steps (see the module docstring). Spans may
    be opened on any thread; each name should be timed from one thread at a time."""

    def __init__(self, device: torch.device | str) -> None:
        self._device = torch.device(device)
        self.cuda = self._device.type == "cuda"
        self._seconds: dict[str, float] = defaultdict(float)
        self._pending: list[tuple[str, object, object]] = []
        self._lock = threading.Lock()

    def host(self, name: str) -> _HostSpan:
        """A span of the calling thread's wall time."""
        return _HostSpan(self, name)

    def device(self, name: str, stream=None) -> _HostSpan | _DeviceSpan:
        """A span of the device's time on `stream` (default: the current one); host time
        without CUDA."""
        if not self.cuda:
            return _HostSpan(self, name)
        return _DeviceSpan(self, name, stream or torch.cuda.current_stream(self._device))

    def totals(self) -> dict[str, float]:
        """Seconds per phase so far (device spans resolved: waits for their end events)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for name, start, end in pending:
            end.synchronize()
            self._add(name, start.elapsed_time(end) / 1000.0)
        with self._lock:
            return dict(self._seconds)

    def _add(self, name: str, seconds: float) -> None:
        with self._lock:
            self._seconds[name] += seconds
