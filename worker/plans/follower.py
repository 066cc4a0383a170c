"""A worker's side of the scheduler: report the job's trace, then follow its plans.

    follower = PlanFollower(store, scheduler_address)     # starts recording the store's uses
    ... first iteration: ensure_layer / prefetch_ahead / release_layer ...
    follower.report_trace()                                 # plan v1, adopted at once
    ... later iterations: the store's prefetch depth follows every new plan ...

The trace is what the store saw in the recorded iteration: the order of its
ensure_layer calls, each use's compute time, and the bytes of each layer's parameters
and of every other kind written with write_back. A use of a layer already used in the
iteration counts as backward. A use's compute runs from ensure_layer's return to
release_layer (or to `UseRecorder.computed` for a layer kept on the device until its
backward), the device synchronised while recording; the time between uses that was not
spent waiting (for a load, for an optimizer update) is compute too, of what the store
does not hold (embeddings, the head, blocks resident on the device, the loss, the
device's own optimizer), and counts with the use before it. So the trace's compute adds
up to the iteration's time less its waits, and the plan's predicted step can be compared
with the measured one. The optimizer's time per layer is given by the caller
(`TieredAdamW.block_seconds`). New plans arrive on a background stream and
take effect at the store's next layer boundary (the store's `set_plan`). The plan's
placement and eviction order reach the node's tier manager directly from the scheduler
(services/tier_manager/node_link.py): the worker follows only the depths.
"""

from __future__ import annotations

import glob
import logging
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from tierstack.errors import InvalidArgumentError, KeyNotFoundError
from tierstack.services.scheduler.client import SchedulerClient
from tierstack.services.scheduler.model import JobTrace, Plan, TensorSpec
from tierstack.tiers import CPU, NVME
from tierstack.worker.plans.watcher import PlanWatcher
from tierstack.worker.store.block_store import BlockStore

log = logging.getLogger(__name__)


@dataclass
class _Use:
    layer: int
    start: float
    end: float | None = None
    after: float = 0.0  # compute until the next use begins (waits excluded)


