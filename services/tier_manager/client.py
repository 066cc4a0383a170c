"""The worker's connection to its node's tier manager (gRPC, unix socket by default).

Calls wait for the daemon to be ready up to `reconnect_timeout` seconds, so a daemon
restart looks like a pause rather than an error; statuses come back as the project's
exceptions. `node()` tells whether the daemon restarted (a new instance id), which the
layer store uses to remap arenas and redo interrupted work.
"""

from __future__ import annotations

from tierstack.addresses import default_tier_manager_address, grpc_target
from tierstack.errors import TierManagerUnavailableError
from tierstack.proto import tier_manager_pb2 as pb
from tierstack.proto import tier_manager_pb2_grpc as pb_grpc
from tierstack.rpc import RpcClient


# Calls that can simply be sent again when a connection drops mid-call (a daemon crash):
# repeating them changes nothing. The others (buffers, commits, pins) are redone as a
# whole by the layer store, which first checks whether the daemon restarted.
IDEMPOTENT = frozenset({"GetNode", "Prefetch", "Describe", "GetStats", "SetAccessOrder",
                        "Evict", "Delete"})


class TierManagerClient(RpcClient):
    """Typed calls to the TierManager service."""

    service, command = "tier manager", "tierstack tier-manager"
    unavailable = TierManagerUnavailableError
    idempotent = IDEMPOTENT

    def __init__(self, address: str | None = None, reconnect_timeout: float = 60.0) -> None:
        super().__init__(grpc_target(address or default_tier_manager_address()), pb_grpc.TierManagerStub,
                         reconnect_timeout, options=[
                             ("grpc.max_receive_message_length", 64 << 20),
                             # Reconnect quickly after a daemon restart instead of backing
                             # off for seconds.
                             ("grpc.initial_reconnect_backoff_ms", 50),
                             ("grpc.max_reconnect_backoff_ms", 500),
                         ])

    # ---- the service's calls, typed ---------------------------------------------------

    def node(self) -> pb.NodeInfo:
        return self.call("GetNode", pb.GetNodeRequest())

    def allocate(self, nbytes: int) -> pb.BufferLease:
        return self.call("AllocateBuffer", pb.AllocateBufferRequest(nbytes=nbytes))

    def cancel(self, lease_id: int) -> None:
        self.call("CancelBuffer", pb.CancelBufferRequest(lease_id=lease_id))

    def commit(self, key: str, lease_id: int, dtype: str, shape: tuple[int, ...],
               durable: bool, placement: int = pb.PLACEMENT_AUTO) -> pb.TensorInfo:
        return self.call("Commit", pb.CommitRequest(key=key, lease_id=lease_id, dtype=dtype,
                                                    shape=list(shape), durable=durable,
                                                    placement=placement))

    def fetch(self, keys: list[str]) -> pb.FetchResponse:
        return self.call("Fetch", pb.FetchRequest(keys=keys))

    def prefetch(self, keys: list[str]) -> None:
        """Ask the daemon to start loading keys into its CPU pool; returns once queued."""
        self.call("Prefetch", pb.PrefetchRequest(keys=keys))

    def release(self, key: str, version: int) -> None:
        self.call("Release", pb.ReleaseRequest(key=key, version=version))

    def evict(self, keys: list[str]) -> list[pb.TensorInfo]:
        return list(self.call("Evict", pb.EvictRequest(keys=keys)).tensors)

    def delete(self, keys: list[str]) -> None:
        self.call("Delete", pb.DeleteRequest(keys=keys))

    def describe(self, key: str) -> pb.TensorInfo:
        return self.call("Describe", pb.DescribeRequest(key=key))

    def set_access_order(self, keys: list[str]) -> None:
        self.call("SetAccessOrder", pb.SetAccessOrderRequest(keys=keys))

    def adamw_step(self, request: pb.AdamWStepRequest, timeout: float | None = None) -> pb.AdamWStepResponse:
        """Run one AdamW step over state the daemon holds (not retried: it changes state)."""
        return self.call("AdamWStep", request, timeout=timeout)

    def stats(self) -> pb.NodeStats:
        return self.call("GetStats", pb.GetStatsRequest())

    def watch_stats(self, interval: float = 1.0):
        """Yield NodeStats every `interval` seconds until the iterator is closed."""
        return self._stub.WatchStats(pb.WatchStatsRequest(interval_seconds=interval))

