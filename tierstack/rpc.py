"""gRPC plumbing the services share: project errors become statuses in a servicer,
statuses become project errors in a client, and a daemon serves until SIGTERM.

One place for each, so the tier manager and the scheduler (and their clients) map
errors, retry and shut down the same way.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
import time
from typing import Callable

import grpc

from tierstack.errors import ERRORS_BY_STATUS, TierstackError

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
