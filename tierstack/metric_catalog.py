"""Every metric tierstack exports: names, help, labels and histogram buckets, in one place.

The tier manager, the worker SDK and the scheduler import their metric definitions from
here, and the Grafana dashboard and the tests check against it. Names follow Prometheus
conventions: base units (bytes, seconds), counters end in `_total`, one `tierstack_`
prefix. A link is one direction of data movement between two tiers.
"""

from __future__ import annotations

from dataclasses import dataclass

TIERS = ("device", "cpu", "nvme")
"""The tiers of one node: the workers' device memory, the CPU pool, the NVMe pool."""

LINKS = ("nvme->cpu", "cpu->nvme", "cpu->device", "device->cpu")
"""Directions bytes move in. nvme<->cpu is the daemon's IO engine; cpu<->device are the
workers' copies between the shared-memory arenas and their device."""


def link_tiers(link: str) -> tuple[str, str]:
    """(source tier, destination tier) of a link name."""
    src, dst = link.split("->")
    return src, dst


# Request latencies of the tier manager's RPCs: a local call costs ~0.2 ms, a Fetch that
# reads a layer from NVMe tens to hundreds of ms, so the buckets span 50 us to 10 s.
RPC_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
               0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Time ensure_layer waited for a layer: 0 when prefetching kept up (the first bucket),
