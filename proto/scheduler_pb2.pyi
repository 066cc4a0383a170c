from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Bandwidths(_message.Message):
    __slots__ = ("disk_read", "disk_write", "h2d", "d2h")
    DISK_READ_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITE_FIELD_NUMBER: _ClassVar[int]
    H2D_FIELD_NUMBER: _ClassVar[int]
    D2H_FIELD_NUMBER: _ClassVar[int]
    disk_read: float
    disk_write: float
    h2d: float
    d2h: float
    def __init__(self, disk_read: _Optional[float] = ..., disk_write: _Optional[float] = ..., h2d: _Optional[float] = ..., d2h: _Optional[float] = ...) -> None: ...

class Node(_message.Message):
    __slots__ = ("node_id", "gpu_bytes", "cpu_bytes", "nvme_bytes", "gpus", "bandwidth", "instance_id", "metrics_url")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_BYTES_FIELD_NUMBER: _ClassVar[int]
    CPU_BYTES_FIELD_NUMBER: _ClassVar[int]
    NVME_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    gpu_bytes: int
    cpu_bytes: int
    nvme_bytes: int
    gpus: int
    bandwidth: Bandwidths
    instance_id: str
    metrics_url: str
    def __init__(self, node_id: _Optional[str] = ..., gpu_bytes: _Optional[int] = ..., cpu_bytes: _Optional[int] = ..., nvme_bytes: _Optional[int] = ..., gpus: _Optional[int] = ..., bandwidth: _Optional[_Union[Bandwidths, _Mapping]] = ..., instance_id: _Optional[str] = ..., metrics_url: _Optional[str] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("report_interval_seconds",)
    REPORT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    report_interval_seconds: float
    def __init__(self, report_interval_seconds: _Optional[float] = ...) -> None: ...

class BandwidthReport(_message.Message):
    __slots__ = ("node_id", "measured", "timestamp")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MEASURED_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    measured: Bandwidths
    timestamp: float
    def __init__(self, node_id: _Optional[str] = ..., measured: _Optional[_Union[Bandwidths, _Mapping]] = ..., timestamp: _Optional[float] = ...) -> None: ...

class BandwidthReportResponse(_message.Message):
    __slots__ = ("replanned_jobs",)
    REPLANNED_JOBS_FIELD_NUMBER: _ClassVar[int]
    replanned_jobs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, replanned_jobs: _Optional[_Iterable[str]] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("key", "layer", "kind", "nbytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    key: str
    layer: int
    kind: str
    nbytes: int
    def __init__(self, key: _Optional[str] = ..., layer: _Optional[int] = ..., kind: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class JobTrace(_message.Message):
    __slots__ = ("job", "nodes", "step_layer", "step_compute", "step_backward", "tensors", "optimizer_seconds", "tier_overrides", "device_budget", "step_gather", "step_reduce", "no_device_residency")
    class TierOverridesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    STEP_LAYER_FIELD_NUMBER: _ClassVar[int]
    STEP_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    STEP_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIER_OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    STEP_GATHER_FIELD_NUMBER: _ClassVar[int]
    STEP_REDUCE_FIELD_NUMBER: _ClassVar[int]
    NO_DEVICE_RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    job: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    step_layer: _containers.RepeatedScalarFieldContainer[int]
    step_compute: _containers.RepeatedScalarFieldContainer[float]
    step_backward: _containers.RepeatedScalarFieldContainer[bool]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    optimizer_seconds: _containers.RepeatedScalarFieldContainer[float]
    tier_overrides: _containers.ScalarMap[str, str]
    device_budget: int
    step_gather: _containers.RepeatedScalarFieldContainer[float]
    step_reduce: _containers.RepeatedScalarFieldContainer[float]
    no_device_residency: bool
    def __init__(self, job: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ..., step_layer: _Optional[_Iterable[int]] = ..., step_compute: _Optional[_Iterable[float]] = ..., step_backward: _Optional[_Iterable[bool]] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., optimizer_seconds: _Optional[_Iterable[float]] = ..., tier_overrides: _Optional[_Mapping[str, str]] = ..., device_budget: _Optional[int] = ..., step_gather: _Optional[_Iterable[float]] = ..., step_reduce: _Optional[_Iterable[float]] = ..., no_device_residency: _Optional[bool] = ...) -> None: ...

class NodePlan(_message.Message):
    __slots__ = ("node_id", "tiers", "prefetch_depth", "read_ahead", "staging_buffers", "eviction_order", "assumed", "ordering", "device_hits", "lower_bound_seconds", "predicted_step_seconds")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_DEPTH_FIELD_NUMBER: _ClassVar[int]
    READ_AHEAD_FIELD_NUMBER: _ClassVar[int]
    STAGING_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    EVICTION_ORDER_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_FIELD_NUMBER: _ClassVar[int]
    ORDERING_FIELD_NUMBER: _ClassVar[int]
    DEVICE_HITS_FIELD_NUMBER: _ClassVar[int]
    LOWER_BOUND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    tiers: bytes
    prefetch_depth: int
    read_ahead: int
    staging_buffers: int
    eviction_order: _containers.RepeatedScalarFieldContainer[int]
    assumed: Bandwidths
    ordering: str
    device_hits: bytes
    lower_bound_seconds: float
    predicted_step_seconds: float
    def __init__(self, node_id: _Optional[str] = ..., tiers: _Optional[bytes] = ..., prefetch_depth: _Optional[int] = ..., read_ahead: _Optional[int] = ..., staging_buffers: _Optional[int] = ..., eviction_order: _Optional[_Iterable[int]] = ..., assumed: _Optional[_Union[Bandwidths, _Mapping]] = ..., ordering: _Optional[str] = ..., device_hits: _Optional[bytes] = ..., lower_bound_seconds: _Optional[float] = ..., predicted_step_seconds: _Optional[float] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("job", "version", "nodes", "predicted_step_seconds", "lower_bound_seconds", "fits", "reason", "created", "tensor_keys")
    JOB_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOWER_BOUND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FITS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_KEYS_FIELD_NUMBER: _ClassVar[int]
    job: str
    version: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodePlan]
    predicted_step_seconds: float
    lower_bound_seconds: float
    fits: bool
    reason: str
    created: float
    tensor_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job: _Optional[str] = ..., version: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodePlan, _Mapping]]] = ..., predicted_step_seconds: _Optional[float] = ..., lower_bound_seconds: _Optional[float] = ..., fits: _Optional[bool] = ..., reason: _Optional[str] = ..., created: _Optional[float] = ..., tensor_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class GetPlanRequest(_message.Message):
    __slots__ = ("job", "newer_than", "timeout_seconds")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NEWER_THAN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job: str
    newer_than: int
    timeout_seconds: float
    def __init__(self, job: _Optional[str] = ..., newer_than: _Optional[int] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class WatchPlansRequest(_message.Message):
    __slots__ = ("job", "after_version")
    JOB_FIELD_NUMBER: _ClassVar[int]
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    job: str
    after_version: int
    def __init__(self, job: _Optional[str] = ..., after_version: _Optional[int] = ...) -> None: ...

class WatchNodePlansRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class JobNodePlan(_message.Message):
    __slots__ = ("job", "version", "reason", "plan", "tensor_keys")
    JOB_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    TENSOR_KEYS_FIELD_NUMBER: _ClassVar[int]
    job: str
    version: int
    reason: str
    plan: NodePlan
    tensor_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job: _Optional[str] = ..., version: _Optional[int] = ..., reason: _Optional[str] = ..., plan: _Optional[_Union[NodePlan, _Mapping]] = ..., tensor_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class NodePlanUpdate(_message.Message):
    __slots__ = ("node_id", "plans", "forgotten", "full")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PLANS_FIELD_NUMBER: _ClassVar[int]
    FORGOTTEN_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    plans: _containers.RepeatedCompositeFieldContainer[JobNodePlan]
    forgotten: _containers.RepeatedScalarFieldContainer[str]
    full: bool
    def __init__(self, node_id: _Optional[str] = ..., plans: _Optional[_Iterable[_Union[JobNodePlan, _Mapping]]] = ..., forgotten: _Optional[_Iterable[str]] = ..., full: _Optional[bool] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeState(_message.Message):
    __slots__ = ("node", "current", "last_measured", "last_report")
    NODE_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    LAST_MEASURED_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORT_FIELD_NUMBER: _ClassVar[int]
    node: Node
    current: Bandwidths
    last_measured: Bandwidths
    last_report: float
    def __init__(self, node: _Optional[_Union[Node, _Mapping]] = ..., current: _Optional[_Union[Bandwidths, _Mapping]] = ..., last_measured: _Optional[_Union[Bandwidths, _Mapping]] = ..., last_report: _Optional[float] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeState]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeState, _Mapping]]] = ...) -> None: ...

class ForgetJobRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class ForgetJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
