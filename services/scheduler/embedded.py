"""An embedded scheduler: `tierstack scheduler` started for one machine's jobs.

Part of the scheduler's face: it starts the daemon as a process and imports none of its
code.
"""

from __future__ import annotations

from tierstack.config import SchedulerConfig, config_dict
from tierstack.service_process import ServiceProcess


class EmbeddedScheduler(ServiceProcess):
    """The scheduler on a private unix socket (unless `listen` says otherwise); stopped
    and its private directory removed on exit."""

    def __init__(self, config: SchedulerConfig | None = None, **options) -> None:
        options.setdefault("stop_timeout", 30.0)
        options.setdefault("startup_timeout", 60.0)
        super().__init__("scheduler", "scheduler", config_dict(config or SchedulerConfig()),
                         **options)
