"""The tier-manager daemon: one process per node serving its registry over gRPC.

`tierstack tier-manager` runs `serve`. It listens on a unix socket by default (the worker
SDK finds it at the same default path), answers gRPC health checks, and on SIGTERM or
SIGINT stops taking requests, lets in-flight ones (writes) finish within the grace
period, and closes the pools. After a crash, the next start reclaims the dead instance's
arenas and finds every durable tensor again through the manifest.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tierstack.config import TierManagerConfig
from tierstack.errors import InvalidArgumentError
from tierstack.proto import tier_manager_pb2_grpc as pb_grpc
from tierstack.rpc import serve_until_signalled
from tierstack.services.tier_manager.registry import TierRegistry
from tierstack.services.tier_manager.server import TierManagerServicer
from tierstack.services.tier_manager.telemetry import NodeTelemetry

log = logging.getLogger(__name__)

SERVICE_NAME = "tierstack.tier_manager.v1.TierManager"
ADDRESS_ENV = "TIERSTACK_TIER_MANAGER"


def default_address() -> str:
    """The node's tier-manager address: $TIERSTACK_TIER_MANAGER, else a per-user socket."""
    return os.environ.get(ADDRESS_ENV) or f"unix:/tmp/tierstack-{os.getuid()}/tier-manager.sock"


def grpc_target(address: str) -> str:
    """A gRPC target from an address: a bare path becomes a unix socket."""
    if address.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")):
        return address
    if address.startswith("/") or address.startswith("./"):
        return f"unix:{os.path.abspath(address)}"
    return address


def unix_socket_path(target: str) -> Path | None:
    if target.startswith("unix://"):
        return Path(target[len("unix://"):])
    if target.startswith("unix:"):
        return Path(target[len("unix:"):])
    return None


def clear_stale_socket(path: Path, what: str = "a tier manager", env: str = ADDRESS_ENV) -> None:
    """Remove a socket file left by a crashed daemon; refuse if a daemon still answers."""
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()
        log.warning("removed stale socket %s left by a previous daemon", path)
        return
    finally:
        probe.close()
    raise InvalidArgumentError(
        f"{what} is already listening on {path}; stop it, or give this one another "
        f"address (--listen or ${env})")


class TierManagerDaemon:
    """Owns the registry, the gRPC server and the health status of one node."""

    def __init__(self, config: TierManagerConfig, max_workers: int = 32) -> None:
        self.config = config
        self.target = grpc_target(config.listen or default_address())
        socket_path = unix_socket_path(self.target)
        if socket_path is not None:
            socket_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            clear_stale_socket(socket_path)
        self.registry = TierRegistry(config)
        self.servicer = TierManagerServicer(self.registry,
                                            lease_timeout=config.lease_timeout_seconds)
        self.health = health.HealthServicer()
        self.telemetry = NodeTelemetry(config, self.servicer)
        self.server = grpc.server(ThreadPoolExecutor(max_workers, thread_name_prefix="tierstack-rpc"),
                                  options=[("grpc.so_reuseport", 0)],
                                  interceptors=self.telemetry.interceptors())
        self.telemetry.add_to_server(self.server)
        pb_grpc.add_TierManagerServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        try:
            self.port = self.server.add_insecure_port(self.target)
        except RuntimeError:  # grpcio >= 1.5x raises instead of returning 0
            self.port = 0
        if self.port == 0:
            self.registry.close()
            raise InvalidArgumentError(
                f"cannot listen on {self.target}: the address is in use or invalid; give "
                f"another with --listen (unix:/path/to.sock or host:port)")
        if socket_path is not None:
            os.chmod(socket_path, 0o600)  # workers run as the daemon's user
        self._stopped = threading.Event()
        self.node_link = None  # the scheduler link, when tier_manager.scheduler_address is set

    def start(self) -> None:
        self.telemetry.start()  # before gRPC serves: GetHttpEndpoint answers the URL at once
        if self.config.scheduler_address:
            from tierstack.services.scheduler.node_link import NodeLink
            self.node_link = NodeLink(self.registry, self.config, self.telemetry.url)
            self.node_link.start()  # probes the links before serving, then registers
        self.server.start()
        threading.Thread(target=self.servicer.run_lease_reaper, name="tierstack-lease-reaper",
                         daemon=True).start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("tier manager %s serving on %s", self.registry.cpu_pool.instance_id, self.target)

    def stop(self) -> None:
        """Graceful stop: refuse new work, finish in-flight requests, close the pools."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.node_link is not None:
            self.node_link.stop()
        self.servicer.stop()
        self.telemetry.stop()
        self.server.stop(grace=self.config.shutdown_grace_seconds).wait()
        self.registry.close()
        socket_path = unix_socket_path(self.target)
        if socket_path is not None and socket_path.exists():
            socket_path.unlink()
        log.info("tier manager stopped")

    def wait(self) -> None:
        self._stopped.wait()


def serve(config: TierManagerConfig) -> None:
    """Run the daemon in the foreground until SIGTERM or SIGINT."""
    daemon = TierManagerDaemon(config)

    def banner() -> list[str]:
        url = daemon.telemetry.url
        return [f"tier manager listening on {daemon.target}"] + (
            [f"metrics and dashboard on {url}/dashboard/"] if url else [])

    serve_until_signalled(daemon, banner)
