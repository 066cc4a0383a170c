from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Placement(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLACEMENT_AUTO: _ClassVar[Placement]
    PLACEMENT_CPU: _ClassVar[Placement]
    PLACEMENT_NVME: _ClassVar[Placement]
PLACEMENT_AUTO: Placement
PLACEMENT_CPU: Placement
PLACEMENT_NVME: Placement

class Arena(_message.Message):
    __slots__ = ("index", "path", "size")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    index: int
    path: str
    size: int
    def __init__(self, index: _Optional[int] = ..., path: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class GetNodeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("instance_id", "arenas", "cpu_capacity", "nvme_capacity", "block_size", "alignment", "arenas_epoch", "session_dir")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ARENAS_FIELD_NUMBER: _ClassVar[int]
    CPU_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    NVME_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    ARENAS_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SESSION_DIR_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    arenas: _containers.RepeatedCompositeFieldContainer[Arena]
    cpu_capacity: int
    nvme_capacity: int
    block_size: int
    alignment: int
    arenas_epoch: int
    session_dir: str
    def __init__(self, instance_id: _Optional[str] = ..., arenas: _Optional[_Iterable[_Union[Arena, _Mapping]]] = ..., cpu_capacity: _Optional[int] = ..., nvme_capacity: _Optional[int] = ..., block_size: _Optional[int] = ..., alignment: _Optional[int] = ..., arenas_epoch: _Optional[int] = ..., session_dir: _Optional[str] = ...) -> None: ...

class AllocateBufferRequest(_message.Message):
    __slots__ = ("nbytes",)
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    nbytes: int
    def __init__(self, nbytes: _Optional[int] = ...) -> None: ...

class BufferLease(_message.Message):
    __slots__ = ("lease_id", "arena", "offset", "nbytes", "instance_id", "arenas_epoch")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ARENAS_EPOCH_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    arena: int
    offset: int
    nbytes: int
    instance_id: str
    arenas_epoch: int
    def __init__(self, lease_id: _Optional[int] = ..., arena: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., instance_id: _Optional[str] = ..., arenas_epoch: _Optional[int] = ...) -> None: ...

class CancelBufferRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class CancelBufferResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("key", "dtype", "shape", "nbytes", "version", "in_cpu", "on_nvme")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    IN_CPU_FIELD_NUMBER: _ClassVar[int]
    ON_NVME_FIELD_NUMBER: _ClassVar[int]
    key: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    version: int
    in_cpu: bool
    on_nvme: bool
    def __init__(self, key: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., version: _Optional[int] = ..., in_cpu: _Optional[bool] = ..., on_nvme: _Optional[bool] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("key", "lease_id", "dtype", "shape", "durable", "placement")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    key: str
    lease_id: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    durable: bool
    placement: Placement
    def __init__(self, key: _Optional[str] = ..., lease_id: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., durable: _Optional[bool] = ..., placement: _Optional[_Union[Placement, str]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class Resident(_message.Message):
    __slots__ = ("info", "arena", "offset")
    INFO_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    info: TensorInfo
    arena: int
    offset: int
    def __init__(self, info: _Optional[_Union[TensorInfo, _Mapping]] = ..., arena: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("tensors", "instance_id", "arenas_epoch")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ARENAS_EPOCH_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[Resident]
    instance_id: str
    arenas_epoch: int
    def __init__(self, tensors: _Optional[_Iterable[_Union[Resident, _Mapping]]] = ..., instance_id: _Optional[str] = ..., arenas_epoch: _Optional[int] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("queued",)
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    queued: int
    def __init__(self, queued: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("key", "version")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    key: str
    version: int
    def __init__(self, key: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class SetAccessOrderRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class SetAccessOrderResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchStatsRequest(_message.Message):
    __slots__ = ("interval_seconds",)
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    interval_seconds: float
    def __init__(self, interval_seconds: _Optional[float] = ...) -> None: ...

class NodeStats(_message.Message):
    __slots__ = ("instance_id", "timestamp", "cpu_capacity", "cpu_used", "nvme_capacity", "nvme_used", "tensors", "nvme_bytes_read", "nvme_bytes_written", "evictions", "checksum_failures", "leases", "pinned")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    CPU_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    CPU_USED_FIELD_NUMBER: _ClassVar[int]
    NVME_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    NVME_USED_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NVME_BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    NVME_BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    timestamp: float
    cpu_capacity: int
    cpu_used: int
    nvme_capacity: int
    nvme_used: int
    tensors: int
    nvme_bytes_read: int
    nvme_bytes_written: int
    evictions: int
    checksum_failures: int
    leases: int
    pinned: int
    def __init__(self, instance_id: _Optional[str] = ..., timestamp: _Optional[float] = ..., cpu_capacity: _Optional[int] = ..., cpu_used: _Optional[int] = ..., nvme_capacity: _Optional[int] = ..., nvme_used: _Optional[int] = ..., tensors: _Optional[int] = ..., nvme_bytes_read: _Optional[int] = ..., nvme_bytes_written: _Optional[int] = ..., evictions: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., leases: _Optional[int] = ..., pinned: _Optional[int] = ...) -> None: ...

class AdamWSegment(_message.Message):
    __slots__ = ("numel", "param_offset", "grad_offset", "state_offset", "group")
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    PARAM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    GRAD_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STATE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    numel: int
    param_offset: int
    grad_offset: int
    state_offset: int
    group: int
    def __init__(self, numel: _Optional[int] = ..., param_offset: _Optional[int] = ..., grad_offset: _Optional[int] = ..., state_offset: _Optional[int] = ..., group: _Optional[int] = ...) -> None: ...

class AdamWGroup(_message.Message):
    __slots__ = ("lr", "weight_decay")
    LR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    lr: float
    weight_decay: float
    def __init__(self, lr: _Optional[float] = ..., weight_decay: _Optional[float] = ...) -> None: ...

class AdamWBlock(_message.Message):
    __slots__ = ("params", "grads", "master", "exp_avg", "exp_avg_sq", "param_dtype", "grad_dtype", "state_nbytes", "segments", "state_placement")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    MASTER_FIELD_NUMBER: _ClassVar[int]
    EXP_AVG_FIELD_NUMBER: _ClassVar[int]
    EXP_AVG_SQ_FIELD_NUMBER: _ClassVar[int]
    PARAM_DTYPE_FIELD_NUMBER: _ClassVar[int]
    GRAD_DTYPE_FIELD_NUMBER: _ClassVar[int]
    STATE_NBYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    STATE_PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    params: str
    grads: str
    master: str
    exp_avg: str
    exp_avg_sq: str
    param_dtype: str
    grad_dtype: str
    state_nbytes: int
    segments: _containers.RepeatedCompositeFieldContainer[AdamWSegment]
    state_placement: Placement
    def __init__(self, params: _Optional[str] = ..., grads: _Optional[str] = ..., master: _Optional[str] = ..., exp_avg: _Optional[str] = ..., exp_avg_sq: _Optional[str] = ..., param_dtype: _Optional[str] = ..., grad_dtype: _Optional[str] = ..., state_nbytes: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[AdamWSegment, _Mapping]]] = ..., state_placement: _Optional[_Union[Placement, str]] = ...) -> None: ...

class AdamWStepRequest(_message.Message):
    __slots__ = ("blocks", "step", "lr", "beta1", "beta2", "eps", "weight_decay", "grad_scale", "durable", "release_gradients", "groups")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    GRAD_SCALE_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[AdamWBlock]
    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_scale: float
    durable: bool
    release_gradients: bool
    groups: _containers.RepeatedCompositeFieldContainer[AdamWGroup]
    def __init__(self, blocks: _Optional[_Iterable[_Union[AdamWBlock, _Mapping]]] = ..., step: _Optional[int] = ..., lr: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., grad_scale: _Optional[float] = ..., durable: _Optional[bool] = ..., release_gradients: _Optional[bool] = ..., groups: _Optional[_Iterable[_Union[AdamWGroup, _Mapping]]] = ...) -> None: ...

class AdamWStepResponse(_message.Message):
    __slots__ = ("updated", "update_seconds", "wait_seconds")
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    UPDATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    updated: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    update_seconds: float
    wait_seconds: float
    def __init__(self, updated: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., update_seconds: _Optional[float] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class OpenJobRequest(_message.Message):
    __slots__ = ("job", "keep", "quota_bytes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    job: str
    keep: bool
    quota_bytes: int
    def __init__(self, job: _Optional[str] = ..., keep: _Optional[bool] = ..., quota_bytes: _Optional[int] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("job", "keep", "quota_bytes", "tensors", "bytes", "workers", "managed", "delete_in_seconds")
    JOB_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MANAGED_FIELD_NUMBER: _ClassVar[int]
    DELETE_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job: str
    keep: bool
    quota_bytes: int
    tensors: int
    bytes: int
    workers: int
    managed: bool
    delete_in_seconds: float
    def __init__(self, job: _Optional[str] = ..., keep: _Optional[bool] = ..., quota_bytes: _Optional[int] = ..., tensors: _Optional[int] = ..., bytes: _Optional[int] = ..., workers: _Optional[int] = ..., managed: _Optional[bool] = ..., delete_in_seconds: _Optional[float] = ...) -> None: ...

class CloseJobRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class CloseJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobInfo]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobInfo, _Mapping]]] = ...) -> None: ...

class DeleteJobRequest(_message.Message):
    __slots__ = ("job", "force")
    JOB_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    job: str
    force: bool
    def __init__(self, job: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class DeleteJobResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...