# up to a whole layer read from a slow disk.
WAIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric family."""

    name: str
    kind: str  # counter, gauge, histogram, info
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    @property
    def sample_names(self) -> tuple[str, ...]:
        """The names its samples appear under in the exposition format."""
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        if self.kind == "info":
            return (f"{self.name}_info",)
        return (self.name,)


def _spec(*args, **kwargs) -> MetricSpec:
    spec = MetricSpec(*args, **kwargs)
    assert spec.kind != "counter" or spec.name.endswith("_total"), spec.name
    return spec


# ---- the tier manager (one per node; worker figures arrive through its ReportWorker) ----
LINK_BYTES = _spec("tierstack_link_bytes_total", "counter",
                   "Bytes moved over a link between two tiers of this node.", ("link",))
LINK_BANDWIDTH = _spec("tierstack_link_bandwidth_bytes_per_second", "gauge",
                       "Bytes per second over a link during the last sample interval.", ("link",))
LINK_PEAK = _spec("tierstack_link_peak_bandwidth_bytes_per_second", "gauge",
                  "Highest bandwidth measured over a link in one sample interval since start.",
                  ("link",))
TIER_CAPACITY = _spec("tierstack_tier_capacity_bytes", "gauge",
                      "Bytes a tier may hold (device: the sum of the workers' device budgets).",
                      ("tier",))
TIER_USED = _spec("tierstack_tier_used_bytes", "gauge", "Bytes a tier holds now.", ("tier",))
TENSORS = _spec("tierstack_tensors", "gauge", "Tensors stored by the tier manager.")
QUEUE_DEPTH = _spec("tierstack_queue_depth", "gauge",
                    "Work waiting or in flight: prefetch (hints queued in the daemon), "
                    "io_requests (blocks in the IO engine), rpc (calls being served), "
                    "loads (layers on their way to a worker's device).", ("queue",))
IO_MAX_IN_FLIGHT = _spec("tierstack_io_max_in_flight", "gauge",
                         "Block requests the NVMe IO engine keeps in flight at most (aio "
                         "thread_count x queue_depth, within its staging buffers), by backend "
                         "(native or threads: aio.engine).", ("backend",))
RPC_DURATION = _spec("tierstack_rpc_duration_seconds", "histogram",
                     "Time the tier manager took to serve an RPC.", ("method",),
                     buckets=RPC_BUCKETS)
RPC_FAILURES = _spec("tierstack_rpc_failures_total", "counter",
                     "RPCs that ended with a status other than OK.", ("method", "code"))
CHECKSUM_FAILURES = _spec("tierstack_checksum_failures_total", "counter",
                          "Blocks read from NVMe whose crc32c did not match.")
EVICTIONS = _spec("tierstack_evictions_total", "counter",
                  "Tensors evicted from the CPU pool to make room.")
PLAN_VERSION = _spec("tierstack_plan_version", "gauge",
                     "Version of the scheduler's plan for a job that this node runs (its "
                     "evictions follow it); no sample without a scheduler.", ("job",))
LEASES = _spec("tierstack_buffer_leases", "gauge",
               "CPU-pool buffers handed to workers and not yet committed or cancelled.")
PINS = _spec("tierstack_pinned_tensors", "gauge", "Fetch pins held by readers.")
WORKERS = _spec("tierstack_workers", "gauge",
                "Workers that reported to this node within the last stale interval.")
WORKER_STALL = _spec("tierstack_worker_stall_seconds_total", "counter",
                     "Time a worker spent waiting in ensure_layer for a layer to arrive.",
                     ("worker",))
WORKER_WAIT = _spec("tierstack_worker_ensure_layer_wait_seconds", "histogram",
                    "Per layer load a worker used, the time ensure_layer waited for it (0 when "
                    "prefetching had it on the device in time).", ("worker",),
                    buckets=WAIT_BUCKETS)
NODE = _spec("tierstack_node", "info", "The node and its tier-manager instance.",
             ("node", "instance_id"))

# ---- training, per job: what its workers' loops report once a step, combined by the node
# (dashboards/training_view.py: the furthest step, the mean loss of the workers at it) ----
TRAINING_STEP = _spec("tierstack_training_step", "gauge",
                      "The last optimizer step a job's workers on this node reported.", ("job",))
TRAINING_TOTAL_STEPS = _spec("tierstack_training_total_steps", "gauge",
                             "Steps a job's run will take; no sample when not known.", ("job",))
TRAINING_LOSS = _spec("tierstack_training_loss", "gauge",
                      "A job's loss at its last step as the user's code computed it, the mean "
                      "over its workers at that step (NaN: one was not finite); no sample "
                      "when none reported one.", ("job",))
TRAINING_LEARNING_RATE = _spec("tierstack_training_learning_rate", "gauge",
                               "The learning rate of a job's last step; no sample when not "
                               "reported.", ("job",))
TRAINING_TOKENS = _spec("tierstack_training_tokens_total", "counter",
                        "Tokens a job's workers on this node trained since they started.",
                        ("job",))
TRAINING_TOKENS_PER_SECOND = _spec("tierstack_training_tokens_per_second", "gauge",
                                   "Tokens a job trains per second over its recent steps, "
                                   "summed over its workers on this node.", ("job",))
TRAINING_SECONDS_PER_STEP = _spec("tierstack_training_seconds_per_step", "gauge",
                                  "Wall time per step of a job over its recent steps (its "
                                  "slowest worker's); 0 until two steps are known.", ("job",))
TRAINING_ETA = _spec("tierstack_training_eta_seconds", "gauge",
                     "Seconds until a job's last step at its recent pace; no sample when its "
                     "total steps or its pace are not known.", ("job",))
TRAINING_METRICS = (TRAINING_STEP, TRAINING_TOTAL_STEPS, TRAINING_LOSS, TRAINING_LEARNING_RATE,
                    TRAINING_TOKENS, TRAINING_TOKENS_PER_SECOND, TRAINING_SECONDS_PER_STEP,
                    TRAINING_ETA)

NODE_METRICS = (LINK_BYTES, LINK_BANDWIDTH, LINK_PEAK, TIER_CAPACITY, TIER_USED, TENSORS,
                QUEUE_DEPTH, IO_MAX_IN_FLIGHT, RPC_DURATION, RPC_FAILURES, CHECKSUM_FAILURES,
                EVICTIONS, PLAN_VERSION, LEASES, PINS, WORKERS, WORKER_STALL, WORKER_WAIT,
                NODE) + TRAINING_METRICS

# ---- the scheduler: its /metrics (services/scheduler/telemetry.py) ----
SCHEDULER_PLAN_VERSION = _spec("tierstack_scheduler_plan_version", "gauge",
                               "Version of the newest plan the scheduler issued.", ("job",))
SCHEDULER_REPLANS = _spec("tierstack_scheduler_replans_total", "counter",
                          "Plans issued again because measured bandwidth drifted or a node "
                          "changed.")
SCHEDULER_NODES = _spec("tierstack_scheduler_nodes", "gauge",
                        "Nodes the scheduler knows and hears from.")
SCHEDULER_METRICS = (SCHEDULER_PLAN_VERSION, SCHEDULER_REPLANS, SCHEDULER_NODES)

ALL_METRICS = NODE_METRICS + SCHEDULER_METRICS


def exported_sample_names(specs=NODE_METRICS) -> set[str]:
    """Every sample name the given families produce."""
    return {name for spec in specs for name in spec.sample_names}
