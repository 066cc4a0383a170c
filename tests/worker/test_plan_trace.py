"""The trace a training step reports to the scheduler covers the whole step: every
offloaded block's forward and backward (streamed or keeping its activations), the
compute the store does not hold (embeddings, head, resident blocks) and the optimizer's
time per block, so the plan's predicted step can be held against the measured one."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from tests.worker.test_engine_tiers import _data, _train_config
from tests.worker.test_placement import _one_block_more
from tests.worker.test_offload import TinyGPT
from tierstack.budgets import Budgets
from tierstack.services.scheduler.client import SchedulerClient
from tierstack.services.scheduler.embedded import EmbeddedScheduler
from tierstack.services.scheduler.model import CPU, TIERS
from tierstack.services.scheduler.synthetic import node
from tierstack.worker.engine.offload_engine import OffloadEngine
from tierstack.worker.store.layer_store import LayerStore
from tierstack.worker.plans.follower import PlanFollower

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
    train_config = _train_config(**train)
    from_masters = train_config.params.weights_from_masters == "on"  # the store's setting
    store = LayerStore(job, device="cpu", device_budget=64 << 20, address=daemon.address,
                       durable=False, from_masters=from_masters)
    try:
        engine = OffloadEngine(model, store, train_config,
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


def test_state_pinned_to_nvme_is_on_nvme_in_the_plan_and_its_disk_time_in_the_prediction(daemon, scheduler):
    """make run's placement (parameters and optimizer state out of the CPU pool between
    uses): the trace carries the pins, so the plan has every block's parameters and
    moments on NVMe, its disk in the prediction, although the node's CPU pool (2 GB) would
    hold them all. With the pins left to the planner it kept them in the CPU pool."""
    pinned = {"device": "nvme", "max_in_cpu": 0}
    trace, plan, _, _, _ = _traced_step(daemon, scheduler, "trace-pinned", 0,
                                        params=pinned, optimizer_state=pinned)
    tiers = {t.key: TIERS[int(code)] for t, code in zip(trace.tensors, plan.nodes["trace-node"].tiers)}
    kinds = {key.rsplit("/", 1)[1] for key in tiers}
    assert {"params", "exp_avg", "exp_avg_sq"} <= kinds
    for key, tier in tiers.items():
        kind = key.rsplit("/", 1)[1]
        assert tier == ("nvme" if kind != "grad" else "cpu"), (key, tier)
    # One pattern per kind pinned alike in every layer, not one per key.
    assert set(trace.tier_overrides.values()) == {"nvme"} and len(trace.tier_overrides) == 3
    # The same trace without its pins: the planner's own placement keeps everything in
    # the CPU pool, and no disk time is in the prediction.
    unpinned = dataclasses.replace(trace, tier_overrides={}, job="trace-unpinned")
    loose = SchedulerClient(scheduler.address).report_trace(unpinned)
    assert set(loose.nodes["trace-node"].tiers.tolist()) == {CPU}
    assert plan.lower_bound_seconds >= loose.lower_bound_seconds
    assert plan.predicted_step_seconds > loose.predicted_step_seconds


SLOW = 1.0
"""Seconds one iteration of three is slowed by (a busy machine)."""


def test_a_trace_of_several_iterations_takes_each_use_s_median(daemon, scheduler):
    """One slow iteration among three (a busy machine) does not set the trace's compute."""
    torch.manual_seed(0)
    store = LayerStore("trace-median", device="cpu", device_budget=64 << 20, address=daemon.address,
                       durable=False)
    try:
        engine = OffloadEngine(TinyGPT(dim=64, layers=LAYERS), store,
                               _train_config(params={"device": "cpu"}),
                               budgets=Budgets(hbm=0, host=8 << 30, nvme=8 << 30))
        follower = PlanFollower(store, scheduler.address, node_id="trace-node")
        batches = _data(4, 4)
        engine.train_step(*batches[0])
        for i, (x, y) in enumerate(batches[1:]):
            follower.record() if i == 0 else follower.next_iteration()
            engine.train_step(x, y)
        time.sleep(SLOW)  # counted as compute of the last iteration's last use
        follower.report_trace()
        trace = follower._trace
        follower.close()
        engine.close()
    finally:
        store.close()
    # The sleep is in the last iteration's last use; the median of three leaves it out. A
    # trace that took the last iteration would count at least SLOW; the median reaches it
    # only if two of the three iterations' tails (the optimizer step, the next forward's
    # start: tens of ms) took a second, which no load here makes them.
    assert trace.step_compute[-1] < SLOW
    assert len(trace.step_layer) == 2 * LAYERS


def test_with_weights_made_from_masters_the_masters_are_what_each_use_moves(daemon, scheduler):
    """train.params.weights_from_masters 'on': no weights are stored; the trace names each
    block's fp32 masters as the tensor its uses move to the device (the scheduler's
    "params" kind, at 4 bytes per parameter), and the plan is made from it."""
    trace, plan, _, _, _ = _traced_step(daemon, scheduler, "trace-masters", 0, precision="bf16",
                                        params={"device": "cpu", "weights_from_masters": "on"})
    loaded = [t for t in trace.tensors if t.kind == "params"]
    assert sorted(t.layer for t in loaded) == list(range(LAYERS))
    assert all(t.key.endswith("/master") for t in loaded)
    assert not any(t.key.endswith("/params") for t in trace.tensors)
    assert plan.predicted_step_seconds > 0
