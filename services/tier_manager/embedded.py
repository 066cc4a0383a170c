"""An embedded tier manager: a daemon process started for one job on a single machine."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tierstack.config import TierManagerConfig, config_dict
from tierstack.worker.client import TierManagerClient


class EmbeddedTierManager:
    """Starts `tierstack tier-manager` on a private unix socket; stops it on exit."""

    def __init__(self, config: TierManagerConfig, startup_timeout: float = 120.0) -> None:
        self.config = config
        self.startup_timeout = startup_timeout
        self.workdir: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.address = ""

    def __enter__(self) -> "EmbeddedTierManager":
        self.workdir = Path(tempfile.mkdtemp(prefix="tierstack-embedded-"))
        config_path = self.workdir / "tier-manager.json"
        tier_manager = config_dict(self.config)
        tier_manager["manifest_path"] = str(self.config.resolved_manifest_path())
        config_path.write_text(json.dumps({"tier_manager": tier_manager}))
        self.address = f"unix:{self.workdir / 'tier-manager.sock'}"
        self.log_path = self.workdir / "tier-manager.log"
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierstack.cli", "tier-manager", "--config", str(config_path),
             "--listen", self.address], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=self.workdir)
        client = TierManagerClient(self.address, reconnect_timeout=self.startup_timeout)
        try:
            client.node()
        except Exception:
            self.__exit__(None, None, None)
            raise RuntimeError(f"the embedded tier manager did not start: "
                               f"{self.log_path.read_text()[-2000:]}") from None
        finally:
            client.close()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
