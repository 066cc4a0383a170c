"""gRPC plumbing the services share: project errors become statuses in a servicer,
statuses become project errors in a client, a daemon's server listens on its address
with health checks (`ServiceEndpoint`), and a daemon serves until SIGTERM.

One place for each, so the tier manager and the scheduler (and their clients) map
errors, retry, listen, authenticate and shut down the same way.

Who may call (the one mechanism; dashboards/http_api.py applies the same rules to HTTP):
- a unix socket: anyone who can connect, which is only our user (a 0600 socket in a
  0700 directory we own, checked by the server and by its clients);
- TCP on a loopback address: TLS and the token (other local users can connect to
  loopback, and could take the port while the daemon is down); where none are
  configured, the per-user ones in /tmp/tierstack-<uid>, made by the first server, so
  that loopback needs no set-up from the user and nothing from other users works;
- TCP beyond loopback: TLS and the token, both required, or the server does not start.
The token travels as `authorization: Bearer <token>` metadata. A call without it, or
with another, is answered UNAUTHENTICATED and logged. Health checks need no token (they
say SERVING or not, nothing more), so load balancers and `ServiceProcess` can ask.

Every request is decoded here, not by gRPC: a message that does not parse is answered
INVALID_ARGUMENT naming the method (gRPC itself would answer INTERNAL).

A call that cannot be served now for a reason that passes by itself (a pin another client
holds, a job being deleted, the daemon's threads for long calls all busy) is never made
to wait in its handler thread: it is answered at once UNAVAILABLE with gRPC's own retry
hint, the trailer `grpc-retry-pushback-ms` (`RetryLaterError`), having changed nothing.
`RpcClient` sends such a call again after that pause, growing it, until its deadline.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import ipaddress
import logging
import os
import random
import secrets
import shutil
import signal
import socket
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tierstack.addresses import (SECURITY_DIR_ENV, default_token_path, grpc_target, unix_socket_path,
                                 unix_socket_unserved)
from tierstack.config import SecurityConfig
from tierstack.errors import (ERRORS_BY_STATUS, ConfigError, InvalidArgumentError, PoolExhaustedError,
                              RetryLaterError,
                              TierstackError, UnsafePathError)
from tierstack.private_paths import ensure_private_dir

log = logging.getLogger(__name__)

RETRY_PUSHBACK = "grpc-retry-pushback-ms"
"""The trailer of a `RetryLaterError`: milliseconds to wait before sending the call again
(the name gRPC's own retry policy reads)."""
RETRY_PAUSE_CAP = 0.1
"""The longest pause between two tries of a call refused with a retry hint: the hint
doubles per try up to this, so a pin held for minutes costs a few tries a second."""


def retry_hint(e: grpc.RpcError) -> float | None:
    """Seconds to wait before retrying a call refused with a `RetryLaterError`, else None."""
    if e.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    for key, value in e.trailing_metadata() or ():
        if key == RETRY_PUSHBACK:
            try:
                return max(0.0, int(value) / 1000)
            except ValueError:
                return None
    return None


HEALTH_PREFIX = "/grpc.health.v1.Health/"
HEALTH_CHECK = HEALTH_PREFIX + "Check"


# ---- servicer side: errors -> statuses ------------------------------------------------------

def rpc_method(method):
    """Run an RPC body, turning project errors into gRPC statuses (message unchanged: it
    already says what to do); anything else is a bug, logged, and the service stays up."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as e:  # noqa: BLE001 - _abort_with tells errors from bugs
            _abort_with(context, method.__name__, e)

    return wrapper


def _abort_with(context, method: str, e: Exception) -> None:
    """End a call with a project error's status, or INTERNAL for anything else (a bug:
    logged with its traceback; the service stays up)."""
    if isinstance(e, RetryLaterError):
        context.set_trailing_metadata(((RETRY_PUSHBACK, str(max(1, round(e.retry_after * 1000)))),))
    if isinstance(e, TierstackError):
        context.abort(getattr(grpc.StatusCode, e.grpc_status), str(e))
    log.exception("%s failed", method)
    context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")


def rpc_stream(method):
    """`rpc_method` for a server-streaming RPC (a generator): an error raised while it
    streams ends the stream with its status, not UNKNOWN."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            yield from method(self, request, context)
        except Exception as e:  # noqa: BLE001 - _abort_with tells errors from bugs
            _abort_with(context, method.__name__, e)

    return wrapper


