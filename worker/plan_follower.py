"""A worker's side of the scheduler: report the job's trace, then follow its plans.

    store = LayerStore("job", ...)
    follower = PlanFollower(store, scheduler_address)     # starts recording uses
    ... first iteration: ensure_layer / prefetch_ahead / release_layer ...
    follower.report_trace()                                 # plan v1, adopted at once
    ... later iterations: the store's prefetch depth follows every new plan ...

The trace is what the store saw in the recorded iteration: the order of its
ensure_layer calls, each use's compute time (from ensure_layer's return to
release_layer, the device synchronised while recording), and the bytes of each layer's
parameters and of every other kind written with write_back. A use of a layer already
used in the iteration counts as backward. New plans arrive on a background stream and
take effect at the store's next layer boundary (`LayerStore.set_plan`). The plan's
placement and eviction order reach the node's tier manager directly from the scheduler
(services/tier_manager/node_link.py): the worker follows only the depths.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Mapping

import torch

from tierstack.errors import InvalidArgumentError, KeyNotFoundError
from tierstack.services.scheduler.client import SchedulerClient
from tierstack.services.scheduler.model import JobTrace, Plan, TensorSpec
from tierstack.worker.plan_watcher import PlanWatcher
from tierstack.worker.layers import LayerStore

log = logging.getLogger(__name__)


class UseRecorder:
    """The layer uses of one iteration as a store sees them: [layer, ready, released]
    (perf_counter seconds), the device synchronised at each release so that the span
    is the layer's compute."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.uses: list[list] = []

    def used(self, index: int) -> None:
        self.uses.append([index, time.perf_counter(), None])

    def released(self, index: int) -> None:
        if self.uses and self.uses[-1][0] == index and self.uses[-1][2] is None:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the layer's compute
            self.uses[-1][2] = time.perf_counter()


class PlanFollower:
    """Reports one store's trace and keeps its prefetch depths on the current plan."""

    def __init__(self, store: LayerStore, scheduler_address: str | None = None,
                 node_id: str | None = None, timeout: float = 30.0) -> None:
        self.store = store
        self.node_id = node_id or socket.gethostname()
        self.client = SchedulerClient(scheduler_address, timeout=timeout)
        self.watcher: PlanWatcher | None = None
        self.plan: Plan | None = None
        self._trace: JobTrace | None = None
        self.record()

    def record(self) -> None:
        """Start recording the store's layer uses afresh (the next iteration's trace)."""
        self.recorder = self.store.recorder = UseRecorder(self.store.device)

    def trace(self, nodes: list[str] | None = None,
              tier_overrides: Mapping[str, str] | None = None) -> JobTrace:
        """The recorded iteration as a trace (stops recording)."""
        store = self.store
        store.recorder = None
        uses = [u for u in self.recorder.uses if u[2] is not None]
        if not uses:
            raise InvalidArgumentError(
                "no layer use was recorded: run one iteration (ensure_layer ... release_layer "
                "for each layer) between creating the PlanFollower and report_trace")
        seen: set[int] = set()
        backward = []
        for layer, _, _ in uses:
            backward.append(layer in seen)
            seen.add(layer)
        tensors = [TensorSpec(store.key(i), i, "params", layout.nbytes)
                   for i, layout in enumerate(store.layouts) if i not in store.forgotten]
        tensors += [TensorSpec(store.key(i, kind), i, "grad" if kind.startswith("grad") else kind, nbytes)
                    for (i, kind), nbytes in sorted(store.stored_kinds.items())
                    if i not in store.forgotten]
        return JobTrace(job=store.job, nodes=list(nodes or [self.node_id]),
                        step_layer=[u[0] for u in uses], step_compute=[u[2] - u[1] for u in uses],
                        step_backward=backward, tensors=tensors,
                        tier_overrides=dict(tier_overrides or {}), device_budget=store.budget.capacity,
                        # The store drops a layer at release_layer: its budget is all buffers.
                        device_residency=False)

    def report_trace(self, nodes: list[str] | None = None,
                     tier_overrides: Mapping[str, str] | None = None) -> Plan:
        """Send the recorded trace; adopt the plan it returns and follow newer ones."""
        self._trace = self.trace(nodes, tier_overrides)
        plan = self.client.report_trace(self._trace)
        self._adopt(plan)
        if self.watcher is None:
            self.watcher = PlanWatcher(self.client, self.store.job, self._adopt, self._reconnected)
            self.watcher.plan = plan
            self.watcher.start()
        return plan

    def _reconnected(self) -> None:
        """A scheduler that restarted has forgotten the job: report the trace again.

        Its plan versions start over, so the watcher's count restarts with them."""
        try:
            self.client.plan(self.store.job)
        except KeyNotFoundError:
            plan = self.client.report_trace(self._trace)
            log.warning("scheduler forgot job %s (restarted?): trace reported again, plan v%d",
                        self.store.job, plan.version)
            self.watcher.restart_versions(plan)
            self.store.set_plan(plan.version, 0, 0, reset=True)  # versions restarted
            self._adopt(plan)

    def _adopt(self, plan: Plan) -> None:
        mine = plan.nodes.get(self.node_id)
        if mine is None:
            log.warning("plan v%d of %s has nothing for node %s", plan.version, plan.job, self.node_id)
            return
        self.plan = plan
        self.store.set_plan(plan.version, mine.prefetch_depth, mine.read_ahead, mine.staging_buffers)
        log.info("job %s: plan v%d (%s): prefetch depth %d, read-ahead %d", plan.job, plan.version,
                 plan.reason, mine.prefetch_depth, mine.read_ahead)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
        self.client.close()
