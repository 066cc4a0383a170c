"""What an engine from tierstack.initialize prints and records of its steps, as DeepSpeed's does.

train.monitor (DeepSpeed's `steps_per_print`, `wall_clock_breakdown` and monitor sections)
says what; the engine (worker/api/training_engine.py) tells this report when a forward,
backward and step run and, at each optimizer step, the step's figures — the same
`StepFigures` it sends to the node's dashboard and Prometheus (worker/job.py
Job.step_done), so every reader sees one loss, one learning rate, one sample count.

Lines (rank 0, on stdout through the `tierstack.progress` logger, DeepSpeed's format):
- every steps_per_print optimizer steps: `[Rank 0] step=10, skipped=0, lr=[0.001],
  mom=[(0.9, 0.999)]` and DeepSpeed's throughput line `epoch=0/micro_step=20/global_step=10,
  RunningAvgSamplesPerSec=..., CurrSamplesPerSec=..., MemAllocated=...GB,
  MaxMemAllocated=...GB` (a step's time runs from its first forward to the end of its
  step(); the running average leaves out the first two steps, as DeepSpeed's does, and is
  -inf until a step after them ended; memory is
  get_accelerator()'s: the device's, or the process's RSS on the CPU);
- with wall_clock_breakdown, after each micro step `[Rank 0] time (ms) | fwd_microstep: ...
  | bwd_microstep: ... | bwd_inner_microstep: ... | bwd_allreduce_microstep: ... |
  step_microstep: ...`, and after each optimizer step the window's sums under `fwd`, `bwd`,
  `bwd_inner`, `bwd_allreduce`, `step`. The engine's phase clock times them
  (worker/store/step_phases.py: device time on CUDA); `bwd_allreduce` is a partitioned
  job's gradient collectives (reduce-scatter, all-reduce) timed inside its backward, 0 on
  one rank, and `bwd_inner` the rest of the backward.

Events (tierstack.monitor, when a monitor is enabled), at the samples trained so far:
Train/Samples/train_loss (the step's loss as the script computed it: its micro-batches'
mean), Train/Samples/lr (the first group's), Train/Samples/loss_scale (fp16), and with
wall_clock_breakdown Train/Samples/elapsed_time_ms_forward, _backward, _backward_inner,
_backward_allreduce and _step. DeepSpeed's engine wrote train_loss at its backward, one
step's samples earlier; here every figure of a step is at the same point.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from dataclasses import dataclass

from tierstack.accelerator import get_accelerator
from tierstack.config import MonitorConfig
from tierstack.monitor import MonitorMaster
from tierstack.worker.store.step_phases import NO_PHASES, NoPhases, PhaseClock

progress = logging.getLogger("tierstack.progress")

# DeepSpeed's timer names, micro step and optimizer step.
_MICRO = ("fwd_microstep", "bwd_microstep", "bwd_inner_microstep", "bwd_allreduce_microstep",
          "step_microstep")
_GLOBAL = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")
_EVENTS = ("forward", "backward", "backward_inner", "backward_allreduce", "step")
_COLLECTIVES = ("reduce_scatter", "all_reduce")  # a partitioned store's gradient reduction
_THROUGHPUT_START_STEP = 2  # DeepSpeed's ThroughputTimer leaves out the first two steps


@dataclass(frozen=True)
class StepFigures:
    """One optimizer step, as the engine counted it (the dashboard's figures too)."""

    step: int
    samples: int
    """Rows trained so far over every rank, this step's included (DeepSpeed's global_samples)."""
    skipped: int
    loss: float | None
    lrs: list[float]
    moms: list
    loss_scale: float | None = None
    """fp16's scale (None without fp16)."""


class _Stdout(logging.StreamHandler):
    """stdout as it is when a line is written (a test's capture, a redirected stream)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout
        super().emit(record)


def _progress_logger() -> logging.Logger:
    """The step lines' logger: its own stdout handler at INFO, not the root's (DeepSpeed's
    lines are printed whatever the script's logging says); a script may add its own."""
    if not any(isinstance(h, _Stdout) for h in progress.handlers):
        handler = _Stdout(sys.stdout)
        handler.setFormatter(logging.Formatter(
            "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"))
        progress.addHandler(handler)
        progress.setLevel(logging.INFO)
        progress.propagate = False
    return progress


class _Throughput:
    """DeepSpeed's ThroughputTimer: samples per second over optimizer steps."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.started_at: float | None = None
        self.micro_steps = 0
        self.steps = 0
        self.total = 0.0
        self.step_seconds = 0.0

    def start(self) -> None:
        if self.started_at is None:
            get_accelerator().synchronize()
            self.started_at = time.perf_counter()

    def stop(self, boundary: bool) -> None:
        """A step() call ended (an optimizer step at a boundary)."""
        if self.started_at is not None:  # it ran a training forward (a step without one: 0 s)
            get_accelerator().synchronize()
            seconds = time.perf_counter() - self.started_at
            self.started_at = None
            self.micro_steps += 1
            self.step_seconds += seconds
            if self.steps >= _THROUGHPUT_START_STEP:
                self.total += seconds
        if boundary:
            self.steps += 1

    def line(self) -> str:
        timed = self.steps - _THROUGHPUT_START_STEP
        average = self.batch_size / (self.total / timed) if timed > 0 and self.total > 0 else float("-inf")
        current = self.batch_size / (self.step_seconds + 1e-5)
        accelerator = get_accelerator()
        return (f"epoch=0/micro_step={self.micro_steps}/global_step={self.steps}, "
                f"RunningAvgSamplesPerSec={average}, CurrSamplesPerSec={current}, "
                f"MemAllocated={round(accelerator.memory_allocated() / 1024**3, 2)}GB, "
                f"MaxMemAllocated={round(accelerator.max_memory_allocated() / 1024**3, 2)}GB")

    def step_reported(self) -> None:
        self.step_seconds = 0.0


class StepReport:
    """The engine's step lines, phase timers and monitor events (see the module docstring)."""

    def __init__(self, config: MonitorConfig, monitor: MonitorMaster, rank: int, batch_size: int,
                 phases: PhaseClock | None = None) -> None:
        self.config = config
        self.monitor = monitor
        self.rank = rank
        self.prints = rank == 0 and (config.steps_per_print > 0 or config.wall_clock_breakdown)
        self.log = _progress_logger() if self.prints else progress
        self.phases: PhaseClock | NoPhases = phases if config.wall_clock_breakdown and phases else NO_PHASES
        self.throughput = _Throughput(batch_size) if config.steps_per_print > 0 else None
        self._micro_start: dict[str, float] = {}
        self._window_start: dict[str, float] = {}
        self._collectives_in_backward = 0.0  # seconds, this micro step's
        self._window_collectives = 0.0  # seconds, this optimizer step's

    # ---- the engine's spans ----------------------------------------------------------------

    @contextlib.contextmanager
    def forward(self):
        """A training forward: the throughput clock starts at a micro step's first."""
        if self.throughput is not None:
            self.throughput.start()
        with self.phases.device("forward"):
            yield

    @contextlib.contextmanager
    def backward(self):
        before = self._collectives()
        with self.phases.device("backward"):
            yield
        self._collectives_in_backward += self._collectives() - before

    def step(self):
        return self.phases.device("step")

    # ---- what the engine tells -------------------------------------------------------------

    def started(self, figures: StepFigures) -> None:
        """The engine exists (DeepSpeed prints step 0's line then)."""
        if self.config.steps_per_print > 0 and self.rank == 0:
            self.log.info(self._step_line(figures))

    def micro_step_ended(self, figures: StepFigures | None) -> None:
        """A step() call ended; `figures` when it was an optimizer step."""
        boundary = figures is not None
        if self.throughput is not None:
            self.throughput.stop(boundary)
        if boundary:
            self._optimizer_step(figures)
        if self.config.wall_clock_breakdown:
            self._timers(boundary, figures)

    def close(self) -> None:
        self.monitor.close()

    # ---- the lines and events ----------------------------------------------------------------

    def _optimizer_step(self, figures: StepFigures) -> None:
        every = self.config.steps_per_print
        if every > 0 and figures.step % every == 0 and self.rank == 0:
            self.log.info(self._step_line(figures))
            self.log.info(self.throughput.line())
        if self.throughput is not None:
            self.throughput.step_reported()
        if self.monitor.enabled:
            events = []
            if figures.loss is not None:
                events.append(("Train/Samples/train_loss", figures.loss, figures.samples))
            if figures.lrs:
                events.append(("Train/Samples/lr", figures.lrs[0], figures.samples))
            if figures.loss_scale is not None:
                events.append(("Train/Samples/loss_scale", figures.loss_scale, figures.samples))
            self.monitor.write_events(events)

    def _step_line(self, figures: StepFigures) -> str:
        return (f"[Rank {self.rank}] step={figures.step}, skipped={figures.skipped}, "
                f"lr={figures.lrs}, mom={figures.moms}")

    def _timers(self, boundary: bool, figures: StepFigures | None) -> None:
        """The micro step's times, and at an optimizer step the window's (milliseconds)."""
        totals = self.phases.totals()
        micro = self._elapsed(totals, self._micro_start, self._collectives_in_backward)
        self._micro_start = totals
        self._window_collectives += self._collectives_in_backward
        self._collectives_in_backward = 0.0
        if self.rank == 0:
            self.log.info(self._timer_line(_MICRO, micro))
        if not boundary:
            return
        window = self._elapsed(totals, self._window_start, self._window_collectives)
        self._window_start, self._window_collectives = totals, 0.0
        if self.rank == 0:
            self.log.info(self._timer_line(_GLOBAL, window))
        if self.monitor.enabled:
            self.monitor.write_events([(f"Train/Samples/elapsed_time_ms_{name}", ms, figures.samples)
                                       for name, ms in zip(_EVENTS, window)])

    @staticmethod
    def _elapsed(totals: dict[str, float], since: dict[str, float], collectives: float) -> list[float]:
        """(forward, backward, backward's own, backward's collectives, step) in ms since `since`."""
        def ms(name: str) -> float:
            return (totals.get(name, 0.0) - since.get(name, 0.0)) * 1000.0
        backward = ms("backward")
        reduce = min(collectives * 1000.0, backward)
        return [ms("forward"), backward, backward - reduce, reduce, ms("step")]

    def _timer_line(self, names: tuple[str, ...], values: list[float]) -> str:
        return f"[Rank {self.rank}] time (ms) | " + " | ".join(
            f"{name}: {value:.2f}" for name, value in zip(names, values))

    def _collectives(self) -> float:
        if not self.config.wall_clock_breakdown:
            return 0.0
        totals = self.phases.totals()
        return sum(totals.get(name, 0.0) for name in _COLLECTIVES)
