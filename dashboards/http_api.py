"""The HTTP API both services serve (FastAPI, run by uvicorn on a thread of the daemon).

A tier manager serves its node's figures and a cluster view; the scheduler serves the
cluster view over every registered node. Both serve the same dashboard.

Routes:
  /metrics                     Prometheus text format (every tierstack_* metric of the node)
  /healthz                     200 while the daemon serves, 503 while it shuts down
  /api/v1/node                 this node's snapshot: links, tiers, queues, stall, plan, workers
  /api/v1/node/history         its bandwidth and occupancy samples over ?window_seconds=
  /api/v1/plan                 the plan the node runs
  /api/v1/cluster              every node's snapshot and the totals (see cluster_view.py)
  /api/v1/cluster/history      each node's history and the summed cluster history
  /dashboard/                  the web dashboard (dashboards/web), drawn from the routes above
  /openapi.json                the schema FastAPI generates from these routes

Who may call (the rules of tierstack/rpc.py, applied to HTTP by `HttpGuard`): every
request's Host header must name this server (an allow-list: a web page elsewhere cannot
reach a loopback port by DNS rebinding); a server beyond loopback serves TLS only and
every request carries the token (`Authorization: Bearer`, or the cookie a browser gets by
opening any page once with `?token=`). Refused requests are logged.
"""

from __future__ import annotations

import importlib.resources
import socket
import threading
import time
from typing import Callable, Protocol

from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from tierstack.dashboards.cluster_view import ClusterView
from tierstack.dashboards.snapshots import (ClusterHistory, ClusterSnapshot, History, NodeSnapshot,
                                            PlanFigures)
from tierstack.dashboards.http_listen import HEALTH_PATH, HttpGuard, bind_listener, listener_url

MAX_WINDOW_SECONDS = 24 * 3600.0


class NodeFigures(Protocol):
    """What a tier manager's metrics give its HTTP API (its NodeMetrics)."""

    node: str
    prometheus: CollectorRegistry

    def snapshot(self) -> NodeSnapshot: ...

    def history(self, window_seconds: float) -> History: ...

    def plan(self) -> PlanFigures: ...


def dashboard_dir() -> str:
    """The static dashboard's directory (installed with the package)."""
    return str(importlib.resources.files("tierstack.dashboards") / "web")


def create_app(cluster: ClusterView, serving: Callable[[], bool], node: NodeFigures | None = None,
               registry: CollectorRegistry | None = None, name: str = "",
               guard: HttpGuard | None = None) -> FastAPI:
    """The FastAPI app of one process: its /metrics, the cluster view, the dashboard.

    A tier manager passes its `node` (whose collector /metrics serves) and gets the
    /api/v1/node routes too. The scheduler passes no node, its own Prometheus `registry`,
    and a ClusterView over its node list: the same dashboard then shows its cluster.
    """
    app = FastAPI(title="tierstack node" if node is not None else "tierstack cluster",
                  version="1", description="Tier metrics of tierstack nodes and their cluster.")
    window = Query(300.0, gt=0, le=MAX_WINDOW_SECONDS, description="seconds of history")
    registry = registry if registry is not None else node.prometheus if node is not None else None
    name = name or (node.node if node is not None else "cluster")
    if guard is not None:
        @app.middleware("http")
        async def guarded(request: Request, call_next):
            refused = guard.check(request)
            return refused if refused is not None else await call_next(request)

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    def metrics() -> Response:
        body = generate_latest(registry) if registry is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get(HEALTH_PATH, summary="Liveness of the service")
    def healthz() -> JSONResponse:
        ok = serving()
        return JSONResponse({"status": "serving" if ok else "stopping", "node": name},
                            status_code=200 if ok else 503)

    @app.get("/api/v1/cluster", response_model=ClusterSnapshot,
             summary="Every node's figures and the cluster totals")
    def cluster_snapshot() -> ClusterSnapshot:
        return cluster.snapshot()

    @app.get("/api/v1/cluster/history", response_model=ClusterHistory,
             summary="Each node's history and the cluster total over a window")
    def cluster_history(window_seconds: float = window) -> ClusterHistory:
        return cluster.history(window_seconds)

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/dashboard/")

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> RedirectResponse:  # browsers ask for it on every page, the JSON ones too
        return RedirectResponse("/dashboard/favicon.svg")

    app.mount("/dashboard", StaticFiles(directory=dashboard_dir(), html=True), name="dashboard")
    if node is not None:
        add_node_routes(app, node, window)
    return app


def add_node_routes(app: FastAPI, node: NodeFigures, window) -> None:
    """/api/v1/node, its history and /api/v1/plan: one tier manager's own figures."""

    @app.get("/api/v1/node", response_model=NodeSnapshot, summary="This node's figures now")
    def node_snapshot() -> NodeSnapshot:
        return node.snapshot()

    @app.get("/api/v1/node/history", response_model=History,
             summary="This node's bandwidth and occupancy over a window")
    def node_history(window_seconds: float = window) -> History:
        return node.history(window_seconds)

    @app.get("/api/v1/plan", response_model=PlanFigures, summary="The plan this node runs")
    def plan() -> PlanFigures:
        return node.plan()


class HttpServer:
    """uvicorn serving an app on its own thread (its own event loop), stopped on request;
    over TLS when `tls` names a certificate and key file."""

    def __init__(self, app: FastAPI, listen: str = "", setting: str = "",
                 tls: tuple[str, str] | None = None, sock: socket.socket | None = None) -> None:
        """Serves on `sock` (bound by BackgroundHttp) or binds `listen` (host:port, from
        config key `setting`)."""
        import uvicorn

        self._sock = sock if sock is not None else bind_listener(listen, setting)
        self.url = listener_url(self._sock, tls is not None)
        ssl = {"ssl_certfile": tls[0], "ssl_keyfile": tls[1]} if tls else {}
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", **ssl)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="tierstack-http", daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        # uvicorn sets `started` once it accepts connections.
        for _ in range(int(timeout / 0.01)):
            if self._server.started or not self._thread.is_alive():
                break
            time.sleep(0.01)
        if not self._server.started:
            raise RuntimeError(f"the HTTP server on {self.url} did not start")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
