"""A tierstack service run as a child process for one machine's jobs (the embedded
single-node default): `tierstack <command>` on a private unix socket, with its config
section and log in a private directory, stopped and cleaned up on exit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Self


class EmbeddedService:
    """Starts `tierstack <command>`; `address` is its socket once `with` has entered."""

    name = "service"  # how messages name it
    command = ""  # the CLI subcommand, also the name of its files
    section = ""  # the config section the service reads
    stop_timeout = 60.0  # seconds a SIGTERM'ed service may take to finish in-flight work

    def __init__(self, startup_timeout: float) -> None:
        self.startup_timeout = startup_timeout
        self.workdir: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.address = ""

    def config_section(self) -> dict:
        """The service's config section, as `load_config` reads it."""
        raise NotImplementedError

    def wait_ready(self) -> None:
        """Return once the service at `address` answers (its client waits up to
        `startup_timeout`); raise if it does not."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.workdir = Path(tempfile.mkdtemp(prefix=f"tierstack-{self.command}-"))
        config_path = self.workdir / f"{self.command}.json"
        config_path.write_text(json.dumps({self.section: self.config_section()}))
        self.address = f"unix:{self.workdir / f'{self.command}.sock'}"
        self.log_path = self.workdir / f"{self.command}.log"
        with open(self.log_path, "w") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tierstack.cli", self.command, "--config", str(config_path),
                 "--listen", self.address], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, cwd=self.workdir)
        try:
            self.wait_ready()
        except Exception:
            log_tail = self.log_text()[-2000:]
            self.__exit__(None, None, None)
            raise RuntimeError(f"the embedded {self.name} did not start: {log_tail}") from None
        return self

    def log_text(self) -> str:
        return self.log_path.read_text() if self.workdir is not None else ""

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
