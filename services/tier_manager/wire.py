"""Protobuf messages <-> the tier manager's boundary dataclasses (`types.py`), in one place."""

from __future__ import annotations

from tierstack.errors import InvalidArgumentError
from tierstack.proto import node_metrics_pb2 as metrics_pb
from tierstack.proto import tier_manager_pb2 as pb
from tierstack.services.tier_manager.types import (
    AdamWBlock,
    AdamWHyper,
    AdamWResult,
    AdamWSegment,
    ArenaInfo,
    BufferLease,
    FetchResult,
    JobInfo,
    NodeInfo,
    NodeStats,
    Resident,
    TensorInfo,
    TrainingFigures,
    WorkerReport,
)
from tierstack.tiers import AUTO, CPU, NVME, Placement

_PLACEMENTS: dict[int, Placement] = {pb.PLACEMENT_AUTO: AUTO, pb.PLACEMENT_CPU: CPU,
                                     pb.PLACEMENT_NVME: NVME}
_PLACEMENT_CODES = {name: code for code, name in _PLACEMENTS.items()}


def placement_from(code: int) -> Placement:
    try:
        return _PLACEMENTS[code]
    except KeyError:
        raise InvalidArgumentError(f"unknown placement {code}; use AUTO, CPU or NVME") from None


def placement_pb(placement: str) -> int:
    try:
        return _PLACEMENT_CODES[placement]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown placement {placement!r}; use one of {', '.join(_PLACEMENT_CODES)}") from None


def node_info_pb(node: NodeInfo) -> pb.NodeInfo:
    return pb.NodeInfo(instance_id=node.instance_id,
                       arenas=[pb.Arena(index=a.index, path=a.path, size=a.size) for a in node.arenas],
                       cpu_capacity=node.cpu_capacity, nvme_capacity=node.nvme_capacity,
                       block_size=node.block_size, alignment=node.alignment,
                       arenas_epoch=node.arenas_epoch, session_dir=node.session_dir)


def node_info_from(msg: pb.NodeInfo) -> NodeInfo:
    return NodeInfo(msg.instance_id, tuple(ArenaInfo(a.index, a.path, a.size) for a in msg.arenas),
                    msg.cpu_capacity, msg.nvme_capacity, msg.block_size, msg.alignment,
                    msg.arenas_epoch, msg.session_dir)


def lease_pb(lease: BufferLease) -> pb.BufferLease:
    return pb.BufferLease(lease_id=lease.lease_id, arena=lease.arena, offset=lease.offset,
                          nbytes=lease.nbytes, instance_id=lease.instance_id,
                          arenas_epoch=lease.arenas_epoch)


def lease_from(msg: pb.BufferLease) -> BufferLease:
    return BufferLease(msg.lease_id, msg.arena, msg.offset, msg.nbytes, msg.instance_id,
                       msg.arenas_epoch)


def tensor_info_pb(info: TensorInfo) -> pb.TensorInfo:
    return pb.TensorInfo(key=info.key, dtype=info.dtype, shape=list(info.shape),
                         nbytes=info.nbytes, version=info.version, in_cpu=info.in_cpu,
                         on_nvme=info.on_nvme)


def tensor_info_from(msg: pb.TensorInfo) -> TensorInfo:
    return TensorInfo(msg.key, msg.dtype, tuple(msg.shape), msg.nbytes, msg.version,
                      msg.in_cpu, msg.on_nvme)


def fetch_pb(result: FetchResult) -> pb.FetchResponse:
    return pb.FetchResponse(
        tensors=[pb.Resident(info=tensor_info_pb(r.info), arena=r.arena, offset=r.offset)
                 for r in result.tensors], instance_id=result.instance_id,
        arenas_epoch=result.arenas_epoch)


def fetch_from(msg: pb.FetchResponse) -> FetchResult:
    return FetchResult(tuple(Resident(tensor_info_from(r.info), r.arena, r.offset) for r in msg.tensors),
                       msg.instance_id, msg.arenas_epoch)


def stats_pb(stats: NodeStats) -> pb.NodeStats:
    return pb.NodeStats(**vars(stats))


def stats_from(msg: pb.NodeStats) -> NodeStats:
    return NodeStats(msg.instance_id, msg.timestamp, msg.cpu_capacity, msg.cpu_used,
                     msg.nvme_capacity, msg.nvme_used, msg.tensors, msg.nvme_bytes_read,
                     msg.nvme_bytes_written, msg.evictions, msg.checksum_failures, msg.leases,
                     msg.pinned)


