"""The Scheduler gRPC servicer: the cluster state's operations as RPCs.

Project exceptions become gRPC status codes here with their message unchanged, the way
the tier manager's servicer does it.
"""

from __future__ import annotations

import functools
import logging
import threading

import grpc

from tierstack.config import SchedulerConfig
from tierstack.errors import InvalidArgumentError, TierstackError
from tierstack.proto import scheduler_pb2 as pb
from tierstack.proto import scheduler_pb2_grpc as pb_grpc
from tierstack.services.scheduler.cluster import ClusterState
from tierstack.services.scheduler.wire import (
    bandwidths_from, bandwidths_pb, node_from, node_pb, plan_pb, trace_from)

log = logging.getLogger(__name__)

MAX_WAIT_SECONDS = 3600.0


def _rpc(method):
    """Run an RPC body, turning project errors into gRPC statuses."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except TierstackError as e:
            context.abort(getattr(grpc.StatusCode, e.grpc_status), str(e))
        except Exception as e:  # noqa: BLE001 - a bug: say so, keep the scheduler up
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

    return wrapper


class SchedulerServicer(pb_grpc.SchedulerServicer):
    """Serves one cluster's `ClusterState`."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.cluster = ClusterState(config)
        self._stopping = threading.Event()

    @_rpc
    def RegisterNode(self, request, context):
        self.cluster.register_node(node_from(request), request.instance_id)
        return pb.RegisterNodeResponse(report_interval_seconds=self.config.report_interval_seconds)

    @_rpc
    def ReportBandwidth(self, request, context):
        jobs = self.cluster.report_bandwidth(request.node_id, bandwidths_from(request.measured))
        return pb.BandwidthReportResponse(replanned_jobs=jobs)

    @_rpc
    def ListNodes(self, request, context):
        records = self.cluster.node_records()
        return pb.ListNodesResponse(nodes=[
            pb.NodeState(node=node_pb(r.spec, r.instance_id), current=bandwidths_pb(r.spec.bandwidth),
                         last_measured=bandwidths_pb(r.last_measured), last_report=r.last_report)
            for r in records])

    @_rpc
    def ReportTrace(self, request, context):
        plan = self.cluster.report_trace(trace_from(request))
        return plan_pb(plan, [t.key for t in request.tensors])

    @_rpc
    def GetPlan(self, request, context):
        if not request.newer_than:
            return plan_pb(*self.cluster.plan(request.job))
        timeout = min(request.timeout_seconds or MAX_WAIT_SECONDS, MAX_WAIT_SECONDS)
        found = self.cluster.wait_for_plan(request.job, request.newer_than, timeout, self._stopping)
        if found is None:
            raise InvalidArgumentError(
                f"no plan newer than v{request.newer_than} for job {request.job!r} within "
                f"{timeout:.0f} s; use WatchPlans to follow a job's plans")
        return plan_pb(*found)

    def WatchPlans(self, request, context):
        version = request.after_version
        while context.is_active() and not self._stopping.is_set():
            found = self.cluster.wait_for_plan(request.job, version, 1.0, self._stopping)
            if found is None:
                continue
            plan, keys = found
            version = plan.version
            yield plan_pb(plan, keys)

    @_rpc
    def ForgetJob(self, request, context):
        self.cluster.forget_job(request.job)
        return pb.ForgetJobResponse()

    def stop(self) -> None:
        self._stopping.set()
        self.cluster.wake_all()
