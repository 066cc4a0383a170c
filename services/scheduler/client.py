"""Typed calls to the Scheduler service, for tier managers, workers and tools.

Like the tier manager's client, calls wait for the scheduler to be ready up to the
client's timeout (a restarting scheduler is a pause, not an error) and statuses come
back as the project's exceptions.
"""

from __future__ import annotations

import time
from typing import Callable, Generic, Iterator, TypeVar

import grpc

from tierstack.addresses import default_scheduler_address, grpc_target
from tierstack.config import SecurityConfig
from tierstack.errors import SchedulerUnavailableError, TierstackError
from tierstack.proto import scheduler_pb2 as pb
from tierstack.proto import scheduler_pb2_grpc as pb_grpc
from tierstack.rpc import RpcClient
from tierstack.services.scheduler.model import (
    Bandwidths, JobTrace, NodePlanUpdate, NodeSpec, NodeState, Plan)
from tierstack.services.scheduler.wire import (
    bandwidths_pb, node_pb, node_plan_update_from, node_state_from, plan_from, trace_pb)

T = TypeVar("T")

# Calls that can be sent again after a dropped connection without changing anything.
IDEMPOTENT = frozenset({"RegisterNode", "ListNodes", "GetPlan", "ForgetJob"})


class SchedulerClient(RpcClient):
    """Typed calls to the Scheduler service."""

    service, command = "scheduler", "tierstack scheduler"
    unavailable = SchedulerUnavailableError
    idempotent = IDEMPOTENT
    retry_seconds = 0.1

    def __init__(self, address: str | None = None, timeout: float = 30.0,
                 security: SecurityConfig | None = None) -> None:
        super().__init__(grpc_target(address or default_scheduler_address()), pb_grpc.SchedulerStub,
                         timeout, security=security, options=[
                             ("grpc.max_receive_message_length", 256 << 20),
                             ("grpc.max_send_message_length", 256 << 20),
                             ("grpc.initial_reconnect_backoff_ms", 100),
                             ("grpc.max_reconnect_backoff_ms", 1000),
                         ])

    def register_node(self, node: NodeSpec, instance_id: str = "", metrics_url: str = "") -> float:
        """Register (or re-register) a node; returns the report interval in seconds."""
        return self.call("RegisterNode", node_pb(node, instance_id, metrics_url)).report_interval_seconds

    def report_bandwidth(self, node_id: str, measured: Bandwidths) -> list[str]:
        response = self.call("ReportBandwidth", pb.BandwidthReport(
            node_id=node_id, measured=bandwidths_pb(measured), timestamp=time.time()))
        return list(response.replanned_jobs)

    def list_nodes(self) -> list[NodeState]:
        """Every registered node: what it registered and what it measured since."""
        return [node_state_from(s) for s in self.call("ListNodes", pb.ListNodesRequest()).nodes]

    def node_bandwidths(self) -> dict[str, Bandwidths]:
        """The bandwidths plans assume now, per node."""
        return {s.node.node_id: s.current for s in self.list_nodes()}

    def nodes(self) -> dict[str, NodeSpec]:
        return {s.node.node_id: s.node for s in self.list_nodes()}

    def report_trace(self, trace: JobTrace) -> Plan:
        return plan_from(self.call("ReportTrace", trace_pb(trace)))

    def plan(self, job: str) -> Plan:
        return plan_from(self.call("GetPlan", pb.GetPlanRequest(job=job)))

    def wait_for_plan(self, job: str, newer_than: int, timeout: float) -> Plan:
        return plan_from(self.call("GetPlan", pb.GetPlanRequest(
            job=job, newer_than=newer_than, timeout_seconds=timeout), timeout=timeout + 5))

    def watch_plans(self, job: str, after_version: int = 0) -> "Stream[Plan]":
        """Every plan of `job` newer than `after_version`, as it is made (a gRPC stream,
        waiting for the scheduler to be up)."""
        self.check_endpoint()
        call = self._stub.WatchPlans(pb.WatchPlansRequest(job=job, after_version=after_version),
                                     wait_for_ready=True, metadata=self.metadata)
        return Stream(call, plan_from, lambda e: self._translate("WatchPlans", e))

    def watch_node_plans(self, node_id: str) -> "Stream[NodePlanUpdate]":
        """The plans of every job on `node_id`: a full update first, then each change (a
        gRPC stream, waiting for the scheduler to be up)."""
        self.check_endpoint()
        call = self._stub.WatchNodePlans(pb.WatchNodePlansRequest(node_id=node_id),
                                         wait_for_ready=True, metadata=self.metadata)
        return Stream(call, node_plan_update_from, lambda e: self._translate("WatchNodePlans", e))

    def forget_job(self, job: str) -> None:
        self.call("ForgetJob", pb.ForgetJobRequest(job=job))


class Stream(Generic[T]):
    """A server stream read as dataclasses. It ends with the project's exception
    (SchedulerUnavailableError when the scheduler went away or `cancel` was called from
    another thread)."""

    def __init__(self, call, convert: Callable[[object], T],
                 translate: Callable[[grpc.RpcError], TierstackError]) -> None:
        self._call = call
        self._convert = convert
        self._translate = translate

    def __iter__(self) -> Iterator[T]:
        try:
            for msg in self._call:
                yield self._convert(msg)
        except grpc.RpcError as e:
            raise self._translate(e) from None

    def cancel(self) -> None:
        self._call.cancel()
