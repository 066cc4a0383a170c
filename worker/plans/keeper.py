"""When a training loop reports its trace: settled iterations first, then again whenever
the measured step leaves the plan's band.

A plan's predicted step is only as good as the trace it was made from. One iteration of a
shared machine is a poor sample (on the 2-core dev machine one step took 2.7x the next
while a CI run came and went), and a plan keeps that trace for good: the scheduler's
re-plans on bandwidth drift reuse it. So the keeper

1. skips the first `warmup` steps (the first probes the placement and creates the
   optimizer state), then records `iterations` steps into one trace (each use's compute
   the median over them, the optimizer's time per block too) and reports it;
2. then holds every step against the plan in force: when the median of the last
   `patience` steps under one plan is outside `band` of its prediction, it records and
   reports a fresh trace (a new plan version, reason "trace"). Plans the scheduler makes
   meanwhile (bandwidth drift) start a new count.

    keeper = PlanKeeper(follower, optimizer_seconds=lambda: adamw.block_seconds)
    for each step: ...; keeper.step_done(seconds)   # the plan it reported, or None
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from typing import Callable, Sequence

from tierstack.errors import InvalidArgumentError
from tierstack.services.scheduler.model import Plan
from tierstack.worker.plans.follower import PlanFollower

log = logging.getLogger(__name__)

BAND = (0.8, 1.25)
"""Predicted / measured step the plan may be off by before the trace is taken again."""


@dataclass
class PlanRecord:
    """One plan version as the loop followed it: its prediction and the steps run under it."""

    version: int
    reason: str
    predicted_seconds: float
    steps: list[float] = field(default_factory=list)

    @property
    def measured_seconds(self) -> float:
        """The median step under this plan (0: none yet)."""
        return statistics.median(self.steps) if self.steps else 0.0

    @property
    def ratio(self) -> float:
        """Predicted / measured (0: no step yet)."""
        measured = self.measured_seconds
        return self.predicted_seconds / measured if measured else 0.0


class PlanKeeper:
    """Decides at each step's end whether the follower records, reports or checks."""

    def __init__(self, follower: PlanFollower, optimizer_seconds: Callable[[], Sequence[float]] = tuple,
                 warmup: int = 1, iterations: int = 3, patience: int = 3,
                 band: tuple[float, float] = BAND) -> None:
        if warmup < 0 or iterations < 1 or patience < 1:
            raise InvalidArgumentError(
                f"PlanKeeper needs warmup >= 0, iterations >= 1 and patience >= 1; got "
                f"{warmup}, {iterations}, {patience}")
        if not 0 < band[0] < 1 < band[1]:
            raise InvalidArgumentError(f"PlanKeeper band {band} must hold 1 (e.g. (0.8, 1.25))")
        self.follower = follower
        self.optimizer_seconds = optimizer_seconds
        self.warmup, self.iterations, self.patience, self.band = warmup, iterations, patience, band
        self.plans: list[PlanRecord] = []
        """Every plan version the loop ran steps under, in order."""
        self._steps = 0
        self._recording = 0  # iterations recorded into the trace being taken (0: none)
        self._optimizer: list[Sequence[float]] = []
        if warmup == 0:
            self._start_recording()

    def step_done(self, seconds: float) -> Plan | None:
        """A step ended after `seconds`; returns the plan a trace reported now produced."""
        self._steps += 1
        plan = self.follower.plan
        if plan is not None and self._recording == 0:
            self._count(plan, seconds)
        if self._recording:
            return self._recorded()
        if self._steps == self.warmup:
            self._start_recording()
        elif plan is not None and self._off_band(self.plans[-1]):
            record = self.plans[-1]
            recent = statistics.median(record.steps[-self.patience:])
            log.debug("job %s: plan v%d predicted %.3f s, the last %d steps took %.3f s (%.2fx); "
                      "tracing again", plan.job, record.version, record.predicted_seconds,
                      self.patience, recent, record.predicted_seconds / recent)
            self._start_recording()
        return None

    @property
    def recording(self) -> bool:
        """Whether the next step is recorded into a trace."""
        return self._recording > 0

    def _count(self, plan: Plan, seconds: float) -> None:
        if not self.plans or self.plans[-1].version != plan.version:
            self.plans.append(PlanRecord(plan.version, plan.reason, plan.predicted_step_seconds))
        self.plans[-1].steps.append(seconds)

    def _off_band(self, record: PlanRecord) -> bool:
        if len(record.steps) < self.patience or record.predicted_seconds <= 0:
            return False
        ratio = record.predicted_seconds / statistics.median(record.steps[-self.patience:])
        return not self.band[0] <= ratio <= self.band[1]

    def _start_recording(self) -> None:
        self.follower.record()
        self._recording, self._optimizer = 1, []

    def _recorded(self) -> Plan | None:
        """One more iteration recorded: the next, or the trace reported."""
        self._optimizer.append(list(self.optimizer_seconds()))
        if self._recording < self.iterations:
            self.follower.next_iteration()
            self._recording += 1
            return None
        self._recording = 0
        # Per block, the median of what the recorded iterations saw (the latest update
        # of each block when the iteration ended).
        lengths = {len(o) for o in self._optimizer}
        optimizer = ([statistics.median(t) for t in zip(*self._optimizer)]
                     if len(lengths) == 1 else self._optimizer[-1])
        return self.follower.report_trace(optimizer_seconds=optimizer)
