"""An embedded tier manager: `tierstack tier-manager` started for one machine's jobs.

Part of the tier manager's face: it starts the daemon as a process and imports none of
its code.
"""

from __future__ import annotations

from tierstack.config import TierManagerConfig, config_dict
from tierstack.service_process import ServiceProcess


class EmbeddedTierManager(ServiceProcess):
    """The daemon on a private unix socket (unless `listen` says otherwise); stopped and
    its private directory removed on exit. `for_training`: a job's own daemon, which
    makes its AdamW as it starts (--preload-optimizer) so the first step does not wait."""

    def __init__(self, config: TierManagerConfig, *, for_training: bool = False, **options) -> None:
        if for_training:
            options["args"] = [*options.get("args", []), "--preload-optimizer"]
        section = config_dict(config)
        # Resolved here: the daemon's working directory is not the caller's.
        section["manifest_path"] = str(config.resolved_manifest_path())
        super().__init__("tier-manager", "tier_manager", section, name="tier manager", **options)
