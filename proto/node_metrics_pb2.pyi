from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerReport(_message.Message):
    __slots__ = ("worker_id", "job", "device", "timestamp", "cpu_to_device_bytes", "device_to_cpu_bytes", "stall_seconds", "wait_bucket_bounds", "wait_bucket_counts", "wait_seconds_sum", "device_used_bytes", "device_capacity_bytes", "loads_in_flight", "prefetch_depth", "plan_version", "predicted_step_seconds", "step_seconds", "training")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    CPU_TO_DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TO_CPU_BYTES_FIELD_NUMBER: _ClassVar[int]
    STALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_BUCKET_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_BUCKET_COUNTS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_SUM_FIELD_NUMBER: _ClassVar[int]
    DEVICE_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOADS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_DEPTH_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    job: str
    device: str
    timestamp: float
    cpu_to_device_bytes: int
    device_to_cpu_bytes: int
    stall_seconds: float
    wait_bucket_bounds: _containers.RepeatedScalarFieldContainer[float]
    wait_bucket_counts: _containers.RepeatedScalarFieldContainer[int]
    wait_seconds_sum: float
    device_used_bytes: int
    device_capacity_bytes: int
    loads_in_flight: int
    prefetch_depth: int
    plan_version: int
    predicted_step_seconds: float
    step_seconds: float
    training: TrainingFigures
    def __init__(self, worker_id: _Optional[str] = ..., job: _Optional[str] = ..., device: _Optional[str] = ..., timestamp: _Optional[float] = ..., cpu_to_device_bytes: _Optional[int] = ..., device_to_cpu_bytes: _Optional[int] = ..., stall_seconds: _Optional[float] = ..., wait_bucket_bounds: _Optional[_Iterable[float]] = ..., wait_bucket_counts: _Optional[_Iterable[int]] = ..., wait_seconds_sum: _Optional[float] = ..., device_used_bytes: _Optional[int] = ..., device_capacity_bytes: _Optional[int] = ..., loads_in_flight: _Optional[int] = ..., prefetch_depth: _Optional[int] = ..., plan_version: _Optional[int] = ..., predicted_step_seconds: _Optional[float] = ..., step_seconds: _Optional[float] = ..., training: _Optional[_Union[TrainingFigures, _Mapping]] = ...) -> None: ...

class TrainingFigures(_message.Message):
    __slots__ = ("job", "step", "total_steps", "loss", "learning_rate", "tokens", "tokens_per_second", "seconds_per_step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    total_steps: int
    loss: float
    learning_rate: float
    tokens: int
    tokens_per_second: float
    seconds_per_step: float
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., loss: _Optional[float] = ..., learning_rate: _Optional[float] = ..., tokens: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., seconds_per_step: _Optional[float] = ...) -> None: ...

class ReportWorkerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetHttpEndpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HttpEndpoint(_message.Message):
    __slots__ = ("url",)
    URL_FIELD_NUMBER: _ClassVar[int]
    url: str
    def __init__(self, url: _Optional[str] = ...) -> None: ...
