"""An embedded tier manager: a daemon process started for one job on a single machine."""

from __future__ import annotations

from tierstack.config import TierManagerConfig, config_dict
from tierstack.embedded_service import EmbeddedService
from tierstack.worker.client import TierManagerClient


class EmbeddedTierManager(EmbeddedService):
    """Starts `tierstack tier-manager` on a private unix socket; stops it on exit."""

    name, command, section = "tier manager", "tier-manager", "tier_manager"

    def __init__(self, config: TierManagerConfig, startup_timeout: float = 120.0) -> None:
        super().__init__(startup_timeout)
        self.config = config

    def config_section(self) -> dict:
        tier_manager = config_dict(self.config)
        tier_manager["manifest_path"] = str(self.config.resolved_manifest_path())
        return tier_manager

    def wait_ready(self) -> None:
        client = TierManagerClient(self.address, reconnect_timeout=self.startup_timeout)
        try:
            client.node()
        finally:
            client.close()
