"""A tier manager's link to the scheduler: register the node, report bandwidth, follow plans.

At start a short probe measures the node's four links with the daemon's own parts:
disk write and read through the NVMe pool (its IO engine, O_DIRECT, fdatasync), and
shared memory -> device / device -> shared memory copies from a CPU-pool buffer
(page-locked with cudaHostRegister as the workers' arenas are; a plain copy on a
CPU-only node). The node registers with those figures and its capacities, then every
`report_interval_seconds` (the scheduler's answer) reports the disk bandwidth the IO
engine delivered while busy since the last report (its IoStats): a link without
traffic reports 0, which the scheduler reads as "no measurement". Device links are
measured by workers, not here.

The link also follows the plans of every job on the node (WatchNodePlans) and hands
each to the node's spill (`Spill.apply_plan`), whose eviction then follows the plan's
tiers and eviction order; a job the scheduler forgets is forgotten there too.

The scheduler may be down or restart: registration is retried, a report answered
NOT_FOUND (a restarted scheduler forgot the node) registers again, and a broken plan
stream is opened again; it begins with every plan the scheduler holds for the node, so
plans a restarted scheduler no longer has are dropped. Nothing here can stop the tier
manager from serving.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import TYPE_CHECKING

from tierstack.config import MiB, SecurityConfig, TierManagerConfig
from tierstack.errors import InvalidArgumentError, KeyNotFoundError, TierstackError
from tierstack.services.scheduler.client import SchedulerClient, Stream
from tierstack.services.scheduler.model import TIERS, Bandwidths, JobNodePlan, NodePlanUpdate, NodeSpec
from tierstack.services.tier_manager.eviction import JobPlan
from tierstack.services.tier_manager.tiers import NodeTiers

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

PROBE_BYTES = 64 * MiB


def node_id_of(config: TierManagerConfig) -> str:
    return config.node_id or socket.gethostname()


def probe_bandwidths(tiers: NodeTiers, nbytes: int = PROBE_BYTES, repeats: int = 3) -> Bandwidths:
    """Measure the node's links once (best of `repeats`), within the pools' budgets."""
    nvme, cpu = tiers.durable.pool, tiers.cpu_pool
    block = nvme.block_size
    nbytes = min(nbytes, nvme.free_bytes // 4, cpu.capacity // 4)
    nbytes = max(block, nbytes // block * block)
    buffer = tiers.spill.allocate(nbytes, wait=True)
    try:
        view = cpu.view(buffer)
        view[:] = bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256)
        extent = nvme.allocate(nbytes)
        try:
            write = read = 0.0
            for _ in range(repeats):
                start = time.perf_counter()
                nvme.write(extent, view, label="bandwidth probe")
                nvme.sync([extent])
                write = max(write, nbytes / (time.perf_counter() - start))
                start = time.perf_counter()
                nvme.read(extent, view, None, label="bandwidth probe")
                read = max(read, nbytes / (time.perf_counter() - start))
        finally:
            nvme.free(extent)
        h2d, d2h = _probe_device(view, nbytes, repeats)
    finally:
        cpu.free(buffer)
    return Bandwidths(disk_read=read, disk_write=write, h2d=h2d, d2h=d2h)


def _probe_device(view: memoryview, nbytes: int, repeats: int) -> tuple[float, float]:
    import torch

    host = torch.frombuffer(view, dtype=torch.uint8)
    cuda = torch.cuda.is_available()
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    registered = False
    if cuda:
        registered = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 0)) == 0
    try:
        h2d = d2h = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            device.copy_(host, non_blocking=registered)
            if cuda:
                torch.cuda.synchronize()
            h2d = max(h2d, nbytes / (time.perf_counter() - start))
            start = time.perf_counter()
            host.copy_(device, non_blocking=registered)
            if cuda:
                torch.cuda.synchronize()
            d2h = max(d2h, nbytes / (time.perf_counter() - start))
    finally:
        if registered:
            torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
    return h2d, d2h


def node_spec(tiers: NodeTiers, config: TierManagerConfig, bandwidth: Bandwidths) -> NodeSpec:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu_bytes = sum(torch.cuda.get_device_properties(i).total_memory for i in range(gpus))
    return NodeSpec(node_id=node_id_of(config), gpu_bytes=gpu_bytes, cpu_bytes=tiers.cpu_pool.capacity,
                    nvme_bytes=tiers.durable.pool.capacity, bandwidth=bandwidth, gpus=max(gpus, 1))


def job_plan(plan: JobNodePlan) -> JobPlan:
    """The scheduler's plan for this node as the registry takes it: tiers and eviction
    order by tensor key rather than by index into the trace."""
    keys, node = plan.tensor_keys, plan.plan
    if len(node.tiers) != len(keys):
        raise InvalidArgumentError(
            f"plan v{plan.version} of job {plan.job!r} gives {len(node.tiers)} tiers for "
            f"{len(keys)} tensor keys; the scheduler and this tier manager disagree on the "
            f"wire format: run the same tierstack version on both")
    if any(i >= len(keys) for i in node.eviction_order):
        raise InvalidArgumentError(
            f"plan v{plan.version} of job {plan.job!r} orders a tensor beyond its {len(keys)} "
            f"keys; run the same tierstack version on the scheduler and this tier manager")
    return JobPlan(job=plan.job, version=plan.version, reason=plan.reason,
                   tiers={key: TIERS[int(code)] for key, code in zip(keys, node.tiers)},
                   eviction_order=[keys[i] for i in node.eviction_order])


class NodeLink:
    """Registers this node with the scheduler, reports its measured disk bandwidth and
    has the node's eviction follow the plans of its jobs."""

    def __init__(self, tiers: NodeTiers, config: TierManagerConfig, metrics_url: str = "",
                 security: SecurityConfig | None = None) -> None:
        self.tiers = tiers
        self.config = config
        self.metrics_url = metrics_url  # the node's HTTP API, for the scheduler's cluster view
        self.client = SchedulerClient(config.scheduler_address, timeout=10.0, security=security)
        self.node: NodeSpec | None = None
        self.interval = 2.0
        self.reports = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierstack-node-link", daemon=True)
        self._plan_thread = threading.Thread(target=self._follow_plans, name="tierstack-node-plans",
                                             daemon=True)
        self._plan_stream: Stream[NodePlanUpdate] | None = None

    def start(self) -> None:
        # The probe runs before the daemon serves, so no worker's traffic skews it.
        self.node = node_spec(self.tiers, self.config, probe_bandwidths(self.tiers))
        bw = self.node.bandwidth
        log.info("bandwidth probe: disk read %.2f GB/s, write %.2f GB/s; shm->device %.2f GB/s, "
                 "device->shm %.2f GB/s", bw.disk_read / 1e9, bw.disk_write / 1e9, bw.h2d / 1e9, bw.d2h / 1e9)
        self._thread.start()
        self._plan_thread.start()

    def _register(self) -> None:
        while not self._stop.is_set():
            try:
                self.interval = self.client.register_node(self.node, self.tiers.cpu_pool.instance_id,
                                                          self.metrics_url)
                log.info("registered node %s with the scheduler at %s", self.node.node_id, self.client.target)
                return
            except TierstackError as e:
                log.warning("cannot register with the scheduler (%s); retrying", e)
                self._stop.wait(2.0)

    def _run(self) -> None:
        self._register()
        io = self.tiers.durable.pool.engine.stats
        last = (io.bytes_read, io.read_seconds, io.bytes_written, io.write_seconds)
        while not self._stop.wait(self.interval):
            now = (io.bytes_read, io.read_seconds, io.bytes_written, io.write_seconds)
            read_bytes, read_s = now[0] - last[0], now[1] - last[1]
            write_bytes, write_s = now[2] - last[2], now[3] - last[3]
            last = now
            # Too little traffic says more about latency than bandwidth: report nothing.
            measured = Bandwidths(
                disk_read=read_bytes / read_s if read_bytes >= MiB and read_s > 0 else 0.0,
                disk_write=write_bytes / write_s if write_bytes >= MiB and write_s > 0 else 0.0)
            try:
                self.client.report_bandwidth(self.node.node_id, measured)
                self.reports += 1
            except KeyNotFoundError:
                self._register()  # the scheduler restarted and forgot this node
            except TierstackError as e:
                log.debug("bandwidth report failed: %s", e)

    def _follow_plans(self) -> None:
        """Apply every plan the scheduler makes for this node's jobs, until `stop`."""
        while not self._stop.is_set():
            try:
                self._plan_stream = self.client.watch_node_plans(self.node.node_id)
                for update in self._plan_stream:
                    self._apply(update)
            except TierstackError as e:
                if self._stop.is_set():
                    return
                log.debug("plan stream from the scheduler broke (%s); opening it again", e)
            except Exception:  # noqa: BLE001 - a bug here must not end plan following
                log.exception("applying the scheduler's plans failed; opening the stream again")
            self._stop.wait(0.5)

    def _apply(self, update: NodePlanUpdate) -> None:
        forgotten = list(update.forgotten)
        if update.full:  # the scheduler's whole view: a plan it does not hold is stale
            current = {p.job for p in update.plans}
            forgotten += [p.job for p in self.tiers.spill.eviction_state().plans if p.job not in current]
        for job in forgotten:
            self.tiers.spill.forget_plan(job)
            log.info("job %s: no plan from the scheduler any more; eviction goes without one", job)
        for plan in update.plans:
            try:
                self.tiers.spill.apply_plan(job_plan(plan))
            except InvalidArgumentError as e:
                log.warning("cannot follow plan v%d of job %s: %s", plan.version, plan.job, e)
                continue
            log.info("job %s: following plan v%d (%s)", plan.job, plan.version, plan.reason)

    def stop(self) -> None:
        self._stop.set()
        if self._plan_stream is not None:
            self._plan_stream.cancel()
        for thread in (self._thread, self._plan_thread):
            if thread.is_alive():  # not started when the probe failed
                thread.join(timeout=5)
        self.client.close()
