"""Project exceptions.

Every error a user can cause says what was wrong and what to do about it. Each class
names the gRPC status it maps to, so the daemon's servicer translates them in one place.
"""

from __future__ import annotations


class TierstackError(Exception):
    """Base class of every error tierstack raises on purpose."""

    grpc_status = "INTERNAL"


class ConfigError(TierstackError, ValueError):
    """A configuration value or key is wrong; the message names the key."""

    grpc_status = "INVALID_ARGUMENT"


class InvalidArgumentError(TierstackError, ValueError):
    """A request is malformed: a bad key, a wrong size, an unsupported dtype."""

    grpc_status = "INVALID_ARGUMENT"


class KeyNotFoundError(TierstackError, KeyError):
    """No tensor is stored under the requested key."""

    grpc_status = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "key not found"


class PoolExhaustedError(TierstackError, MemoryError):
    """A pool cannot hold a request within its configured capacity."""

    grpc_status = "RESOURCE_EXHAUSTED"


class CpuPoolFullError(PoolExhaustedError):
    """The CPU pool has no free extent large enough, and nothing could be evicted."""


class NvmePoolFullError(PoolExhaustedError):
    """The NVMe pool (its configured capacity, or the disk itself) is full."""


class DataCorruptionError(TierstackError):
    """Bytes read back do not match their stored checksum; no data is returned."""

    grpc_status = "DATA_LOSS"


class StorageIOError(TierstackError, OSError):
    """The operating system failed an IO request for a reason other than a full disk."""

    # Not UNAVAILABLE: clients retry that as a dropped connection, and a failing disk
    # does not heal by asking again.
    grpc_status = "INTERNAL"


class TierManagerUnavailableError(TierstackError):
    """The node's tier-manager daemon did not answer within the reconnect timeout."""

    grpc_status = "UNAVAILABLE"


class SchedulerUnavailableError(TierstackError):
    """The cluster scheduler did not answer within the client's timeout."""

    grpc_status = "UNAVAILABLE"


class QuotaExceededError(PoolExhaustedError):
    """A job's tensors would exceed its quota on this node."""


class ManifestError(TierstackError):
    """The durable manifest cannot be read as it is: corrupt, missing over existing data,
    or inconsistent with the data files. Nothing is started over it; the message names
    `tierstack tier-manager --recover`."""

    grpc_status = "DATA_LOSS"


class FailedPreconditionError(TierstackError):
    """The request is well formed but the state does not allow it now (a job still in
    use); the message says what has to change first."""

    grpc_status = "FAILED_PRECONDITION"


class AlreadyRunningError(TierstackError):
    """Another daemon holds a resource this one needs (its pool directory, its socket)."""

    grpc_status = "FAILED_PRECONDITION"


class UnsafePathError(TierstackError, PermissionError):
    """A path we would create or open is reachable by another user (owned by them, writable
    by them, or a symlink): opening it could hand them our data or our clients."""

    grpc_status = "PERMISSION_DENIED"


class AuthenticationError(TierstackError):
    """A call came without the service's token, or with a wrong one."""

    grpc_status = "UNAUTHENTICATED"


class PermissionDeniedError(TierstackError):
    """A caller is known but not allowed to do this."""

    grpc_status = "PERMISSION_DENIED"


class MissingExtraError(TierstackError, ImportError):
    """An optional part of tierstack is used without its dependencies installed; the
    message names the pip extra that brings them (tierstack/extras.py)."""


class DeviceBudgetError(TierstackError, MemoryError):
    """A layer does not fit in the worker's device-memory budget."""

    grpc_status = "RESOURCE_EXHAUSTED"


# gRPC status name -> the project exception a client raises for it.
ERRORS_BY_STATUS: dict[str, type[TierstackError]] = {
    "INVALID_ARGUMENT": InvalidArgumentError,
    "NOT_FOUND": KeyNotFoundError,
    "RESOURCE_EXHAUSTED": PoolExhaustedError,
    "DATA_LOSS": DataCorruptionError,
    "UNAVAILABLE": TierManagerUnavailableError,
    "UNAUTHENTICATED": AuthenticationError,
    "PERMISSION_DENIED": PermissionDeniedError,
    "FAILED_PRECONDITION": FailedPreconditionError,
}


class RetryLaterError(TierstackError):
    """The service did nothing and can serve the call later: something held by another
    call passes by itself (a pin, an update, a job's deletion) or its threads for long
    calls are all busy. UNAVAILABLE with a retry hint; `RpcClient` retries it."""

    grpc_status = "UNAVAILABLE"

    def __init__(self, message: str, retry_after: float = 0.005) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RankFailedError(TierstackError):
    """Another rank of a partitioned job died or failed: this rank cannot go on (its
    collectives have no partner), so the job ends on every rank. The message names the
    rank and what is known of why. Never crosses the wire (ranks fail, not RPCs)."""
