"""The scheduler's metrics and cluster dashboard: the same HTTP API as a node's, over
every node that registered (each node's own HTTP API, read by `RemoteNode`).

Its /metrics exports the scheduler's own figures (services' metric catalog): nodes
registered, each job's plan version, re-plans. /api/v1/cluster adds up the nodes;
/dashboard/ shows the cluster. Without fastapi/uvicorn (the GPU machine) the scheduler
runs without them and says so.
"""

from __future__ import annotations

import logging
import threading

from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily

from tierstack import metric_catalog as mc
from tierstack.config import SchedulerConfig, SecurityConfig
from tierstack.dashboards.http_listen import BackgroundHttp, http_framework_installed, http_security
from tierstack.services.scheduler.cluster import ClusterState

log = logging.getLogger(__name__)


class SchedulerCollector:
    """Prometheus families of the scheduler's state, built at scrape time."""

    def __init__(self, cluster: ClusterState) -> None:
        self.cluster = cluster

    def collect(self):
        nodes = GaugeMetricFamily(mc.SCHEDULER_NODES.name, mc.SCHEDULER_NODES.help)
        nodes.add_metric([], len(self.cluster.node_records()))
        versions = GaugeMetricFamily(mc.SCHEDULER_PLAN_VERSION.name, mc.SCHEDULER_PLAN_VERSION.help,
                                     labels=mc.SCHEDULER_PLAN_VERSION.labels)
        for job, version in sorted(self.cluster.plan_versions().items()):
            versions.add_metric([job], version)
        replans = CounterMetricFamily(mc.SCHEDULER_REPLANS.name, mc.SCHEDULER_REPLANS.help)
        replans.add_metric([], self.cluster.replans)
        yield from (nodes, versions, replans)


class SchedulerTelemetry:
    """The scheduler's HTTP API (started when `metrics_listen` is set)."""

    def __init__(self, config: SchedulerConfig, cluster: ClusterState,
                 security: SecurityConfig | None = None) -> None:
        self.config = config
        self.security = security
        self.cluster = cluster
        self.registry = CollectorRegistry()
        self.registry.register(SchedulerCollector(cluster))
        self.http = None
        self._serving = threading.Event()

    @property
    def url(self) -> str:
        return self.http.url if self.http is not None else ""

    def start(self) -> None:
        self._serving.set()
        if not self.config.metrics_listen:
            return
        if not http_framework_installed():
            log.warning("no HTTP API or dashboard: FastAPI or uvicorn is not installed "
                        "(pip install fastapi uvicorn)")
            return
        setting = "scheduler.metrics_listen"
        rules = http_security(self.config.metrics_listen, self.security, setting,
                              self.config.metrics_allowed_hosts, "scheduler's HTTP API")

        def make_app():
            from tierstack.dashboards.cluster_view import ClusterView, RemoteNode
            from tierstack.dashboards.http_api import create_app

            peers: dict[str, RemoteNode] = {}

            def nodes() -> list[RemoteNode]:
                # One RemoteNode per registered URL, kept while the node stays registered
                # (registration accepts only http(s) URLs: cluster.check_metrics_url).
                urls = {r.metrics_url for r in self.cluster.node_records() if r.metrics_url}
                for url in urls - set(peers):
                    peers[url] = RemoteNode(url, security=self.security)
                return [peers[url] for url in sorted(urls)]

            return create_app(ClusterView(nodes), self._serving.is_set, registry=self.registry,
                              name="scheduler", guard=rules.guard)

        self.http = BackgroundHttp(self.config.metrics_listen, setting, rules, make_app,
                                   "scheduler's HTTP API")
        self.http.start()
        log.info("cluster metrics and dashboard on %s/dashboard/", self.http.url)

    def stop(self) -> None:
        self._serving.clear()
        if self.http is not None:
            self.http.stop()