class StreamSlots:
    """Caps a server's open streams, and ends them promptly.

    A sync gRPC server runs every call, streams included, on one of its fixed threads; a
    stream holds its thread for as long as it is open. Capped below the thread count, the
    streams always leave threads for unary calls (32 open WatchStats once starved every
    GetNode and Fetch). Each stream waits on its own event, set by gRPC when the call
    ends (client gone, cancelled, deadline) and by `close_all` when the daemon stops, so
    a disconnect frees its thread at once, not after the stream's interval.
    """

    def __init__(self, limit: int, service: str) -> None:
        self.limit = limit
        self.service = service
        self._lock = threading.Lock()
        self._open: set[threading.Event] = set()
        self._closed = False

    @contextlib.contextmanager
    def open(self, context) -> Iterator[threading.Event]:
        """A slot for one stream; yields the event that says it should end."""
        ended = threading.Event()
        with self._lock:
            if len(self._open) >= self.limit:
                raise PoolExhaustedError(
                    f"{len(self._open)} streams are open on this {self.service}, its limit (the "
                    f"rest of its threads serve ordinary calls); close watchers you no longer read")
            self._open.add(ended)
            if self._closed:
                ended.set()
        if not context.add_callback(ended.set):  # the call ended already
            ended.set()
        try:
            yield ended
        finally:
            with self._lock:
                self._open.discard(ended)

    @property
    def in_use(self) -> int:
        return len(self._open)

    def close_all(self) -> None:
        """End every stream now and every stream opened from now on (the daemon stops)."""
        with self._lock:
            self._closed = True
            for ended in self._open:
                ended.set()


def checked_interval(seconds: float, name: str, at_least: float = 0.05,
                     at_most: float = 3600.0, default: float = 1.0) -> float:
    """A client-given interval in seconds: 0 means `default`; NaN, infinite, negative or
    beyond `at_most` is INVALID_ARGUMENT (a huge one overflowed time_t in a wait)."""
    if seconds == 0:
        return default
    if not at_least <= seconds <= at_most:  # also false for NaN
        raise InvalidArgumentError(f"{name} must be between {at_least} and {at_most} seconds "
                                   f"(0 for {default}), got {seconds}")
    return float(seconds)


# ---- credentials ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Credentials:
    """What one process presents or demands: the token, and TLS material."""

    token: str = ""
    cert_chain: bytes = b""  # a server's certificate chain (PEM)
    private_key: bytes = b""
    root_certs: bytes = b""  # what a client trusts (PEM)
    server_name: str = "tierstack"

    @property
    def tls_server(self) -> bool:
        return bool(self.cert_chain and self.private_key)

    @property
    def tls_client(self) -> bool:
        return bool(self.root_certs)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata a client sends (empty without a token)."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


def read_secret(path: str | os.PathLike, what: str, setting: str) -> bytes:
    """A token or key file: it must exist and be readable by its owner only."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist; fix {setting}") from None
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror}; fix {setting}") from None
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise UnsafePathError(f"{what} {path} is readable by other users (mode "
                              f"{stat.S_IMODE(st.st_mode):04o}); chmod 600 {path}")
    return data


def _read_public(path: str, what: str, setting: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror}; fix {setting}") from None


SECRET_FILES = {"token_file": "token", "cert_file": "cert.pem", "key_file": "key.pem",
                "ca_file": "ca.pem"}
"""The files of a security directory ($TIERSTACK_SECURITY_DIR, `ray-node --make-secrets`)."""


def security_from_dir(directory: str | os.PathLike, base: SecurityConfig | None = None) -> SecurityConfig:
    """`base`'s fields, the empty ones filled from the files present in `directory`."""
    base = base or SecurityConfig()
    fields = {}
    for name, file in SECRET_FILES.items():
        path = Path(directory) / file
        fields[name] = getattr(base, name) or (str(path) if path.exists() else "")
    return SecurityConfig(server_name=base.server_name, **fields)


