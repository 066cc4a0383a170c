"""How an HTTP API listens, without the web framework: who may call (`HttpGuard`,
`http_security`) and its socket (`bind_listener`, `listener_url`).

Apart from http_api.py so that a service can check its HTTP settings (a bad one is an
error at start) and bind its port before it serves gRPC, while FastAPI and uvicorn,
about a second of imports, load on a thread (`BackgroundHttp`): the port accepts from
the start, connections wait in its backlog until the app serves them.
"""

from __future__ import annotations

import errno
import fcntl
import hmac
import logging
import socket
import struct
import threading
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from tierstack.config import SecurityConfig
from tierstack.errors import ConfigError, InvalidArgumentError
from tierstack.rpc import RefusalLog, is_loopback, load_credentials, missing_for_network, resolved_security

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

log = logging.getLogger(__name__)

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
        from starlette.responses import PlainTextResponse, RedirectResponse

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


def http_framework_installed() -> bool:
    """Whether FastAPI and uvicorn can be imported (without importing them)."""
    from importlib.util import find_spec

    return find_spec("fastapi") is not None and find_spec("uvicorn") is not None


class BackgroundHttp:
    """An HTTP server whose port is bound now and whose app is built and served on a
    thread: `url` is known at once, and the service it belongs to serves gRPC without
    waiting for the web framework's imports. A failure there is logged and closes the
    port (a connection is then refused, not left waiting)."""

    def __init__(self, listen: str, setting: str, rules: HttpSecurity,
                 make_app: Callable[[], object], what: str) -> None:
        self.sock = bind_listener(listen, setting)
        self.url = listener_url(self.sock, rules.tls is not None)
        self.what = what
        self._tls = rules.tls
        self._make_app = make_app
        self._server = None
        self._stopping = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="tierstack-http-start", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _serve(self) -> None:
        try:
            from tierstack.dashboards.http_api import HttpServer

            server = HttpServer(self._make_app(), sock=self.sock, tls=self._tls)
        except Exception:  # noqa: BLE001 - the service goes on without its HTTP API; say so
            log.exception("the %s on %s could not start; the service goes on without it",
                          self.what, self.url)
            self.sock.close()
            return
        with self._lock:
            if self._stopping:
                self.sock.close()
                return
            self._server = server
        try:
            server.start()
        except RuntimeError:
            log.exception("the %s on %s did not start", self.what, self.url)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            server = self._server
        if server is None:
            self._thread.join(timeout=30)  # building the app: it sees _stopping and closes
            with self._lock:
                server = self._server
        if server is not None:
            server.stop()
        else:
            self.sock.close()
