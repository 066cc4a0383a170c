"""The daemon's metrics side, composed: RPC timer, worker reports, sampler, HTTP API.

daemon.py calls four things: `interceptors()` when it builds the gRPC server,
`add_to_server`, `start` and `stop`. With `tier_manager.metrics.enabled` false all of
them do nothing (the A/B switch of bench/ensure_layer.py). Without FastAPI and uvicorn
installed the node still collects and reports, but serves no HTTP, and says so.
"""

from __future__ import annotations

import logging
import threading

from tierstack.config import SecurityConfig, TierManagerConfig
from tierstack.dashboards.http_listen import BackgroundHttp, http_framework_installed, http_security
from tierstack.proto import node_metrics_pb2_grpc as pb_grpc
from tierstack.services.tier_manager.server import TierManagerServicer

log = logging.getLogger(__name__)


class NodeTelemetry:
    """Metrics of one tier-manager daemon, and the HTTP server that shows them."""

    def __init__(self, config: TierManagerConfig, servicer: TierManagerServicer,
                 security: SecurityConfig | None = None) -> None:
        self.config = config.metrics
        self.security = security
        self.metrics = None
        self.http = None
        self._serving = threading.Event()
        if self.config.enabled:
            from tierstack.services.tier_manager.metrics import NodeMetrics
            self.metrics = NodeMetrics(self.config, servicer)

    @property
    def url(self) -> str:
        return self.http.url if self.http is not None else ""

    def interceptors(self) -> list:
        return [self.metrics.rpc] if self.metrics is not None else []

    def add_to_server(self, server) -> None:
        if self.metrics is not None:
            pb_grpc.add_NodeMetricsServicer_to_server(self.metrics.workers, server)

    def start(self) -> None:
        if self.metrics is None:
            return
        self.metrics.sample()  # the first reading: rates start from here
        threading.Thread(target=self.metrics.run_sampler, name="tierstack-metrics-sampler",
                         daemon=True).start()
        self._serving.set()
        if not self.config.http_listen:
            return
        if not http_framework_installed():
            log.warning("no HTTP API or dashboard: FastAPI or uvicorn is not installed "
                        "(pip install fastapi uvicorn)")
            return
        setting = "tier_manager.metrics.http_listen"
        rules = http_security(self.config.http_listen, self.security, setting,
                              self.config.allowed_hosts, "tier manager's HTTP API")

        def make_app():
            from tierstack.dashboards.cluster_view import ClusterView, LocalNode, RemoteNode
            from tierstack.dashboards.http_api import create_app

            local = LocalNode(self.metrics)
            peers = [RemoteNode(url, security=self.security) for url in self.config.cluster_nodes]
            # The scheduler serves the view over every node it knows; a node alone sees
            # itself and the peers its config names.
            cluster = ClusterView(lambda: [local, *peers])
            return create_app(cluster, self._serving.is_set, node=self.metrics, guard=rules.guard)

        self.http = BackgroundHttp(self.config.http_listen, setting, rules, make_app,
                                   "tier manager's HTTP API")
        self.metrics.url = self.http.url
        self.http.start()
        log.info("metrics and dashboard on %s/dashboard/", self.http.url)

    def stop(self) -> None:
        self._serving.clear()
        if self.metrics is not None:
            self.metrics.stop()
        if self.http is not None:
            self.http.stop()