def resolved_security(security: SecurityConfig | None) -> SecurityConfig:
    """The config's fields, empty ones filled from $TIERSTACK_SECURITY_DIR."""
    directory = os.environ.get(SECURITY_DIR_ENV, "")
    if not directory:
        return security or SecurityConfig()
    return security_from_dir(directory, security)


def load_credentials(security: SecurityConfig | None) -> Credentials:
    """The configured token and TLS files, read and checked (no defaults added)."""
    s = resolved_security(security)
    token = b""
    if s.token_file:
        token = read_secret(s.token_file, "token file", "security.token_file").strip()
        if not token:
            raise ConfigError(f"token file {s.token_file} is empty; put the cluster's token in it")
    cert = _read_public(s.cert_file, "certificate", "security.cert_file") if s.cert_file else b""
    key = read_secret(s.key_file, "private key", "security.key_file") if s.key_file else b""
    ca_file = s.ca_file or s.cert_file
    ca = _read_public(ca_file, "CA certificate", "security.ca_file") if ca_file else b""
    return Credentials(token.decode(errors="strict"), cert, key, ca, s.server_name)


def _place(path: Path, data: bytes) -> bool:
    """Write a 0600 file atomically: aside first, then linked into place. False when another
    process made one meanwhile: theirs is kept and ours dropped."""
    aside = path.with_name(f".{path.name}-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(aside, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(aside)


def write_secrets(directory: str | os.PathLike, server_name: str = "tierstack",
                  hosts: tuple[str, ...] = ()) -> Path:
    """A security directory (SECRET_FILES) in `directory`, created 0700 if missing: a random
    token, and a self-signed certificate (EC P-256, ten years) for `server_name` and `hosts`
    with its key; ca.pem is the certificate itself (clients trust exactly it). Files that
    exist are kept (every node of a cluster must hold the same ones)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory = ensure_private_dir(directory, "the security directory", f"${SECURITY_DIR_ENV}")
    if not (directory / "token").exists():
        _place(directory / "token", secrets.token_urlsafe(32).encode())
    if not (directory / "cert.pem").exists():
        import datetime

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, server_name)])
        alt = [x509.DNSName(server_name)]
        for host in hosts:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                alt.append(x509.DNSName(host))
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=3650))
                .add_extension(x509.SubjectAlternativeName(alt), critical=False)
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(key, hashes.SHA256()))
        # The key decides: two servers starting at once each make a pair, and only the one
        # whose key landed writes its certificate; the other waits for that certificate.
        if _place(directory / "key.pem", key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption())):
            pem = cert.public_bytes(serialization.Encoding.PEM)
            _place(directory / "ca.pem", pem)
            _place(directory / "cert.pem", pem)  # last: its presence says the set is whole
        else:
            deadline = time.monotonic() + 10
            while not (directory / "cert.pem").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
    return directory


def default_security(create: bool) -> SecurityConfig:
    """The per-user security of loopback TCP, in /tmp/tierstack-<uid> (a directory only we
    can enter): a token, and a certificate clients check the server by, so that a token is
    never sent to a process of another user that took the port. A server creates them when
    missing; a client uses them if they are there."""
    directory = default_token_path().parent
    if create:
        write_secrets(directory, hosts=("127.0.0.1", "::1", "localhost"))
    elif not (directory / "token").exists():
        return SecurityConfig()
    return security_from_dir(directory)


def target_host(target: str) -> str:
    """The host of a TCP target (`host:port`, `ipv4:...`, `dns:///host:port`, `[::1]:port`)."""
    address = target
    for prefix in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if address.startswith(prefix):
            address = address[len(prefix):]
            break
    address = address.split(",", 1)[0]
    if address.startswith("["):
        return address[1:address.index("]")]
    host, _, port = address.rpartition(":")
    return host if port.isdigit() else address


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback only (not a wildcard, not a hostname
    that might resolve elsewhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _with_defaults(creds: Credentials, defaults: SecurityConfig) -> Credentials:
    """`creds` with what it lacks taken from the per-user security (token, certificate)."""
    mine = load_credentials(defaults)
    if creds.token and creds.tls_server:
        return creds
    return Credentials(creds.token or mine.token,
                       creds.cert_chain if creds.tls_server else mine.cert_chain,
                       creds.private_key if creds.tls_server else mine.private_key,
                       creds.root_certs or mine.root_certs,
                       creds.server_name if creds.tls_server else mine.server_name)


def server_credentials(target: str, security: SecurityConfig | None, what: str) -> Credentials:
    """What a server on TCP `target` demands: see the module docstring for the rules."""
    creds = load_credentials(security)
    host = target_host(target)
    if is_loopback(host):
        return _with_defaults(creds, default_security(create=True))
    missing = missing_for_network(creds)
    if missing:
        raise ConfigError(
            f"{what} would listen on {target}, beyond loopback, without TLS and a token "
            f"(missing {', '.join(missing)}); set them (or ${SECURITY_DIR_ENV}; "
            f"`tierstack ray-node --make-secrets DIR` writes a set), or listen on a unix socket "
            f"or 127.0.0.1")
    return creds


def missing_for_network(creds: Credentials) -> list[str]:
    """The settings a server beyond loopback needs and `creds` lacks (TLS pair, token)."""
    return [name for name, have in (("security.cert_file", creds.cert_chain),
                                    ("security.key_file", creds.private_key),
                                    ("security.token_file", creds.token)) if not have]


def client_credentials(target: str, security: SecurityConfig | None) -> Credentials:
    """What a client of TCP `target` presents: the configured token and CA; on loopback,
    the per-user ones where none are configured (see `default_security`)."""
    creds = load_credentials(security)
    if is_loopback(target_host(target)) and not (creds.token and creds.tls_client):
        mine = load_credentials(default_security(create=False))
        creds = Credentials(creds.token or mine.token, creds.cert_chain, creds.private_key,
                            creds.root_certs or mine.root_certs,
                            creds.server_name if creds.tls_client else mine.server_name)
    return creds


def check_socket_dir(path: Path) -> bool:
    """A client's check of a unix socket's directory before it talks to whatever listens
    there: owned by us or root and writable by nobody else, so nobody else could have put
    their socket in it. False while the directory does not exist yet."""
    try:
        st = os.stat(path.parent)
    except FileNotFoundError:
        return False
    if st.st_uid not in (os.getuid(), 0) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafePathError(
            f"the socket directory {path.parent} (owner uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}) is not ours alone: another user could have "
            f"put their socket there; remove it and restart the daemon")
    return True


def open_channel(target: str, options: list, security: SecurityConfig | None = None
                 ) -> tuple[grpc.Channel, Credentials]:
    """A client channel to `target` by the rules above, and the credentials whose
    `metadata()` every call must carry."""
    if unix_socket_path(target) is not None or target.startswith("unix-abstract:"):
        return grpc.insecure_channel(target, options=options), Credentials()
    creds = client_credentials(target, security)
    if creds.tls_client:
        channel = grpc.secure_channel(
            target, grpc.ssl_channel_credentials(root_certificates=creds.root_certs),
            options=options + [("grpc.ssl_target_name_override", creds.server_name)])
    else:
        channel = grpc.insecure_channel(target, options=options)
    return channel, creds


# ---- server side: the guard every call passes -------------------------------------------------

class RefusalLog:
    """Logs refused calls: every one up to `burst` a minute, then one line a minute with
    the count, so that a flood of bad calls cannot fill the disk with log."""

    def __init__(self, burst: int = 20) -> None:
        self.burst = burst
        self._lock = threading.Lock()
        self._window = 0.0
        self._count = 0
        self.total = 0

    def refused(self, what: str, method: str, peer: str, why: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.total += 1
            if now - self._window >= 60:
                if self._count > self.burst:
                    log.warning("%s: %d more calls refused in the last minute", what,
                                self._count - self.burst)
                self._window, self._count = now, 0
            self._count += 1
            loud = self._count <= self.burst
        if loud:
            log.warning("%s refused %s from %s: %s", what, method, peer or "?", why)


class ServerGuard(grpc.ServerInterceptor):
    """First on every call: checks the token (when the server demands one) and decodes the
    request itself, so that a malformed message is INVALID_ARGUMENT, not INTERNAL."""

    def __init__(self, what: str, token: str = "") -> None:
        self.what = what
        self._expected = f"Bearer {token}".encode() if token else b""
        self._handlers: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        self.refusals = RefusalLog()

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        pair = self._handlers.get(method)
        if pair is None:
            handler = continuation(handler_call_details)
            if handler is None or handler.request_streaming:
                return handler  # unknown method: gRPC answers UNIMPLEMENTED
            if method.startswith(HEALTH_PREFIX) and method != HEALTH_CHECK:
                # Only Check is served: Watch would hold a server thread as long as it is
                # open, List is not implemented by grpc's servicer (it raises).
                unserved = _aborting(handler, grpc.StatusCode.UNIMPLEMENTED,
                                     f"{self.what} answers the health Check only")
                pair = (unserved, unserved)
            else:
                pair = (_decoding(method, handler), self._refusing(method, handler))
            self._handlers[method] = pair
        if not self._expected or method.startswith(HEALTH_PREFIX):
            return pair[0]
        sent = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                sent = value.encode() if isinstance(value, str) else value
        if hmac.compare_digest(sent, self._expected):
            return pair[0]
        return pair[1]

    def _refusing(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        def refuse(request, context):
            why = "no token" if not _has_auth(context) else "a wrong token"
            self.refusals.refused(self.what, method, context.peer(), why)
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"{self.what} requires its token on every call and this call carried "
                          f"{why}; set security.token_file (or ${SECURITY_DIR_ENV}) to the "
                          f"cluster's token")

        return _of_kind(handler, refuse)


def _of_kind(handler: grpc.RpcMethodHandler, body) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind (unary or server-streaming) running `body`, which
    aborts the call; requests are not decoded."""
    if handler.response_streaming:
        def stream(request, context):
            body(request, context)
            yield  # pragma: no cover - body aborts
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(body)


def _aborting(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str):
    def abort(request, context):
        context.abort(code, message)
    return _of_kind(handler, abort)


def _has_auth(context) -> bool:
    return any(key == "authorization" for key, _ in context.invocation_metadata() or ())


def _decoding(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` taking raw bytes and decoding them itself."""
    deserialize = handler.request_deserializer

    def decode(raw: bytes, context):
        if deserialize is None:
            return raw
        try:
            return deserialize(raw)
        except Exception as e:  # noqa: BLE001 - any parse failure is the caller's
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"the request to {method} is not a valid message ({type(e).__name__}: "
                          f"{str(e)[:200]}); send the message its .proto file defines")

    if handler.response_streaming:
        inner_stream = handler.unary_stream

        def stream(raw, context):
            return inner_stream(decode(raw, context), context)
        return grpc.unary_stream_rpc_method_handler(
            stream, response_serializer=handler.response_serializer)
    inner = handler.unary_unary

    def unary(raw, context):
        return inner(decode(raw, context), context)
    return grpc.unary_unary_rpc_method_handler(unary, response_serializer=handler.response_serializer)


# ---- client side ------------------------------------------------------------------------------

class RpcClient:
    """A channel to one service whose calls wait for it to be ready (a restart is a pause,
    not an error), send idempotent calls again after a dropped connection, carry the
    service's token, and raise the project's exceptions."""

    service = "service"  # how messages name it
    command = ""  # the command that runs it
    unavailable: type[TierstackError] = TierstackError
    idempotent: frozenset[str] = frozenset()
    retry_seconds = 0.05  # pause before sending an idempotent call again

    def __init__(self, target: str, stub: Callable, timeout: float, options: list,
                 security: SecurityConfig | None = None) -> None:
        self.target = target
        self.timeout = timeout
        self._socket = unix_socket_path(target)
        self._socket_checked = self._socket is None
        self._channel, self.credentials = open_channel(target, options, security)
        self.metadata = self.credentials.metadata()
        self._stub = stub(self._channel)

    def check_endpoint(self) -> None:
        """Before the first call over a unix socket: its directory is ours alone."""
        if not self._socket_checked:
            self._socket_checked = check_socket_dir(self._socket)

    def why_not_listening(self, within: float) -> str:
        """Why no service could take calls at the target now, '' when one listens there.

        A call waits up to its timeout for a service that restarts; a command that only
        asks (`tierstack jobs`) should not wait that long for one that was never started.
        A unix socket is answered at once, no RPC sent (`unix_socket_unserved`); a TCP
        target gets `within` seconds to connect."""
        if self._socket is not None:
            unserved = unix_socket_unserved(self._socket, within)
            if not unserved:
                self.check_endpoint()
            return unserved
        try:
            grpc.channel_ready_future(self._channel).result(timeout=within)
        except grpc.FutureTimeoutError:
            tls = ("or it serves TLS and this client has no CA for it: set security.ca_file or "
                   f"${SECURITY_DIR_ENV}" if not self.credentials.tls_client else
                   "or its TLS certificate is not one this client's CA signed")
            return f"nothing answered within {within:g} s, {tls}"
        return ""

    def call(self, method: str, request, timeout: float | None = None):
        """Invoke an RPC; waits for a restarting service; raises project exceptions."""
        self.check_endpoint()
        start = time.monotonic()
        deadline = start + (timeout or self.timeout)
        tries = 0
        while True:
            try:
                return getattr(self._stub, method)(
                    request, timeout=max(0.1, deadline - time.monotonic()), wait_for_ready=True,
                    metadata=self.metadata)
            except grpc.RpcError as e:
                hint = retry_hint(e)
                if hint is not None:  # refused, nothing done: any call may be sent again
                    pause = min(max(hint, RETRY_PAUSE_CAP), hint * 2 ** min(tries, 16))
                    pause *= random.uniform(0.8, 1.2)  # callers refused together spread out
                    if time.monotonic() + pause >= deadline:
                        raise RetryLaterError(f"{e.details()} (still so after "
                                              f"{time.monotonic() - start:.1f} s of retries)") from None
                    time.sleep(pause)
                    tries += 1
                    continue
                dropped = e.code() == grpc.StatusCode.UNAVAILABLE
                if dropped and method in self.idempotent and time.monotonic() < deadline:
                    time.sleep(self.retry_seconds)
                    continue
                raise self._translate(method, e) from None

    def _translate(self, method: str, e: grpc.RpcError) -> TierstackError:
        code = e.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.CANCELLED):
            hint = ""
            if self._socket is None:
                hint = (" If it serves TLS, this client needs its CA (security.ca_file or "
                        f"${SECURITY_DIR_ENV})." if not self.credentials.tls_client else
                        " Check that it serves TLS with a certificate this client's CA signed.")
            return self.unavailable(
                f"{self.service} at {self.target} did not answer {method} ({code.name}: "
                f"{e.details()}); is `{self.command}` running there?{hint}")
        return ERRORS_BY_STATUS.get(code.name, TierstackError)(e.details())

    def close(self) -> None:
        self._channel.close()


# ---- the daemon's life ------------------------------------------------------------------------

PARENT_POLL_SECONDS = 1.0  # how soon a daemon notices that the process it serves is gone


def serve_until_signalled(daemon, banner: Callable[[], list[str]], stop_timeout: float = 90.0,
                          parent_pid: int | None = None, owned_dir: str | None = None) -> None:
    """Start `daemon`, print `banner()`'s lines, and stop it on SIGTERM or SIGINT, or,
    given `parent_pid`, once that process (the one that started it) is gone: a job
    killed with SIGKILL leaves no embedded daemon behind. `owned_dir`: the directory the
    starter made for this daemon alone (config, socket, log), removed after a stop
    because the starter is gone (a live starter removes it itself).

    A stop that takes longer than `stop_timeout` seconds (a request stuck in a bug) ends
    the process anyway, with a log line: a SIGTERM must always end the daemon, and what
    it leaves is what a crash leaves, which a restart recovers."""
    stop_requested = threading.Event()

    def on_signal(signum, frame):
        log.info("signal %d: shutting down", signum)
        stop_requested.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    daemon.start()
    for line in banner():
        print(line, flush=True)
    orphaned = False
    while not stop_requested.wait(PARENT_POLL_SECONDS if parent_pid else None):
        if os.getppid() != parent_pid:  # reparented: the starter exited without stopping us
            log.warning("the process that started this daemon (pid %d) is gone: shutting down",
                        parent_pid)
            orphaned = True
            break

    def force_exit() -> None:
        log.error("the daemon did not stop within %.0f s of the signal; exiting without the "
                  "rest of its clean-up (durable state is recovered at the next start)",
                  stop_timeout)
        logging.shutdown()
        os._exit(3)

    watchdog = threading.Timer(stop_timeout, force_exit)
    watchdog.daemon = True
    watchdog.start()
    daemon.stop()
    watchdog.cancel()
    if orphaned and owned_dir:
        shutil.rmtree(owned_dir, ignore_errors=True)


def clear_stale_socket(path: Path, what: str, env: str) -> None:
    """Remove a socket file left by a crashed daemon; refuse if a daemon still answers."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise UnsafePathError(f"{path} exists and is not a socket; remove it, or give {what} "
                              f"another address (--listen or ${env})")
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


class ServiceEndpoint:
    """A daemon's gRPC server on its address, with the standard health service and the
    guard (token, request decoding) in front of every call.

    A unix socket's directory is created private (0700) or must already be ours alone; the
    socket itself is 0600 (the workers run as the daemon's user). A socket left by a
    crashed daemon is removed, one a live daemon answers on is an error. On TCP the
    credentials follow the rules of the module docstring. Health reports SERVING between
    `start` and `stop`, for the whole server and for `service_name`.
    """

    def __init__(self, address: str, service_name: str, what: str, env: str,
                 security: SecurityConfig | None = None) -> None:
        """Claim the address: done first, before the daemon opens anything of its node."""
        self.target = grpc_target(address)
        self.service_name = service_name
        self.what = what
        self.socket_path = unix_socket_path(self.target)
        if self.socket_path is not None:
            ensure_private_dir(self.socket_path.parent, f"the socket directory of {what}",
                               f"--listen (or ${env})")
            clear_stale_socket(self.socket_path, what, env)
            self.credentials = Credentials()
        else:
            self.credentials = server_credentials(self.target, security, what)
        self.guard = ServerGuard(what, self.credentials.token)
        self.server: grpc.Server | None = None
        self.health = health.HealthServicer()

    def build_server(self, max_workers: int, thread_prefix: str,
                     interceptors: list | None = None) -> grpc.Server:
        """The gRPC server (health service added) for the daemon to add its servicers to."""
        executor = ThreadPoolExecutor(max_workers, thread_name_prefix=thread_prefix)
        _start_every_thread(executor, max_workers)
        # The guard first: later interceptors (the RPC timer) see only admitted calls.
        self.server = grpc.server(executor, options=[("grpc.so_reuseport", 0)],
                                  interceptors=[self.guard] + (interceptors or []))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        return self.server

    def bind(self) -> int:
        """Listen on the address (after the servicers are added); returns the port."""
        try:
            if self.credentials.tls_server:
                port = self.server.add_secure_port(self.target, grpc.ssl_server_credentials(
                    [(self.credentials.private_key, self.credentials.cert_chain)]))
            else:
                port = self.server.add_insecure_port(self.target)
        except RuntimeError:  # grpcio >= 1.5x raises instead of returning 0
            port = 0
        if port == 0:
            raise InvalidArgumentError(
                f"cannot listen on {self.target}: the address is in use or invalid; give "
                f"{self.what} another with --listen (unix:/path/to.sock or host:port)")
        if self.socket_path is not None:
            os.chmod(self.socket_path, 0o600)
        return port

    def start(self) -> None:
        self.server.start()
        self._set_health(health_pb2.HealthCheckResponse.SERVING)

    def stop_serving(self) -> None:
        """Health says NOT_SERVING: load balancers and waiting clients look elsewhere."""
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    def stop(self, grace: float) -> None:
        """Refuse new calls, let in-flight ones finish within `grace` s, remove the socket."""
        self.stop_serving()
        if self.server is not None:
            self.server.stop(grace=grace).wait()
        self.remove_socket()

    def remove_socket(self) -> None:
        if self.socket_path is not None and self.socket_path.exists():
            self.socket_path.unlink()

    def _set_health(self, status) -> None:
        for name in ("", self.service_name):
            self.health.set(name, status)


def _start_every_thread(executor: ThreadPoolExecutor, count: int) -> None:
    """Start all of an executor's threads now. A ThreadPoolExecutor adds a thread whenever a
    burst of calls finds none idle, so a daemon's thread count would creep up for hours of
    training; started at once, it is constant from the first request on."""
    barrier = threading.Barrier(count + 1)
    for _ in range(count):
        executor.submit(barrier.wait)
    barrier.wait()
