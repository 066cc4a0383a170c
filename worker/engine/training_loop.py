"""The training loop, written once: N steps of an engine over a batch iterator.

`run_steps` feeds batches to a step function (an engine's `train_step`, or a plain
PyTorch step a benchmark compares against), synchronises the device around each step so
its time is the step's own, reads the caller's counters (bytes moved, seconds stalled)
just before and after it, and returns what it measured per step. `on_step` sees each
step's figures as soon as the step is done: progress lines, the first iteration's trace
report to the scheduler. `tierstack train`, the partitioned ranks and the benchmarks all
train through it, so they time steps the same way.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import torch

from tierstack.errors import InvalidArgumentError

Batch = tuple[torch.Tensor, torch.Tensor]
"""(inputs, targets), as an engine's train_step takes them."""


@dataclass
class StepRecord:
    """One training step as the loop measured it."""

    index: int
    """0 for the first step."""
    loss: float
    seconds: float
    """The step alone, the device synchronised before and after (no data loading, no
    counter reads, no callback)."""
    counters: dict[str, float] = field(default_factory=dict)
    """The caller's counters read just after the step."""
    moved: dict[str, float] = field(default_factory=dict)
    """How much each counter grew over the step."""


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on the CPU, where work is synchronous)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StopSignal:
    """SIGTERM (a supervisor, Ray or a batch scheduler stopping the job), honoured between
    steps: `run_steps` finishes the step in progress and returns, and the job ends as
    after its last step (checkpoint, export, its daemons and files removed).

    The handler only sets a flag: raising from it can interrupt the main thread anywhere,
    with a lock held (a job once hung for good that way, joining a thread that waited for
    a gRPC channel lock the interrupted thread held). A second SIGTERM `repeat_seconds` or
    more after the first stops the job at once (the signal's default action); sooner, it
    is the same stop arriving twice (a signal to the job's group that a wrapper such as
    make also passes on). Installed only on the main thread (where Python runs signal
    handlers); the old handler is put back on exit."""

    def __init__(self, signum: int = signal.SIGTERM, repeat_seconds: float = 5.0,
                 also: tuple[int, ...] = ()) -> None:
        """`also`: more signals that stop the same way (SIGINT: Ctrl-C keeps the work too
        when there is a checkpoint to write); `signum` is the one received once one came."""
        self.signum = signum
        self.signums = (signum, *also)
        self.repeat_seconds = repeat_seconds
        self.requested = False
        self._first: float | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.signums}
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first, self.requested, self.signum = now, True, signum
        elif now - self._first >= self.repeat_seconds:  # asked again: stop at once
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # Ctrl-C twice: the interpreter's own stop
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """The shell's code for a job ended by the signal received: 128 + its number."""
        return 128 + self.signum


def run_steps(step: Callable[[torch.Tensor, torch.Tensor], float], batches: Iterable[Batch],
              device: torch.device | str, steps: int | None = None,
              counters: Callable[[], Mapping[str, float]] | None = None,
              on_step: Callable[[StepRecord], None] | None = None,
              stop: StopSignal | None = None) -> list[StepRecord]:
    """Run `step` on `steps` batches (None: every batch there is); per-step figures.

    `counters()` gives running totals (e.g. bytes read from NVMe); each record carries
    their values after its step and their growth over it. With `stop`, the loop ends
    before the next step once its signal has come (fewer records than `steps`).
    """
    records: list[StepRecord] = []
    batch_iter = iter(batches)
    for index in (itertools.count() if steps is None else range(steps)):
        if stop is not None and stop.requested:
            break
        try:
            inputs, targets = next(batch_iter)
        except StopIteration:
            if steps is None:
                break
            raise InvalidArgumentError(
                f"the batches ran out after {index} of {steps} steps; give at least {steps}") from None
        before = dict(counters()) if counters is not None else {}
        synchronize(device)
        start = time.perf_counter()
        loss = step(inputs, targets)
        synchronize(device)
        seconds = time.perf_counter() - start
        after = dict(counters()) if counters is not None else {}
        record = StepRecord(index, float(loss), seconds, after,
                            {name: after[name] - before[name] for name in after})
        records.append(record)
        if on_step is not None:
            on_step(record)
    return records
