"""An embedded scheduler: a `tierstack scheduler` process started for one machine's jobs."""

from __future__ import annotations

from tierstack.config import SchedulerConfig, config_dict
from tierstack.embedded_service import EmbeddedService
from tierstack.services.scheduler.client import SchedulerClient


class EmbeddedScheduler(EmbeddedService):
    """Starts `tierstack scheduler` on a private unix socket; stops it on exit."""

    name = command = section = "scheduler"
    stop_timeout = 30.0

    def __init__(self, config: SchedulerConfig | None = None, startup_timeout: float = 60.0) -> None:
        super().__init__(startup_timeout)
        self.config = config or SchedulerConfig()

    def config_section(self) -> dict:
        return config_dict(self.config)

    def wait_ready(self) -> None:
        client = SchedulerClient(self.address, timeout=self.startup_timeout)
        try:
            client.list_nodes()
        finally:
            client.close()
