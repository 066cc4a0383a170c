"""The Scheduler gRPC servicer: the cluster state's operations as RPCs.

Project exceptions become gRPC status codes with their message unchanged
(`tierstack.rpc.rpc_method`, as in the tier manager's servicer).
"""

from __future__ import annotations

import threading

from tierstack.config import SchedulerConfig
from tierstack.errors import InvalidArgumentError
from tierstack.proto import scheduler_pb2 as pb
from tierstack.proto import scheduler_pb2_grpc as pb_grpc
from tierstack.rpc import StreamSlots, checked_interval, rpc_method, rpc_stream
from tierstack.services.scheduler.cluster import ClusterState
from tierstack.services.scheduler.model import Plan
from tierstack.services.scheduler.wire import (
    bandwidths_from, bandwidths_pb, node_from, node_pb, node_plan_update_pb, plan_pb, trace_from)

MAX_WAIT_SECONDS = 3600.0


class SchedulerServicer(pb_grpc.SchedulerServicer):
    """Serves one cluster's `ClusterState`."""

    def __init__(self, config: SchedulerConfig, max_streams: int = 48) -> None:
        self.config = config
        self.cluster = ClusterState(config)
        self.streams = StreamSlots(max_streams, "scheduler")
        self._stopping = threading.Event()

    @rpc_method
    def RegisterNode(self, request, context):
        self.cluster.register_node(node_from(request), request.instance_id, request.metrics_url)
        return pb.RegisterNodeResponse(report_interval_seconds=self.config.report_interval_seconds)

    @rpc_method
    def ReportBandwidth(self, request, context):
        jobs = self.cluster.report_bandwidth(request.node_id, bandwidths_from(request.measured))
        return pb.BandwidthReportResponse(replanned_jobs=jobs)

    @rpc_method
    def ListNodes(self, request, context):
        records = self.cluster.node_records()
        return pb.ListNodesResponse(nodes=[
            pb.NodeState(node=node_pb(r.spec, r.instance_id, r.metrics_url), current=bandwidths_pb(r.spec.bandwidth),
                         last_measured=bandwidths_pb(r.last_measured), last_report=r.last_report)
            for r in records])

    @rpc_method
    def ReportTrace(self, request, context):
        plan = self.cluster.report_trace(trace_from(request))
        return plan_pb(plan, [t.key for t in request.tensors])

    @rpc_method
    def GetPlan(self, request, context):
        if not request.newer_than:
            return plan_pb(*self.cluster.plan(request.job))
        # 0: answer now (a long poll must say how long it may hold a server thread).
        timeout = checked_interval(request.timeout_seconds, "GetPlan timeout_seconds",
                                   at_least=0.0, at_most=MAX_WAIT_SECONDS, default=0.0)
        # A long poll holds its thread like a stream: it takes a stream's slot.
        with self.streams.open(context) as ended:
            found = self.cluster.wait_for_plan(request.job, request.newer_than, timeout, ended)
        if found is None:
            raise InvalidArgumentError(
                f"no plan newer than v{request.newer_than} for job {request.job!r} within "
                f"{timeout:.0f} s; use WatchPlans to follow a job's plans")
        return plan_pb(*found)

    @rpc_stream
    def WatchPlans(self, request, context):
        version = request.after_version
        with self.streams.open(context) as ended:
            while not ended.is_set():
                found = self.cluster.wait_for_plan(request.job, version, 1.0, ended)
                if found is None:
                    continue
                plan, keys = found
                version = plan.version
                yield plan_pb(plan, keys)

    @rpc_stream
    def WatchNodePlans(self, request, context):
        """The node's plans now (one full update, even when empty), then each change."""
        if not request.node_id:
            raise InvalidArgumentError(
                "WatchNodePlans needs the node_id its tier manager registered with")
        with self.streams.open(context) as ended:
            yield from self._node_plan_updates(request.node_id, ended)

    def _node_plan_updates(self, node_id: str, ended: threading.Event):
        sent: dict[str, Plan] = {}
        full = True
        while not ended.is_set():
            found = self.cluster.wait_for_node_plans(node_id, sent, 0.0 if full else 1.0, ended)
            if found is None and not full:
                continue
            plans, forgotten = found or ([], [])
            for plan, _ in plans:
                sent[plan.job] = plan
            for job in forgotten:
                del sent[job]
            yield node_plan_update_pb(node_id, plans, forgotten, full)
            full = False

    @rpc_method
    def ForgetJob(self, request, context):
        self.cluster.forget_job(request.job)
        return pb.ForgetJobResponse()

    def stop(self) -> None:
        self._stopping.set()
        self.streams.close_all()
        self.cluster.wake_all()
