"""The plan keeper traces settled iterations, and traces again when the steps under a plan
leave its band (a real scheduler daemon and tier manager, training on the CPU)."""

from __future__ import annotations

import time

import pytest
import torch

from tests.worker.test_engine_tiers import _data, _train_config
from tests.worker.test_offload import TinyGPT
from tierstack.budgets import Budgets
from tierstack.errors import InvalidArgumentError
from tierstack.services.scheduler.client import SchedulerClient
from tierstack.services.scheduler.embedded import EmbeddedScheduler
from tierstack.services.scheduler.synthetic import node
from tierstack.worker.engine.offload_engine import OffloadEngine
from tierstack.worker.store.layer_store import LayerStore
from tierstack.worker.plans.follower import PlanFollower
from tierstack.worker.plans.keeper import BAND, PlanKeeper

BASE = 0.3
"""Seconds of other work in every step (the plan counts it as compute of the last use): the
steps' pace is these sleeps', which load lengthens by milliseconds, not the tiny model's
arithmetic, which another job on a 2-core machine makes twice as slow, and the keeper
would rightly trace again."""
EXTRA = 0.6  # seconds more per step once the job slows down (3x)


def test_a_job_that_slows_down_is_traced_again_and_its_new_plan_is_in_the_band(daemon):
    with EmbeddedScheduler() as scheduler:
        SchedulerClient(scheduler.address).register_node(node("keeper-node"))
        torch.manual_seed(0)
        store = LayerStore("keeper", device="cpu", device_budget=64 << 20, address=daemon.address,
                           durable=False)
        try:
            engine = OffloadEngine(TinyGPT(dim=64, layers=3), store,
                                   _train_config(params={"device": "cpu"}),
                                   budgets=Budgets(hbm=0, host=8 << 30, nvme=8 << 30))
            follower = PlanFollower(store, scheduler.address, node_id="keeper-node")
            keeper = PlanKeeper(follower, lambda: engine.block_optimizer.block_seconds,
                                warmup=1, iterations=2, patience=2)
            reported = []
            for i, (x, y) in enumerate(_data(5, 14)):
                began = time.perf_counter()
                engine.train_step(x, y)
                time.sleep(BASE + (EXTRA if i >= 5 else 0))  # from step 5 the job slows down
                plan = keeper.step_done(time.perf_counter() - began)
                if plan is not None:
                    reported.append((i, plan.version))
            follower.close()
            engine.close()
        finally:
            store.close()
    # The first trace after the warm-up step and two recorded ones; the next once the
    # steps under a plan were off its band: the slow steps' (the first of them is step 5,
    # so its trace is recorded over steps 6 and 7 at the earliest).
    assert reported[0] == (2, 1), reported
    assert 7 <= reported[-1][0] <= 9, (reported, keeper.plans)
    last = keeper.plans[-1]
    assert last.version == reported[-1][1] and len(last.steps) >= 4
    assert keeper.plans[0].predicted_seconds < BASE + EXTRA < last.predicted_seconds
    assert BAND[0] <= last.ratio <= BAND[1], (last.predicted_seconds, last.steps)


@pytest.mark.parametrize("options, says", [
    ({"iterations": 0}, "iterations >= 1"),
    ({"patience": 0}, "patience >= 1"),
    ({"band": (1.1, 1.5)}, "must hold 1"),
])
def test_bad_keeper_settings_are_refused_with_what_to_give(options, says):
    with pytest.raises(InvalidArgumentError, match=says):
        PlanKeeper(follower=None, **options)
