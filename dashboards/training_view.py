"""A job's training figures from its workers' last steps: one rule for a node and a cluster.

A job may have several workers (the ranks of a partitioned job, each with its own layer
store, on one node or many). Its step is the furthest any of them reported; its loss is
the mean over the workers at that step, which is the loss of the whole global batch when
the ranks' micro-batches are the same size (what the Hugging Face Trainer logs: the mean
of its processes' losses). A worker one step behind is left out of the mean rather than
mixing two steps. Tokens and tokens/s add up over the workers; the ranks of a job wait
for each other at every step, so the slowest worker's seconds per step sets the ETA.

A node combines its own workers; the cluster view combines every node's workers with the
same function, so a job whose ranks report to several nodes gets one set of figures.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from typing import Iterable, Sequence

from tierstack.dashboards.snapshots import JobTraining, TrainingStep


def training_step(job: str, step: int, total_steps: int | None, loss: float | None,
                  learning_rate: float | None, tokens: int, tokens_per_second: float,
                  seconds_per_step: float) -> TrainingStep:
    """A worker's last step as the JSON carries it (a non-finite loss as loss_finite false)."""
    finite = loss is None or math.isfinite(loss)
    return TrainingStep(job, step, total_steps, loss if finite else None, finite, learning_rate,
                        tokens, tokens_per_second, seconds_per_step)


def combine(steps: Iterable[TrainingStep],
            histories: dict[str, Sequence[tuple[int, float]]] | None = None) -> list[JobTraining]:
    """One JobTraining per job among the workers' `steps`, in job order; `histories` gives
    each job's (step, loss) points where they are kept."""
    by_job: dict[str, list[TrainingStep]] = defaultdict(list)
    for s in steps:
        by_job[s.job].append(s)
    jobs = []
    for job in sorted(by_job):
        workers = by_job[job]
        step = max(w.step for w in workers)
        at_step = [w for w in workers if w.step == step]
        with_loss = [w for w in at_step if w.loss is not None or not w.loss_finite]
        finite = all(w.loss_finite for w in with_loss)
        loss = _mean([w.loss for w in with_loss]) if with_loss and finite else None
        totals = [w.total_steps for w in workers if w.total_steps is not None]
        total_steps = max(totals) if totals else None
        rates = [w.learning_rate for w in at_step if w.learning_rate is not None]
        seconds_per_step = max(w.seconds_per_step for w in workers)
        eta = (max(0, total_steps - step) * seconds_per_step
               if total_steps is not None and seconds_per_step > 0 else None)
        # Figures past a float's range would be JSON nulls where a number is due (a node
        # reading this one's snapshot would call it unreachable): only absurd reports get here.
        eta = eta if eta is None or math.isfinite(eta) else None
        tokens_per_second = min(sum(w.tokens_per_second for w in workers), sys.float_info.max)
        jobs.append(JobTraining(
            job=job, step=step, total_steps=total_steps, loss=loss, loss_finite=finite,
            loss_workers=len(with_loss), learning_rate=rates[0] if rates else None,
            tokens=sum(w.tokens for w in workers),
            tokens_per_second=tokens_per_second,
            seconds_per_step=seconds_per_step, eta_seconds=eta, workers=len(workers),
            loss_history=list((histories or {}).get(job, ()))))
    return jobs


def merge_loss_histories(histories: Iterable[Sequence[tuple[int, float]]],
                         points: int) -> list[tuple[int, float]]:
    """Several nodes' (step, loss) points of one job as one series: at a step more than one
    node saw, the mean of their losses; the last `points` steps."""
    seen: dict[int, list[float]] = defaultdict(list)
    for history in histories:
        for step, loss in history:
            seen[step].append(loss)
    return [(step, _mean(losses)) for step, losses in sorted(seen.items())][-points:]


def _mean(values: Sequence[float]) -> float:
    return sum(v / len(values) for v in values)  # divided first: finite losses, a finite mean
