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
import threading

from tierstack.addresses import TIER_MANAGER_ENV, default_tier_manager_address
from tierstack.config import SecurityConfig, TierManagerConfig
from tierstack.doctor import OK, log_checks, map_count_check, raise_open_files_limit
from tierstack.proto import tier_manager_pb2_grpc as pb_grpc
from tierstack.rpc import ServiceEndpoint, serve_until_signalled
from tierstack.services.tier_manager.heap import bound_malloc_arenas
from tierstack.services.tier_manager.registry import TierRegistry
from tierstack.services.tier_manager.server import TierManagerServicer
from tierstack.services.tier_manager.telemetry import NodeTelemetry
from tierstack.services.tier_manager.tiers import open_tiers

log = logging.getLogger(__name__)

SERVICE_NAME = "tierstack.tier_manager.v1.TierManager"


class TierManagerDaemon:
    """Owns the registry, the gRPC server and the health status of one node."""

    def __init__(self, config: TierManagerConfig, max_workers: int = 32,
                 security: SecurityConfig | None = None, recover: bool = False,
                 preload_optimizer: bool = False) -> None:
        bound_malloc_arenas()  # before the gRPC and IO threads exist (heap.py says why)
        self.config = config
        self.preload_optimizer = preload_optimizer
        self.endpoint = ServiceEndpoint(config.listen or default_tier_manager_address(),
                                        SERVICE_NAME, "the tier manager", TIER_MANAGER_ENV, security)
        # The machine is measured once, here: the pools and their parts, then the registry.
        self.tiers = open_tiers(config, recover=recover)
        maps = map_count_check(self.tiers.cpu_pool.max_arenas)  # the pool's own bound
        if maps.status != OK:  # what to raise, in the log before anything fails
            log.warning("%s: %s; %s", maps.name, maps.found, maps.fix)
        self.registry = TierRegistry(config, tiers=self.tiers)
        try:
            self.servicer = TierManagerServicer(self.registry,
                                                lease_timeout=config.lease_timeout_seconds,
                                                jobs_config=config.jobs, threads=max_workers)
            self.telemetry = NodeTelemetry(config, self.servicer, security)
            server = self.endpoint.build_server(max_workers, "tierstack-rpc",
                                                self.telemetry.interceptors())
            self.telemetry.add_to_server(server)
            pb_grpc.add_TierManagerServicer_to_server(self.servicer, server)
            self.port = self.endpoint.bind()
        except BaseException:
            self.registry.close()
            raise
        self.target = self.endpoint.target
        self.security = security
        self._stopped = threading.Event()
        self.node_link = None  # the scheduler link, when tier_manager.scheduler_address is set

    def start(self) -> None:
        self.telemetry.start()  # before gRPC serves: GetHttpEndpoint answers the URL at once
        if self.config.scheduler_address:
            from tierstack.services.tier_manager.node_link import NodeLink

            self.node_link = NodeLink(self.tiers, self.config, self.telemetry.url, self.security)
            self.node_link.start()  # probes the links before serving, then registers
        self.endpoint.start()
        threading.Thread(target=self.servicer.run_lease_reaper, name="tierstack-lease-reaper",
                         daemon=True).start()
        if self.preload_optimizer:
            # After serving, beside the job's first calls: the AdamW stepper needs torch, whose
            # import (about 2 s) would otherwise land on the job's first optimizer step.
            threading.Thread(target=self.servicer.make_stepper, name="tierstack-preload-adamw",
                             daemon=True).start()
        log.info("tier manager %s serving on %s", self.tiers.cpu_pool.instance_id, self.target)

    def stop(self) -> None:
        """Graceful stop: refuse new work, finish in-flight requests, close the pools."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.endpoint.stop_serving()
        if self.node_link is not None:
            self.node_link.stop()
        self.servicer.stop()
        self.telemetry.stop()
        self.endpoint.stop(self.config.shutdown_grace_seconds)
        self.registry.close()
        log.info("tier manager stopped")

    def wait(self) -> None:
        self._stopped.wait()


def serve(config: TierManagerConfig, security: SecurityConfig | None = None,
          recover: bool = False, parent_pid: int | None = None,
          owned_dir: str | None = None, preload_optimizer: bool = False) -> None:
    """Run the daemon in the foreground until SIGTERM or SIGINT (or until process
    `parent_pid` is gone, removing `owned_dir`). With `recover`, first rebuild the manifest from the NVMe data
    (durable.py: DurableCopies.rebuild). With `preload_optimizer`, make the AdamW stepper
    as soon as it serves (a daemon started for a training job), not on the first step."""
    os.umask(0o077)  # everything the daemon creates is its user's alone
    raise_open_files_limit()  # up to the hard limit, before the checks report it
    log_checks(config)  # what is off about the machine, in the log before anything fails
    daemon = TierManagerDaemon(config, security=security, recover=recover,
                               preload_optimizer=preload_optimizer)

    def banner() -> list[str]:
        url = daemon.telemetry.url
        return [f"tier manager listening on {daemon.target}"] + (
            [f"metrics and dashboard on {url}/dashboard/"] if url else [])

    serve_until_signalled(daemon, banner, stop_timeout=config.shutdown_grace_seconds + 60,
                          parent_pid=parent_pid, owned_dir=owned_dir)
