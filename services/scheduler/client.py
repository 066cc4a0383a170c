"""Typed calls to the Scheduler service, for tier managers, workers and tools.

Like the tier manager's client, calls wait for the scheduler to be ready up to the
client's timeout (a restarting scheduler is a pause, not an error) and statuses come
back as the project's exceptions.
"""

from __future__ import annotations

import time
from typing import Iterator

import grpc

from tierstack.errors import ERRORS_BY_STATUS, SchedulerUnavailableError, TierstackError
from tierstack.proto import scheduler_pb2 as pb
from tierstack.proto import scheduler_pb2_grpc as pb_grpc
from tierstack.services.scheduler.daemon import default_address
from tierstack.services.scheduler.model import Bandwidths, JobTrace, NodeSpec, Plan
from tierstack.services.scheduler.wire import (
    bandwidths_from, bandwidths_pb, node_from, node_pb, plan_from, trace_pb)
from tierstack.services.tier_manager.daemon import grpc_target

# Calls that can be sent again after a dropped connection without changing anything.
IDEMPOTENT = frozenset({"RegisterNode", "ListNodes", "GetPlan", "ForgetJob"})


class SchedulerClient:
    """Typed calls to the Scheduler service."""

    def __init__(self, address: str | None = None, timeout: float = 30.0) -> None:
        self.target = grpc_target(address or default_address())
        self.timeout = timeout
        self._channel = grpc.insecure_channel(self.target, options=[
            ("grpc.max_receive_message_length", 256 << 20),
            ("grpc.max_send_message_length", 256 << 20),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ])
        self._stub = pb_grpc.SchedulerStub(self._channel)

    def call(self, method: str, request, timeout: float | None = None):
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            try:
                return getattr(self._stub, method)(
                    request, timeout=max(0.1, deadline - time.monotonic()), wait_for_ready=True)
            except grpc.RpcError as e:
                if (e.code() == grpc.StatusCode.UNAVAILABLE and method in IDEMPOTENT
                        and time.monotonic() < deadline):
                    time.sleep(0.1)
                    continue
                raise self._translate(method, e) from None

    def _translate(self, method: str, e: grpc.RpcError) -> TierstackError:
        code = e.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.CANCELLED):
            return SchedulerUnavailableError(
                f"scheduler at {self.target} did not answer {method} ({code.name}: "
                f"{e.details()}); is `tierstack scheduler` running there?")
        return ERRORS_BY_STATUS.get(code.name, TierstackError)(e.details())

    def register_node(self, node: NodeSpec, instance_id: str = "") -> float:
        """Register (or re-register) a node; returns the report interval in seconds."""
        return self.call("RegisterNode", node_pb(node, instance_id)).report_interval_seconds

    def report_bandwidth(self, node_id: str, measured: Bandwidths) -> list[str]:
        response = self.call("ReportBandwidth", pb.BandwidthReport(
            node_id=node_id, measured=bandwidths_pb(measured), timestamp=time.time()))
        return list(response.replanned_jobs)

    def list_nodes(self) -> list[pb.NodeState]:
        return list(self.call("ListNodes", pb.ListNodesRequest()).nodes)

    def node_bandwidths(self) -> dict[str, Bandwidths]:
        """The bandwidths plans assume now, per node."""
        return {s.node.node_id: bandwidths_from(s.current) for s in self.list_nodes()}

    def nodes(self) -> dict[str, NodeSpec]:
        return {s.node.node_id: node_from(s.node) for s in self.list_nodes()}

    def report_trace(self, trace: JobTrace) -> Plan:
        return plan_from(self.call("ReportTrace", trace_pb(trace)))

    def plan(self, job: str) -> Plan:
        return plan_from(self.call("GetPlan", pb.GetPlanRequest(job=job)))

    def wait_for_plan(self, job: str, newer_than: int, timeout: float) -> Plan:
        return plan_from(self.call("GetPlan", pb.GetPlanRequest(
            job=job, newer_than=newer_than, timeout_seconds=timeout), timeout=timeout + 5))

    def watch_plans(self, job: str, after_version: int = 0) -> Iterator[pb.Plan]:
        """Every plan of `job` newer than `after_version`, as it is made (a gRPC stream)."""
        return self._stub.WatchPlans(pb.WatchPlansRequest(job=job, after_version=after_version),
                                     wait_for_ready=True)

    def forget_job(self, job: str) -> None:
        self.call("ForgetJob", pb.ForgetJobRequest(job=job))

    def close(self) -> None:
        self._channel.close()
