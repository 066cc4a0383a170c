"""The trace a training step reports to the scheduler covers the whole step: every
offloaded block's forward and backward (streamed or keeping its activations), the
compute the store does not hold (embeddings, head, resident blocks) and the optimizer's
time per block, so the plan's predicted step can be held against the measured one."""

from __future__ import annotations

import time

import pytest
import torch

from tests.worker.test_engine_tiers import _data, _train_config
from tests.worker.test_placement import _one_block_more
from tests.worker.test_offload import TinyGPT
from tierstack.budgets import Budgets
from tierstack.services.scheduler.client import SchedulerClient
from tierstack.services.scheduler.embedded import EmbeddedScheduler
from tierstack.services.scheduler.synthetic import node
from tierstack.worker.engine import OffloadEngine
from tierstack.worker.layers import LayerStore
from tierstack.worker.plan_follower import PlanFollower

LAYERS = 4


@pytest.fixture
def scheduler():
    with EmbeddedScheduler() as s:
        SchedulerClient(s.address).register_node(node("trace-node"))
        yield s


def _traced_step(daemon, scheduler, job: str, hbm: int, **train):
    """Two steps; the second recorded. (trace, its plan, the second step's seconds, engine
    placement, the optimizer's per-block seconds)."""
    torch.manual_seed(0)
    model = TinyGPT(dim=64, layers=LAYERS)
    store = LayerStore(job, device="cpu", device_budget=64 << 20, address=daemon.address,
                       durable=False)
    try:
        engine = OffloadEngine(model, store, _train_config(**train),
                                           budgets=Budgets(hbm=hbm, host=8 << 30, nvme=8 << 30))
        follower = PlanFollower(store, scheduler.address, node_id="trace-node")
        (x0, y0), (x1, y1) = _data(3, 2)
        engine.train_step(x0, y0)
        follower.record()
        began = time.perf_counter()
        engine.train_step(x1, y1)
        seconds = time.perf_counter() - began
        optimizer = list(engine.block_optimizer.block_seconds)
        plan = follower.report_trace(optimizer_seconds=optimizer)
        trace = follower._trace
        follower.close()
        placement = engine.placement
        engine.close()
        return trace, plan, seconds, placement, optimizer
    finally:
        store.close()


def test_blocks_that_keep_their_activations_are_in_the_trace_forward_and_backward(daemon, scheduler):
    """Parameters pinned to the CPU pool with HBM to spare: every block keeps its
    activations (its forward and backward are separate uses of a layer still on the
    device). Each is a step of the trace, in the order the step ran them."""
    trace, plan, seconds, placement, optimizer = _traced_step(
        daemon, scheduler, "trace-kept", 1 << 40, params={"device": "cpu"})
    assert placement.keep_activations == tuple(range(LAYERS))
    order = list(range(LAYERS)) + list(range(LAYERS - 1, -1, -1))
    assert trace.step_layer.tolist() == order
    assert trace.step_backward.tolist() == [False] * LAYERS + [True] * LAYERS
    assert (trace.step_compute > 0).all()
    # The compute adds up to no more than the step took (waits are left out of it).
    assert trace.step_compute.sum() <= seconds
    assert len(trace.optimizer_seconds) == LAYERS and all(t > 0 for t in optimizer)
    assert trace.optimizer_seconds.tolist() == optimizer
    assert plan.predicted_step_seconds >= trace.step_compute.sum()


def test_streamed_blocks_are_traced_and_resident_ones_are_not_layers_of_it(daemon, scheduler):
    """No HBM budget: every block streamed and recomputed, two uses each. With room for
    one block on the device, that block is no layer of the trace (its compute counts with
    the use before it); the others are, forward then backward."""
    trace, _, seconds, placement, _ = _traced_step(daemon, scheduler, "trace-streamed", 0)
    assert placement is None
    assert trace.step_layer.tolist() == list(range(LAYERS)) + list(range(LAYERS - 1, -1, -1))
    assert trace.step_compute.sum() <= seconds

    hbm = _one_block_more(daemon, _data(3, 1))
    trace, _, seconds, placement, _ = _traced_step(daemon, scheduler, "trace-mixed", hbm,
                                                   params={"device": "auto"})
    assert len(placement.resident) == 1
    streamed = [i for i in range(LAYERS) if i not in placement.resident]
    assert trace.step_layer.tolist() == streamed + streamed[::-1]
    assert trace.step_compute.sum() <= seconds
    assert {t.layer for t in trace.tensors} == set(streamed)
