"""What a person watching `tierstack train` sees, on a terminal and in a log.

On a terminal: a progress bar with the last step's loss, tokens/s, the GB/s of every
link between tiers, the share of the step the worker stalled waiting for layers, and an
ETA. In a pipe or a log file (no TTY): one plain line every `interval` seconds and one
at the end, each complete on one line whatever its length (never cut to a terminal
width), with rates averaged over the steps since the previous line.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.text import Text

from tierstack.worker.engine.training_loop import StepRecord

LINKS = (("nvme->cpu", "nvme_read"), ("cpu->nvme", "nvme_written"),
         ("cpu->dev", "to_device"), ("dev->cpu", "from_device"))
"""Links shown, and the counter (running bytes) each is read from."""


@dataclass
class Window:
    """Steps since the last report: their count, seconds, losses and counter growth."""

    steps: int = 0
    seconds: float = 0.0
    loss: float = 0.0
    moved: dict[str, float] | None = None

    def add(self, step: StepRecord) -> None:
        self.steps += 1
        self.seconds += step.seconds
        self.loss = step.loss
        self.moved = {k: (self.moved or {}).get(k, 0.0) + v for k, v in step.moved.items()}


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def figures(window: Window, tokens_per_step: int) -> str:
    """loss, tokens/s, per-link GB/s and stall share over the window's steps."""
    seconds = max(window.seconds, 1e-9)
    moved = window.moved or {}
    links = "  ".join(f"{name} {moved.get(counter, 0.0) / seconds / 1e9:.2f}"
                      for name, counter in LINKS)
    stall = 100 * moved.get("stalled", 0.0) / seconds
    return (f"loss {window.loss:.4f}  {tokens_per_step * window.steps / seconds:,.0f} tok/s  "
            f"GB/s {links}  stall {stall:.0f}%")


class _BarAndFigures(Progress):
    """The bar and ETA on one line and the figures under it, wrapped rather than cut on a
    narrow terminal."""

    def get_renderables(self):
        yield self.make_tasks_table(self.tasks)
        for task in self.tasks:
            if task.fields.get("status"):
                yield Text(task.fields["status"])


class TrainProgress:
    """Progress of `total` steps (starting after `first` already done: a resumed run)."""

    def __init__(self, total: int, tokens_per_step: int, first: int = 0, interval: float = 10.0,
                 out: TextIO | None = None, tty: bool | None = None) -> None:
        self.out = out or sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self.total, self.first, self.tokens_per_step = total, first, tokens_per_step
        self.interval = interval
        self.done = first
        self.started = time.perf_counter()
        self.last_line = self.started
        self.window = Window()
        self._progress = self._task = None
        self.closed = False
        if self.tty:
            self.console = Console(file=self.out, force_terminal=True)
            self._progress = _BarAndFigures(
                TextColumn("step {task.completed}/{task.total}"), BarColumn(bar_width=30),
                TextColumn("ETA"), TimeRemainingColumn(), console=self.console, transient=False)
            self._task = self._progress.add_task("train", total=total, completed=first, status="")
            self._progress.start()

    def resumed_at(self, step: int) -> None:
        """The run goes on from a checkpoint after `step`: progress counts from there."""
        self.first = self.done = step

    def say(self, text: str) -> None:
        """A message of its own (the plan adopted, the dashboard's URL): above the bar on
        a terminal, a plain line otherwise."""
        if self.tty:
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, file=self.out, flush=True)

    def step(self, record: StepRecord) -> None:
        if self.done == self.first:  # the clock starts with the first step, not the set-up
            self.started = self.last_line = time.perf_counter() - record.seconds
        self.done += 1
        self.window.add(record)
        if self.tty:
            last = Window()
            last.add(record)
            self._progress.update(self._task, completed=self.done,
                                  status=figures(last, self.tokens_per_step))
            return
        now = time.perf_counter()
        if now - self.last_line >= self.interval or self.done == self.total:
            self._line(now)

    def _line(self, now: float) -> None:
        elapsed = now - self.started
        ran = self.done - self.first
        eta = elapsed / ran * (self.total - self.done) if ran else 0.0
        print(f"step {self.done}/{self.total}  {figures(self.window, self.tokens_per_step)}  "
              f"elapsed {_duration(elapsed)}  ETA {_duration(eta)}", file=self.out, flush=True)
        self.window = Window()
        self.last_line = now

    def close(self) -> None:
        """Stop the bar, or print the steps since the last line (a run cut short)."""
        if self.closed:
            return
        self.closed = True
        if self._progress is not None:
            self._progress.stop()
        elif self.window.steps:
            self._line(time.perf_counter())
