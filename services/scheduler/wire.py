"""Protobuf messages <-> the scheduler's dataclasses, in one place.

Per-tensor and per-step arrays travel as bytes (one byte each): a plan for 100,000
tensors on 64 nodes is 6.4 MB rather than millions of repeated fields.
"""

from __future__ import annotations

import numpy as np

from tierstack.proto import scheduler_pb2 as pb
from tierstack.services.scheduler.model import (
    Bandwidths, JobNodePlan, JobTrace, NodePlan, NodePlanUpdate, NodeSpec, NodeState, Plan, TensorSpec)


def bandwidths_pb(bw: Bandwidths) -> pb.Bandwidths:
    return pb.Bandwidths(**bw.as_dict())


def bandwidths_from(msg: pb.Bandwidths) -> Bandwidths:
    return Bandwidths(disk_read=msg.disk_read, disk_write=msg.disk_write, h2d=msg.h2d, d2h=msg.d2h)


def node_pb(node: NodeSpec, instance_id: str = "", metrics_url: str = "") -> pb.Node:
    return pb.Node(node_id=node.node_id, gpu_bytes=int(node.gpu_bytes), cpu_bytes=int(node.cpu_bytes),
                   nvme_bytes=int(node.nvme_bytes), gpus=node.gpus,
                   bandwidth=bandwidths_pb(node.bandwidth), instance_id=instance_id,
                   metrics_url=metrics_url)


def node_from(msg: pb.Node) -> NodeSpec:
    return NodeSpec(node_id=msg.node_id, gpu_bytes=msg.gpu_bytes, cpu_bytes=msg.cpu_bytes,
                    nvme_bytes=msg.nvme_bytes, gpus=msg.gpus or 1,
                    bandwidth=bandwidths_from(msg.bandwidth))


def node_state_from(msg: pb.NodeState) -> NodeState:
    return NodeState(node=node_from(msg.node), current=bandwidths_from(msg.current),
                     last_measured=bandwidths_from(msg.last_measured), last_report=msg.last_report,
                     instance_id=msg.node.instance_id, metrics_url=msg.node.metrics_url)


def trace_pb(trace: JobTrace) -> pb.JobTrace:
    return pb.JobTrace(
        job=trace.job, nodes=list(trace.nodes), step_layer=trace.step_layer.tolist(),
        step_compute=trace.step_compute.tolist(), step_backward=trace.step_backward.tolist(),
        tensors=[pb.TensorSpec(key=t.key, layer=t.layer, kind=t.kind, nbytes=t.nbytes) for t in trace.tensors],
        optimizer_seconds=trace.optimizer_seconds.tolist(), tier_overrides=dict(trace.tier_overrides),
        device_budget=int(trace.device_budget), step_gather=trace.step_gather.tolist(),
        step_reduce=trace.step_reduce.tolist(), no_device_residency=not trace.device_residency)


def trace_from(msg: pb.JobTrace) -> JobTrace:
    return JobTrace(
        job=msg.job, nodes=list(msg.nodes), step_layer=np.array(msg.step_layer, dtype=np.int64),
        step_compute=np.array(msg.step_compute, dtype=np.float64),
        step_backward=np.array(msg.step_backward, dtype=bool),
        tensors=[TensorSpec(t.key, t.layer, t.kind, t.nbytes) for t in msg.tensors],
        optimizer_seconds=np.array(msg.optimizer_seconds, dtype=np.float64),
        tier_overrides=dict(msg.tier_overrides), device_budget=msg.device_budget,
        step_gather=np.array(msg.step_gather, dtype=np.float64),
        step_reduce=np.array(msg.step_reduce, dtype=np.float64),
        device_residency=not msg.no_device_residency)


def node_plan_pb(p: NodePlan) -> pb.NodePlan:
    hits = b"" if p.device_hits is None else np.asarray(p.device_hits, dtype=np.uint8).tobytes()
    return pb.NodePlan(
        node_id=p.node_id, tiers=np.asarray(p.tiers, dtype=np.uint8).tobytes(),
        prefetch_depth=p.prefetch_depth, read_ahead=p.read_ahead,
        staging_buffers=p.staging_buffers, eviction_order=p.eviction_order,
        assumed=bandwidths_pb(p.assumed), ordering=p.ordering, device_hits=hits,
        lower_bound_seconds=p.lower_bound_seconds, predicted_step_seconds=p.predicted_step_seconds)


def node_plan_from(p: pb.NodePlan) -> NodePlan:
    return NodePlan(
        node_id=p.node_id, tiers=np.frombuffer(p.tiers, dtype=np.uint8).astype(np.int8),
        prefetch_depth=p.prefetch_depth, read_ahead=p.read_ahead,
        eviction_order=list(p.eviction_order), assumed=bandwidths_from(p.assumed),
        predicted_step_seconds=p.predicted_step_seconds,
        lower_bound_seconds=p.lower_bound_seconds, ordering=p.ordering or "deadline",
        staging_buffers=p.staging_buffers,
        device_hits=np.frombuffer(p.device_hits, dtype=np.uint8).astype(bool) if p.device_hits else None)


def plan_pb(plan: Plan, tensor_keys: list[str]) -> pb.Plan:
    return pb.Plan(job=plan.job, version=plan.version,
                   nodes=[node_plan_pb(p) for p in plan.nodes.values()],
                   predicted_step_seconds=plan.predicted_step_seconds,
                   lower_bound_seconds=plan.lower_bound_seconds, fits=plan.fits, reason=plan.reason,
                   created=plan.created, tensor_keys=tensor_keys)


def plan_from(msg: pb.Plan) -> Plan:
    return Plan(job=msg.job, version=msg.version,
                nodes={p.node_id: node_plan_from(p) for p in msg.nodes},
                predicted_step_seconds=msg.predicted_step_seconds,
                lower_bound_seconds=msg.lower_bound_seconds, fits=msg.fits, reason=msg.reason,
                created=msg.created)


def node_plan_update_pb(node_id: str, plans: list[tuple[Plan, list[str]]], forgotten: list[str],
                        full: bool) -> pb.NodePlanUpdate:
    """The node's part of each (plan, tensor keys), and the jobs it no longer runs."""
    return pb.NodePlanUpdate(node_id=node_id, forgotten=forgotten, full=full, plans=[
        pb.JobNodePlan(job=plan.job, version=plan.version, reason=plan.reason,
                       plan=node_plan_pb(plan.nodes[node_id]), tensor_keys=keys)
        for plan, keys in plans])


def node_plan_update_from(msg: pb.NodePlanUpdate) -> NodePlanUpdate:
    return NodePlanUpdate(node_id=msg.node_id, forgotten=list(msg.forgotten), full=msg.full, plans=[
        JobNodePlan(job=p.job, version=p.version, reason=p.reason, plan=node_plan_from(p.plan),
                    tensor_keys=list(p.tensor_keys))
        for p in msg.plans])
