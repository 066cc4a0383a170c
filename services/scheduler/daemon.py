"""The scheduler daemon: one process per cluster serving plans over gRPC.

`tierstack scheduler` runs `serve`. Like the tier manager it listens on a unix socket by
default (`$TIERSTACK_SCHEDULER`, else /tmp/tierstack-<uid>/scheduler.sock; host:port for
a cluster), answers gRPC health checks, and stops gracefully on SIGTERM or SIGINT. Its
state (nodes, plans) is soft: after a restart, tier managers register again and workers
report their traces again.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tierstack.config import SchedulerConfig
from tierstack.errors import InvalidArgumentError
from tierstack.proto import scheduler_pb2_grpc as pb_grpc
from tierstack.rpc import serve_until_signalled
from tierstack.services.scheduler.server import SchedulerServicer
from tierstack.services.scheduler.telemetry import SchedulerTelemetry
from tierstack.services.tier_manager.daemon import clear_stale_socket, grpc_target, unix_socket_path

log = logging.getLogger(__name__)

SERVICE_NAME = "tierstack.scheduler.v1.Scheduler"
ADDRESS_ENV = "TIERSTACK_SCHEDULER"


def default_address() -> str:
    """The scheduler's address: $TIERSTACK_SCHEDULER, else a per-user socket."""
    return os.environ.get(ADDRESS_ENV) or f"unix:/tmp/tierstack-{os.getuid()}/scheduler.sock"


class SchedulerDaemon:
    """Owns the servicer, the gRPC server and the health status."""

    def __init__(self, config: SchedulerConfig, max_workers: int = 64) -> None:
        config.validate()
        self.config = config
        self.target = grpc_target(config.listen or default_address())
        socket_path = unix_socket_path(self.target)
        if socket_path is not None:
            socket_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            clear_stale_socket(socket_path, "a scheduler", ADDRESS_ENV)
        self.servicer = SchedulerServicer(config)
        self.telemetry = SchedulerTelemetry(config, self.servicer.cluster)
        self.health = health.HealthServicer()
        # Every WatchPlans stream holds a thread: size the pool for many workers.
        self.server = grpc.server(ThreadPoolExecutor(max_workers, thread_name_prefix="tierstack-sched"),
                                  options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_SchedulerServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        try:
            port = self.server.add_insecure_port(self.target)
        except RuntimeError:
            port = 0
        if port == 0:
            raise InvalidArgumentError(
                f"cannot listen on {self.target}: the address is in use or invalid; give "
                f"another with --listen (unix:/path/to.sock or host:port)")
        self.port = port
        if socket_path is not None:
            os.chmod(socket_path, 0o600)
        self._stopped = threading.Event()

    def start(self) -> None:
        self.telemetry.start()
        self.server.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("scheduler serving on %s", self.target)

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.servicer.stop()
        self.server.stop(grace=self.config.shutdown_grace_seconds).wait()
        self.telemetry.stop()
        socket_path = unix_socket_path(self.target)
        if socket_path is not None and socket_path.exists():
            socket_path.unlink()
        log.info("scheduler stopped")


def serve(config: SchedulerConfig) -> None:
    """Run the scheduler in the foreground until SIGTERM or SIGINT."""
    daemon = SchedulerDaemon(config)

    def banner() -> list[str]:
        url = daemon.telemetry.url
        return [f"scheduler listening on {daemon.target}"] + (
            [f"cluster metrics and dashboard on {url}/dashboard/"] if url else [])

    serve_until_signalled(daemon, banner)
