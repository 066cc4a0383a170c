"""An embedded scheduler: a `tierstack scheduler` process started for one machine's jobs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tierstack.config import SchedulerConfig, config_dict
from tierstack.services.scheduler.client import SchedulerClient


class EmbeddedScheduler:
    """Starts `tierstack scheduler` on a private unix socket; stops it on exit."""

    def __init__(self, config: SchedulerConfig | None = None, startup_timeout: float = 60.0) -> None:
        self.config = config or SchedulerConfig()
        self.startup_timeout = startup_timeout
        self.workdir: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.address = ""

    def __enter__(self) -> "EmbeddedScheduler":
        self.workdir = Path(tempfile.mkdtemp(prefix="tierstack-scheduler-"))
        config_path = self.workdir / "scheduler.json"
        config_path.write_text(json.dumps({"scheduler": config_dict(self.config)}))
        self.address = f"unix:{self.workdir / 'scheduler.sock'}"
        self.log_path = self.workdir / "scheduler.log"
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierstack.cli", "scheduler", "--config", str(config_path),
             "--listen", self.address], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=self.workdir)
        client = SchedulerClient(self.address, timeout=self.startup_timeout)
        try:
            client.list_nodes()
        except Exception:
            self.__exit__(None, None, None)
            raise RuntimeError(f"the embedded scheduler did not start: "
                               f"{self.log_path.read_text()[-2000:]}") from None
        finally:
            client.close()
        return self

    def log_text(self) -> str:
        return self.log_path.read_text() if self.workdir is not None else ""

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