class UseRecorder:
    """The layer uses of one iteration as a store sees them, and the compute between them
    (perf_counter seconds; the device synchronised at the end of each use, so that its
    span is the layer's compute)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.uses: list[_Use] = []
        self.began = self._last_end = time.perf_counter()
        self.lead = 0.0  # compute before the first use
        self._open: dict[int, _Use] = {}
        self._last: _Use | None = None  # the use that ended last
        self._waited = 0.0  # waits since then

    def waited(self, seconds: float) -> None:
        """The store's user waited `seconds` before a use (not compute: an optimizer update)."""
        self._waited += seconds

    def used(self, index: int, waited: float = 0.0, filled: object | None = None) -> None:
        """Layer `index` is ready; ensure_layer waited `waited` s for its load, and the
        device waits for `filled` (a CUDA event) before it runs."""
        if filled is not None:  # the device's wait for the copy is a wait, not compute
            start = time.perf_counter()
            filled.synchronize()
            waited += time.perf_counter() - start
        now = time.perf_counter()
        self._gap(now, waited)
        use = _Use(index, now)
        self._open[index] = use
        self.uses.append(use)

    def computed(self, index: int) -> None:
        """Layer `index`'s compute of its current use is done (it may stay on the device)."""
        use = self._open.pop(index, None)
        if use is None:
            return
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the layer's compute
        use.end = self._last_end = time.perf_counter()
        self._last, self._waited = use, 0.0

    released = computed

    def finish(self) -> None:
        """The iteration ended: the time since the last use counts with it."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._gap(time.perf_counter(), 0.0)

    def _gap(self, now: float, waited: float) -> None:
        compute = max(0.0, now - self._last_end - self._waited - waited)
        if self._last is not None:
            self._last.after += compute
        else:
            self.lead += compute
        self._last_end, self._waited = now, 0.0


def _iteration(recorder: UseRecorder) -> tuple[list[_Use], list[float]]:
    """One recorded iteration's finished uses and each one's compute seconds."""
    uses = [u for u in recorder.uses if u.end is not None]
    compute = [u.end - u.start + u.after for u in uses]
    if compute:
        compute[0] += recorder.lead
    return uses, compute


def pinned_tiers(store: BlockStore, tensors: Sequence[TensorSpec]) -> dict[str, str]:
    """The tiers the job pins its tensors to (LayerStore.place: "cpu" kept in the CPU pool,
    "nvme" out of it between uses), as trace overrides. The tier manager honours a pin
    whatever a plan says, so a plan must start from them: without them the planner put the
    main job's NVMe-pinned blocks in the CPU pool and predicted a step with no disk in it.
    A kind pinned alike in every layer is one pattern (the planner matches each pattern
    against every key)."""
    by_kind: dict[str, dict[str, str]] = {}  # kind -> key -> pinned tier ("" where none)
    for t in tensors:
        kind = t.key.rsplit("/", 1)[-1]
        placement = store.placement(t.layer, kind)  # a made-from masters' key: their own
        by_kind.setdefault(kind, {})[t.key] = placement if placement in (CPU, NVME) else ""
    overrides: dict[str, str] = {}
    prefix = glob.escape(store.job)
    for kind, tiers in by_kind.items():
        uniform = set(tiers.values())
        if len(uniform) == 1 and "" not in uniform:
            overrides[f"{prefix}/layer*/{glob.escape(kind)}"] = uniform.pop()
        else:
            overrides.update({glob.escape(k): tier for k, tier in tiers.items() if tier})
    return overrides


class PlanFollower:
    """Reports one store's trace and keeps its prefetch depths on the current plan."""

    def __init__(self, store: BlockStore, scheduler_address: str | None = None,
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
        self.recorded: list[UseRecorder] = []  # earlier iterations of the same trace
        self.recorder = UseRecorder(self.store.device)
        self.store.record_uses(self.recorder)

    def next_iteration(self) -> None:
        """The iteration being recorded ended; record the next one into the same trace
        (each use's compute is then the median over the iterations: one step of a shared
        machine can take twice the next one's)."""
        self.recorder.finish()
        self.recorded.append(self.recorder)
        self.recorder = UseRecorder(self.store.device)
        self.store.record_uses(self.recorder)

    def trace(self, nodes: list[str] | None = None,
              tier_overrides: Mapping[str, str] | None = None,
              optimizer_seconds: Sequence[float] = ()) -> JobTrace:
        """The recorded iteration as a trace (stops recording). `optimizer_seconds[l]`:
        the CPU optimizer step's time for layer l (none given: no optimizer)."""
        store = self.store
        store.record_uses(None)
        self.recorder.finish()
        uses, compute = _iteration(self.recorder)
        if not uses:
            raise InvalidArgumentError(
                "no layer use was recorded: run one iteration (ensure_layer ... release_layer "
                "for each layer) between creating the PlanFollower and report_trace")
        order = [u.layer for u in uses]
        # Earlier iterations count where they used the layers in the same order (a new
        # placement can change which blocks stream).
        same = [c for u, c in map(_iteration, self.recorded) if [x.layer for x in u] == order]
        if same:
            compute = [statistics.median(c) for c in zip(compute, *same)]
        seen: set[int] = set()
        backward = []
        for use in uses:
            backward.append(use.layer in seen)
            seen.add(use.layer)
        # What moves through this node's tiers (a partitioned store's node holds its
        # shards). With weights made from the masters, the masters are what each use moves
        # to the device (the scheduler's "params" kind), and no weights are stored.
        loaded = "master" if store.from_masters else "params"
        tensors = [TensorSpec(store.key(i, kind), i, "params" if kind == loaded else
                              "grad" if kind.startswith("grad") else kind, nbytes)
                   for (i, kind), nbytes in store.stored_state().items()]
        return JobTrace(job=store.job, nodes=list(nodes or [self.node_id]),
                        step_layer=order, step_compute=compute,
                        step_backward=backward, tensors=tensors,
                        optimizer_seconds=[float(t) for t in optimizer_seconds],
                        tier_overrides={**pinned_tiers(store, tensors), **(tier_overrides or {})},
                        device_budget=store.figures().device_capacity,
                        # The store drops a layer at release_layer: its budget is all buffers.
                        device_residency=False)

    def report_trace(self, nodes: list[str] | None = None,
                     tier_overrides: Mapping[str, str] | None = None,
                     optimizer_seconds: Sequence[float] = ()) -> Plan:
        """Send the recorded trace; adopt the plan it returns and follow newer ones."""
        self._trace = self.trace(nodes, tier_overrides, optimizer_seconds)
        plan = self.client.report_trace(self._trace)
        if self.watcher is None:
            self.watcher = PlanWatcher(self.client, self.store.job, self._adopt, self._reconnected)
            self.watcher.offer(plan)
            self._adopt(plan)
            self.watcher.start()
        elif self.watcher.offer(plan):  # not if the stream brought this version first
            self._adopt(plan)
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
        log.debug("job %s: plan v%d (%s): prefetch depth %d, read-ahead %d", plan.job, plan.version,
                  plan.reason, mine.prefetch_depth, mine.read_ahead)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
        self.client.close()
