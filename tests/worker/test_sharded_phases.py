"""Per-phase figures of partitioned ranks (issue 37 item 2): two real gloo ranks, each
with its own tier-manager daemon, report where each step went.

The checks are the invariants the figures must keep to explain a step: the main
thread's forward, backward and optimizer call run one after the other inside the step,
so their sum cannot exceed it; the communication thread runs one collective (or one
wait for a shard) at a time, so its spans cannot exceed it either. Double-counted
spans, spans leaking across steps or a phase left untimed break them.
"""

from __future__ import annotations

import time

from tierstack.worker.jobs.gpt import GPTConfig
from tierstack.worker.jobs.partitioned_job import (PHASES, PartitionedSpec, launch_partitioned,
                                                   small_embedded_node)
from tierstack.worker.store.step_phases import NO_PHASES, PhaseClock

SPEC = PartitionedSpec(gpt=GPTConfig(vocab_size=256, seq_len=32, dim=32, heads=2, layers=2),
                       steps=3, global_batch=4, data="random", embedded=small_embedded_node(16),
                       cpu_threads=1, time_phases=True)
MAIN_THREAD = ("forward_s", "backward_s", "optimizer_s")
COMM_THREAD = ("all_gather_s", "reduce_scatter_s", "all_reduce_s", "broadcast_s", "tier_wait_s")


def test_each_rank_reports_its_phases_and_they_fit_in_its_step():
    assert set(MAIN_THREAD + COMM_THREAD) == set(PHASES)
    ranks = launch_partitioned(SPEC, 2)
    for rank in ranks:
        for step in rank.steps[1:]:  # the first step also probes and places
            figures = {name: getattr(step, name) for name in PHASES}
            assert all(v > 0 for v in figures.values()), (rank.rank, figures)
            assert step.daemon_adamw_s > 0
            main = sum(figures[n] for n in MAIN_THREAD)
            comm = sum(figures[n] for n in COMM_THREAD)
            assert main <= step.seconds, (rank.rank, step.seconds, figures)
            assert comm <= step.seconds, (rank.rank, step.seconds, figures)
            # The main thread's waits for gathered layers happen inside its forward and backward.
            assert step.stalled_s <= figures["forward_s"] + figures["backward_s"]


def test_a_clock_adds_up_spans_per_name_and_nobody_pays_for_the_one_not_asked_for():
    clock = PhaseClock("cpu")
    # Each span is at least its sleep and at most the time measured around it here (a
    # loaded machine makes both longer alike): not a bound of the clock's own.
    began = time.perf_counter()
    for _ in range(3):
        with clock.host("tier_wait"):
            time.sleep(0.01)
    waited = time.perf_counter() - began
    began = time.perf_counter()
    with clock.device("forward"):  # no CUDA: the call's own time
        time.sleep(0.02)
    forward = time.perf_counter() - began
    totals = clock.totals()
    assert set(totals) == {"tier_wait", "forward"}
    assert 0.03 <= totals["tier_wait"] <= waited and 0.02 <= totals["forward"] <= forward
    with NO_PHASES.host("forward"), NO_PHASES.device("backward"):
        pass
    assert NO_PHASES.totals() == {}