def adamw_block_pb(block: AdamWBlock) -> pb.AdamWBlock:
    return pb.AdamWBlock(
        params=block.params, grads=block.grads, master=block.master, exp_avg=block.exp_avg,
        exp_avg_sq=block.exp_avg_sq, param_dtype=block.param_dtype, grad_dtype=block.grad_dtype,
        state_nbytes=block.state_nbytes, state_placement=placement_pb(block.state_placement),
        segments=[pb.AdamWSegment(numel=s.numel, param_offset=s.param_offset,
                                  grad_offset=s.grad_offset, state_offset=s.state_offset,
                                  group=s.group)
                  for s in block.segments])


def adamw_block_from(msg: pb.AdamWBlock) -> AdamWBlock:
    return AdamWBlock(
        params=msg.params, grads=msg.grads, master=msg.master, exp_avg=msg.exp_avg,
        exp_avg_sq=msg.exp_avg_sq, param_dtype=msg.param_dtype, grad_dtype=msg.grad_dtype,
        state_nbytes=msg.state_nbytes, state_placement=placement_from(msg.state_placement),
        segments=tuple(AdamWSegment(s.numel, s.param_offset, s.grad_offset, s.state_offset,
                                    s.group)
                       for s in msg.segments))


def adamw_request_pb(blocks: list[AdamWBlock], hyper: AdamWHyper, durable: bool) -> pb.AdamWStepRequest:
    return pb.AdamWStepRequest(
        blocks=[adamw_block_pb(b) for b in blocks], step=hyper.step, lr=hyper.lr,
        beta1=hyper.beta1, beta2=hyper.beta2, eps=hyper.eps, weight_decay=hyper.weight_decay,
        grad_scale=hyper.grad_scale, durable=durable, release_gradients=hyper.release_gradients,
        groups=[pb.AdamWGroup(lr=lr, weight_decay=wd) for lr, wd in hyper.groups])


def adamw_request_from(msg: pb.AdamWStepRequest) -> tuple[list[AdamWBlock], AdamWHyper, bool]:
    hyper = AdamWHyper(step=msg.step, lr=msg.lr, beta1=msg.beta1, beta2=msg.beta2, eps=msg.eps,
                       weight_decay=msg.weight_decay, grad_scale=msg.grad_scale or 1.0,
                       release_gradients=msg.release_gradients,
                       groups=tuple((g.lr, g.weight_decay) for g in msg.groups))
    return [adamw_block_from(b) for b in msg.blocks], hyper, msg.durable


def adamw_result_pb(result: AdamWResult) -> pb.AdamWStepResponse:
    return pb.AdamWStepResponse(updated=[tensor_info_pb(i) for i in result.updated],
                                update_seconds=result.update_seconds,
                                wait_seconds=result.wait_seconds)


def adamw_result_from(msg: pb.AdamWStepResponse) -> AdamWResult:
    return AdamWResult([tensor_info_from(i) for i in msg.updated], msg.update_seconds,
                       msg.wait_seconds)


def worker_report_pb(report: WorkerReport) -> metrics_pb.WorkerReport:
    fields = vars(report)
    training = training_pb(report.training) if report.training is not None else None
    return metrics_pb.WorkerReport(**{**fields, "wait_bucket_bounds": list(report.wait_bucket_bounds),
                                      "wait_bucket_counts": list(report.wait_bucket_counts),
                                      "training": training})


def training_pb(figures: TrainingFigures) -> metrics_pb.TrainingFigures:
    # None (not known) is an absent optional field; the message's constructor takes None so.
    return metrics_pb.TrainingFigures(**vars(figures))


def training_from(msg: metrics_pb.TrainingFigures) -> TrainingFigures:
    def known(name: str):
        return getattr(msg, name) if msg.HasField(name) else None

    return TrainingFigures(msg.job, msg.step, known("total_steps"), known("loss"),
                           known("learning_rate"), msg.tokens, msg.tokens_per_second,
                           msg.seconds_per_step)


def job_info_pb(info: JobInfo) -> pb.JobInfo:
    return pb.JobInfo(job=info.job, keep=info.keep, quota_bytes=info.quota_bytes,
                      tensors=info.tensors, bytes=info.bytes, workers=info.workers,
                      managed=info.managed, delete_in_seconds=info.delete_in_seconds)


def job_info_from(msg: pb.JobInfo) -> JobInfo:
    return JobInfo(msg.job, msg.keep, msg.quota_bytes, msg.tensors, msg.bytes, msg.workers,
                   msg.managed, msg.delete_in_seconds)
