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

from tierstack.addresses import SCHEDULER_ENV, default_scheduler_address
from tierstack.config import SchedulerConfig, SecurityConfig
from tierstack.proto import scheduler_pb2_grpc as pb_grpc
from tierstack.rpc import ServiceEndpoint, serve_until_signalled
from tierstack.services.scheduler.server import SchedulerServicer
from tierstack.services.scheduler.telemetry import SchedulerTelemetry

log = logging.getLogger(__name__)

SERVICE_NAME = "tierstack.scheduler.v1.Scheduler"
STREAM_RESERVE = 16


class SchedulerDaemon:
    """Owns the servicer, the gRPC server and the health status."""

    def __init__(self, config: SchedulerConfig, max_workers: int = 64,
                 security: SecurityConfig | None = None) -> None:
        config.validate()
        self.config = config
        self.endpoint = ServiceEndpoint(config.listen or default_scheduler_address(),
                                        SERVICE_NAME, "the scheduler", SCHEDULER_ENV, security)
        self.servicer = SchedulerServicer(config, max_streams=max_workers - STREAM_RESERVE)
        self.telemetry = SchedulerTelemetry(config, self.servicer.cluster, security)
        # Every WatchPlans stream holds a thread: size the pool for many workers (and keep
        # STREAM_RESERVE of them from streams for the unary calls).
        server = self.endpoint.build_server(max_workers, "tierstack-sched")
        pb_grpc.add_SchedulerServicer_to_server(self.servicer, server)
        self.port = self.endpoint.bind()
        self.target = self.endpoint.target
        self._stopped = threading.Event()

    def start(self) -> None:
        self.telemetry.start()
        self.endpoint.start()
        log.info("scheduler serving on %s", self.target)

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.endpoint.stop_serving()
        self.servicer.stop()
        self.endpoint.stop(self.config.shutdown_grace_seconds)
        self.telemetry.stop()
        log.info("scheduler stopped")


def serve(config: SchedulerConfig, security: SecurityConfig | None = None,
          parent_pid: int | None = None, owned_dir: str | None = None) -> None:
    """Run the scheduler in the foreground until SIGTERM or SIGINT (or until process
    `parent_pid` is gone, removing `owned_dir`)."""
    os.umask(0o077)  # everything the daemon creates is its user's alone
    daemon = SchedulerDaemon(config, security=security)

    def banner() -> list[str]:
        url = daemon.telemetry.url
        return [f"scheduler listening on {daemon.target}"] + (
            [f"cluster metrics and dashboard on {url}/dashboard/"] if url else [])

    serve_until_signalled(daemon, banner, stop_timeout=config.shutdown_grace_seconds + 60,
                          parent_pid=parent_pid, owned_dir=owned_dir)
