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

import errno
import fcntl
import hmac
import importlib.resources
import logging
import socket
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Callable, Protocol

from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from tierstack.dashboards.cluster_view import ClusterView
from tierstack.dashboards.snapshots import (ClusterHistory, ClusterSnapshot, History, NodeSnapshot,
                                            PlanFigures)
from tierstack.config import SecurityConfig
from tierstack.errors import ConfigError, InvalidArgumentError
from tierstack.rpc import (RefusalLog, is_loopback, load_credentials, missing_for_network,
                           resolved_security)

log = logging.getLogger(__name__)

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


TOKEN_COOKIE = "tierstack_token"
HEALTH_PATH = "/healthz"


class HttpGuard:
    """Checks every request's Host header and, when the server demands one, its token."""

    def __init__(self, allowed_hosts: set[str], token: str = "", what: str = "HTTP API") -> None:
        self.allowed_hosts = {h.lower() for h in allowed_hosts}
        self._expected = token.encode()
        self.what = what
        self.refusals = RefusalLog()

    def check(self, request: Request) -> Response | None:
        """None to serve the request, else the response refusing it."""
        host = _host_name(request.headers.get("host", ""))
        if host not in self.allowed_hosts:
            self._refused(request, f"Host {host!r:.80} is not one of this server's names")
            return PlainTextResponse(
                f"this {self.what} does not serve the host {host!r:.80}; use its own address "
                f"(allowed: {', '.join(sorted(self.allowed_hosts))})", status_code=400)
        if not self._expected or request.url.path == HEALTH_PATH:
            return None
        sent = request.query_params.get("token") or request.cookies.get(TOKEN_COOKIE, "")
        auth = request.headers.get("authorization", "")
        if auth.startswith("Bearer "):
            sent = auth[len("Bearer "):]
        if hmac.compare_digest(sent.encode(), self._expected):
            if "token" in request.query_params:  # once, from a browser: keep it in a cookie
                query = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
                target = request.url.path + (f"?{urllib.parse.urlencode(query)}" if query else "")
                response = RedirectResponse(target, status_code=303)
                response.set_cookie(TOKEN_COOKIE, sent, httponly=True, secure=True, samesite="strict")
                return response
            return None
        self._refused(request, "no token" if not sent else "a wrong token")
        return PlainTextResponse(
            f"this {self.what} requires the cluster's token (Authorization: Bearer, or open "
            f"it once with ?token=); the request carried {'none' if not sent else 'a wrong one'}",
            status_code=401, headers={"WWW-Authenticate": "Bearer"})

    def _refused(self, request: Request, why: str) -> None:
        peer = f"{request.client.host}:{request.client.port}" if request.client else ""
        self.refusals.refused(self.what, f"{request.method} {request.url.path}", peer, why)


def _host_name(header: str) -> str:
    """The name of a Host header without its port ("[::1]:8470" -> "::1")."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    name, _, port = header.rpartition(":")
    return name if port.isdigit() and name else header


def local_addresses() -> set[str]:
    """This machine's names and the IPv4 addresses of its interfaces."""
    names = {socket.gethostname().lower(), socket.getfqdn().lower()}
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, interface in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's IPv4 address
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", interface.encode()[:15]))
                names.add(socket.inet_ntoa(packed[20:24]))
            except OSError:
                pass  # no IPv4 address on it
    finally:
        probe.close()
    try:
        names |= {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        pass
    return names


@dataclass
class HttpSecurity:
    """How one HTTP server listens: its guard, and its TLS files (None: plain HTTP)."""

    guard: HttpGuard
    tls: tuple[str, str] | None


def http_security(listen: str, security: SecurityConfig | None, setting: str,
                  allowed_hosts: list[str] | None = None, what: str = "HTTP API") -> HttpSecurity:
    """The rules for a server on host:port `listen`: on loopback, the Host allow-list only
    (TLS if a certificate is configured); beyond it, TLS and the token too, or ConfigError."""
    host = listen.rpartition(":")[0].strip("[]") or "127.0.0.1"
    loopback = is_loopback(host)
    creds = load_credentials(security)
    files = resolved_security(security)
    allowed = {"localhost", "127.0.0.1", "::1"} | set(allowed_hosts or ())
    if host not in ("0.0.0.0", "::"):
        allowed.add(host.lower())
    if not loopback:
        missing = missing_for_network(creds)
        if missing:
            raise ConfigError(
                f"{setting} {listen} serves HTTP beyond loopback, which needs TLS and the token "
                f"(missing {', '.join(missing)}); set them, or listen on 127.0.0.1")
        allowed |= local_addresses()
    tls = (files.cert_file, files.key_file) if files.cert_file and files.key_file else None
    return HttpSecurity(HttpGuard(allowed, "" if loopback else creds.token, what), tls)


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


def bind_listener(listen: str, setting: str) -> socket.socket:
    """A listening TCP socket on host:port; another free port if that one is taken.
    `setting` is the config key that gave `listen` (named in errors)."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        # With SO_REUSEADDR two services starting at once may both bind the port; the
        # second learns it is taken only at listen().
        sock.bind((host, int(port)))
        sock.listen(128)
    except OSError as e:
        sock.close()
        if e.errno != errno.EADDRINUSE:
            raise InvalidArgumentError(
                f"cannot serve HTTP on {listen}: {e.strerror}; set "
                f"{setting} to host:port (or '' for no HTTP)") from None
        log.warning("HTTP port %s is in use (another tierstack service?): serving metrics and "
                    "the dashboard on a free port instead; set %s", port, setting)
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind((host, 0))
        sock.listen(128)
    sock.setblocking(False)
    return sock


def listener_url(sock: socket.socket, tls: bool = False) -> str:
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", "::"):
        host = socket.gethostname()
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


class HttpServer:
    """uvicorn serving an app on its own thread (its own event loop), stopped on request;
    over TLS when `tls` names a certificate and key file."""

    def __init__(self, app: FastAPI, listen: str, setting: str,
                 tls: tuple[str, str] | None = None) -> None:
        import uvicorn

        self._sock = bind_listener(listen, setting)
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
