"""gRPC plumbing the services share: project errors become statuses in a servicer,
statuses become project errors in a client, a daemon's server listens on its address
with health checks (`ServiceEndpoint`), and a daemon serves until SIGTERM.

One place for each, so the tier manager and the scheduler (and their clients) map
errors, retry, listen and shut down the same way.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tierstack.addresses import grpc_target, unix_socket_path
from tierstack.errors import ERRORS_BY_STATUS, InvalidArgumentError, TierstackError

log = logging.getLogger(__name__)


def rpc_method(method):
    """Run an RPC body, turning project errors into gRPC statuses (message unchanged: it
    already says what to do); anything else is a bug, logged, and the service stays up."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except TierstackError as e:
            context.abort(getattr(grpc.StatusCode, e.grpc_status), str(e))
        except Exception as e:  # noqa: BLE001 - a bug: say so, keep the service up
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

    return wrapper


class RpcClient:
    """A channel to one service whose calls wait for it to be ready (a restart is a pause,
    not an error), send idempotent calls again after a dropped connection, and raise the
    project's exceptions."""

    service = "service"  # how messages name it
    command = ""  # the command that runs it
    unavailable: type[TierstackError] = TierstackError
    idempotent: frozenset[str] = frozenset()
    retry_seconds = 0.05  # pause before sending an idempotent call again

    def __init__(self, target: str, stub: Callable, timeout: float, options: list) -> None:
        self.target = target
        self.timeout = timeout
        self._channel = grpc.insecure_channel(target, options=options)
        self._stub = stub(self._channel)

    def call(self, method: str, request, timeout: float | None = None):
        """Invoke an RPC; waits for a restarting service; raises project exceptions."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            try:
                return getattr(self._stub, method)(
                    request, timeout=max(0.1, deadline - time.monotonic()), wait_for_ready=True)
            except grpc.RpcError as e:
                dropped = e.code() == grpc.StatusCode.UNAVAILABLE
                if dropped and method in self.idempotent and time.monotonic() < deadline:
                    time.sleep(self.retry_seconds)
                    continue
                raise self._translate(method, e) from None

    def _translate(self, method: str, e: grpc.RpcError) -> TierstackError:
        code = e.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.CANCELLED):
            return self.unavailable(
                f"{self.service} at {self.target} did not answer {method} ({code.name}: "
                f"{e.details()}); is `{self.command}` running there?")
        return ERRORS_BY_STATUS.get(code.name, TierstackError)(e.details())

    def close(self) -> None:
        self._channel.close()


def serve_until_signalled(daemon, banner: Callable[[], list[str]]) -> None:
    """Start `daemon`, print `banner()`'s lines, and stop it on SIGTERM or SIGINT."""
    stop_requested = threading.Event()

    def on_signal(signum, frame):
        log.info("signal %d: shutting down", signum)
        stop_requested.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    daemon.start()
    for line in banner():
        print(line, flush=True)
    stop_requested.wait()
    daemon.stop()


def clear_stale_socket(path: Path, what: str, env: str) -> None:
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


class ServiceEndpoint:
    """A daemon's gRPC server on its address, with the standard health service.

    A unix socket's directory is created private (0700) and the socket itself 0600 (the
    workers run as the daemon's user); a socket left by a crashed daemon is removed, one
    a live daemon answers on is an error. Health reports SERVING between `start` and
    `stop`, for the whole server and for `service_name`.
    """

    def __init__(self, address: str, service_name: str, what: str, env: str) -> None:
        """Claim the address: done first, before the daemon opens anything of its node."""
        self.target = grpc_target(address)
        self.service_name = service_name
        self.what = what
        self.socket_path = unix_socket_path(self.target)
        if self.socket_path is not None:
            self.socket_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            clear_stale_socket(self.socket_path, what, env)
        self.server: grpc.Server | None = None
        self.health = health.HealthServicer()

    def build_server(self, max_workers: int, thread_prefix: str,
                     interceptors: list | None = None) -> grpc.Server:
        """The gRPC server (health service added) for the daemon to add its servicers to."""
        executor = ThreadPoolExecutor(max_workers, thread_name_prefix=thread_prefix)
        _start_every_thread(executor, max_workers)
        self.server = grpc.server(executor, options=[("grpc.so_reuseport", 0)],
                                  interceptors=interceptors or [])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        return self.server

    def bind(self) -> int:
        """Listen on the address (after the servicers are added); returns the port."""
        try:
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
        self.server.stop(grace=grace).wait()
        if self.socket_path is not None and self.socket_path.exists():
            self.socket_path.unlink()

    def _set_health(self, status) -> None:
        for name in ("", self.service_name):
            self.health.set(name, status)


def _start_every_thread(executor: ThreadPoolExecutor, count: int) -> None:
    """Start all of an executor's threads now. A ThreadPoolExecutor adds a thread whenever a
    burst of calls finds none idle, so a daemon's thread count would creep up for hours of
    training; started at once, it is constant from the first request on."""
    import threading

    barrier = threading.Barrier(count + 1)
    for _ in range(count):
        executor.submit(barrier.wait)
    barrier.wait()
