"""A tierstack service run as a child process: `tierstack <command> --config FILE --listen ADDR`.

The one way the project starts a daemon: the embedded single-node default of a job, a
Ray node's supervisor (deploy/ray_node.py), the benchmarks and the tests all use
`ServiceProcess`. The service's config section is written to a file in its working
directory, its output goes to a log there, and it is ready once it answers gRPC health
checks with SERVING (both services serve the standard health service). A private
working directory (the default) is removed on `close`; a given one is kept (a Ray node
keeps its logs).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Self

from tierstack.errors import TierstackError


class ServiceStartError(TierstackError):
    """A service process exited or did not serve within its start-up timeout."""

    grpc_status = "UNAVAILABLE"


class ServiceProcess:
    """`tierstack <command>` as a child process: start, stop (SIGTERM), kill, restart."""

    def __init__(self, command: str, section: str, config: dict, *, name: str = "",
                 listen: str = "", workdir: str | Path | None = None,
                 env: dict[str, str] | None = None, startup_timeout: float = 120.0,
                 stop_timeout: float = 60.0, security: dict | None = None,
                 args: list[str] | None = None) -> None:
        self.command = command  # the CLI subcommand, also the name of its files
        self.section = section  # the config section the service reads
        self.config = config
        self.name = name or command.replace("-", " ")  # how messages name it
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout  # a SIGTERM'ed service may finish in-flight work
        self.env = env
        self.security = security  # the config's security section (TLS, token), if any
        self.args = list(args or [])  # more command-line arguments (e.g. --recover)
        self._private = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(
            tempfile.mkdtemp(prefix=f"tierstack-{command}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.address = listen or f"unix:{self.workdir / f'{command}.sock'}"
        self.config_path = self.workdir / f"{command}.json"
        self.log_path = self.workdir / f"{command}.log"
        self.proc: subprocess.Popen | None = None

    # ---- life cycle ----------------------------------------------------------------------

    def start(self) -> Self:
        """Start the process and return once it serves; raise with its log if it does not."""
        self.spawn()
        self.wait_started()
        return self

    def spawn(self) -> None:
        """Start the process without waiting for it to serve (`wait_started` waits): two
        services started one after the other, then waited for, start side by side."""
        document = {self.section: self.config}
        if self.security:
            document["security"] = self.security
        self.config_path.write_text(json.dumps(document))
        with open(self.log_path, "a") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                # It dies with us: a job or supervisor killed with SIGKILL leaves no daemon.
                [sys.executable, "-m", "tierstack.cli", self.command, "--config",
                 str(self.config_path), "--listen", self.address,
                 "--exit-with-parent", str(os.getpid()),
                 # Its private directory goes with it when we die without removing it.
                 *(["--owned-dir", str(self.workdir)] if self._private else []), *self.args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.workdir,
                env=None if self.env is None else {**os.environ, **self.env},
                # Its own process group: a signal to ours (a batch scheduler's SIGTERM to a
                # job's group, Ctrl-C) reaches only us, and we stop it after our own end
                # (a job finishes its step and checkpoint on SIGTERM with its daemons up).
                start_new_session=True)

    def wait_started(self) -> None:
        """Wait until the spawned process serves; kill it and raise with its log if it
        does not within the start-up timeout."""
        try:
            self.wait_ready(self.startup_timeout)
        except BaseException:
            log_tail = self.log_text()[-3000:]
            self.kill()
            raise ServiceStartError(
                f"the {self.name} did not start (log {self.log_path}):\n{log_tail}") from None

    def _wait_listening(self, deadline: float) -> None:
        """Until something accepts connections at the service's address, its process
        exits, or `deadline` passes (then the health check below tells why)."""
        from tierstack.addresses import grpc_target, unix_socket_path, unix_socket_unserved

        target = grpc_target(self.address)
        path = unix_socket_path(target)
        host, _, port = target.rpartition(":")
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                return
            if path is not None:
                if not unix_socket_unserved(path, within=1.0):
                    return
            elif not port.isdigit() or target.startswith(("dns:", "ipv4:", "ipv6:", "unix-abstract:")):
                return  # a form only gRPC's resolver reads: the health check alone
            else:
                try:
                    socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=1.0).close()
                    return
                except OSError:
                    pass
            time.sleep(0.02)

    def wait_ready(self, timeout: float) -> None:
        """Wait until the service answers its health check with SERVING."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from tierstack.addresses import SECURITY_DIR_ENV
        from tierstack.config import SecurityConfig, section
        from tierstack.rpc import open_channel, security_from_dir

        deadline = time.monotonic() + timeout
        # Until the service listens, a health check's channel backs off for a second
        # between attempts (gRPC's reconnect backoff): half of a daemon's start-up was that
        # wait. Its socket is polled instead, then asked once.
        self._wait_listening(deadline)
        security = section(SecurityConfig, self.security, "security") if self.security else None
        if self.env and self.env.get(SECURITY_DIR_ENV):  # the child's, not ours
            security = security_from_dir(self.env[SECURITY_DIR_ENV], security)
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServiceStartError(f"the {self.name} exited with status {self.proc.returncode}")
            # A channel per attempt: on loopback TCP with nothing configured, the service
            # makes the per-user certificate as it starts, and a channel opened before
            # that speaks plain text to a TLS port for good (the first daemon on a fresh
            # machine then never looked ready).
            channel, _ = open_channel(self.address, [], security)  # health needs no token
            with channel:
                try:
                    status = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=1, wait_for_ready=True)
                    if status.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
            if time.monotonic() > deadline:
                raise ServiceStartError(f"the {self.name} did not serve within {timeout:.0f} s")
            time.sleep(0.05)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float | None = None) -> int:
        """SIGTERM (a graceful stop: in-flight work finishes), then SIGKILL after `timeout`
        seconds; returns the exit status."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=self.stop_timeout if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: a crash, no clean-up by the service."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        """Stop the service; remove a private working directory."""
        self.stop()
        if self._private:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
