"""The node's services a job uses: its tier manager, the scheduler, the job's NVMe directories.

Decided in one order for every door (worker/job.py calls `open_node_services`):

1. the tier manager: the one named (a door's argument or `tier_manager.listen`), which
   must answer; else the node's ($TIERSTACK_TIER_MANAGER or the per-user socket) when
   one answers; else one started for the job alone, its NVMe pool in a directory named
   after the job under each configured NVMe path (`tier_manager.nvme_pool.paths`: one
   default root for every door, /var/tmp/tierstack-<uid>/nvme), removed with the job;
2. the scheduler, unless the door asks for none: the one named (`scheduler.listen` or
   $TIERSTACK_SCHEDULER), which must answer; else, with the node's tier manager, the
   per-user scheduler when one answers there; else, with a tier manager started for the
   job, a scheduler started beside it (the tier manager registers with it). A node's
   tier manager without a scheduler means a job without plans, said once.

Whatever was started is stopped, and the directories removed, when the caller's
ExitStack closes. Both daemons start at once: each takes a second or two to serve.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
from dataclasses import dataclass
from enum import Enum

from tierstack.addresses import SCHEDULER_ENV, default_scheduler_address
from tierstack.config import TierManagerConfig, TierstackConfig
from tierstack.config_keys import UserKeys
from tierstack.errors import ConfigError
from tierstack.worker.node.daemon_address import check_reachable, check_scheduler, running_tier_manager
from tierstack.worker.node.run_directory import job_directories

log = logging.getLogger(__name__)


class SchedulerUse(Enum):
    """Whether a job follows a scheduler's plans."""

    AUTO = "auto"
    """The named or the node's scheduler when one answers; one started with embedded services."""
    OFF = "off"
    """No plans: the store keeps its configured prefetch depths."""


@dataclass(frozen=True)
class NodeServices:
    """What a job found or started on its node."""

    tier_manager: str
    """The tier manager's address."""
    scheduler: str
    """The scheduler's address ('' for none: the job follows no plans)."""
    node_id: str
    """The name the scheduler knows this node by (its plans for the node are under it)."""
    nvme_directories: tuple[str, ...] = ()
    """The job's own NVMe directories (a tier manager started for the job), removed after it."""
    started: bool = False
    """Whether the tier manager was started for this job."""

    def describe(self) -> str:
        where = (f"a tier manager started for the job (NVMe pool at {', '.join(self.nvme_directories)})"
                 if self.started else f"the tier manager at {self.tier_manager}")
        plans = f"plans from the scheduler at {self.scheduler}" if self.scheduler else "no scheduler"
        return f"{where}; {plans}"


def open_node_services(stack: contextlib.ExitStack, config: TierstackConfig, job: str, *,
                       tier_manager: str = "", tier_manager_setting: str = "tier_manager.listen",
                       scheduler: SchedulerUse = SchedulerUse.AUTO,
                       nvme_paths: list[str] | None = None,
                       nvme_setting: str = "--nvme-path",
                       cpu_pool_size: int | str | None = None,
                       keys: UserKeys = UserKeys()) -> NodeServices:
    """The job's services (module docstring); what is started stops when `stack` closes.
    `tier_manager`: an address the door was given ('' to look as above). `nvme_paths`,
    `cpu_pool_size`: a door's flags over the config's, for a tier manager started here
    (`nvme_setting`: how the user gave `nvme_paths`). `keys`: the config's keys as the user
    wrote them (a DeepSpeed JSON's nvme_path), for the errors."""
    named = tier_manager or config.tier_manager.listen
    if named:
        check_reachable(named, tier_manager_setting if tier_manager else keys.of("tier_manager.listen"))
        return NodeServices(named, _scheduler_for_node(config, scheduler), _node_id(config))
    running = running_tier_manager()
    if running is not None:
        log.info("using the node's tier manager at %s", running)
        return NodeServices(running, _scheduler_for_node(config, scheduler), _node_id(config))
    bases = list(nvme_paths or config.tier_manager.nvme_pool.paths)
    settings = ([nvme_setting] * len(bases) if nvme_paths else
                [keys.of_item("tier_manager.nvme_pool.paths", i) for i in range(len(bases))])
    return _start_for_job(stack, config, job, scheduler, bases, settings, cpu_pool_size)


def job_tier_manager_config(config: TierManagerConfig, directories: list[str],
                            cpu_pool_size: int | str | None = None) -> TierManagerConfig:
    """`config` for a tier manager of one job: its NVMe pool (and manifest, by default in
    the first) in the job's `directories`, the CPU pool's cap as a door's flag says."""
    cpu_pool = config.cpu_pool if cpu_pool_size is None else dataclasses.replace(
        config.cpu_pool, size=cpu_pool_size)
    return dataclasses.replace(
        config, cpu_pool=cpu_pool, manifest_path="",
        nvme_pool=dataclasses.replace(config.nvme_pool, paths=list(directories)))


def _start_for_job(stack: contextlib.ExitStack, config: TierstackConfig, job: str,
                   scheduler: SchedulerUse, bases: list[str], settings: list[str],
                   cpu_pool_size: int | str | None) -> NodeServices:
    """A tier manager (and a scheduler) started for the job, its NVMe pool in a directory
    under each of `bases`; `settings` names where each came from, for the error when a
    directory cannot be made."""
    from tierstack.services.scheduler.embedded import EmbeddedScheduler
    from tierstack.services.tier_manager.embedded import EmbeddedTierManager

    directories = stack.enter_context(job_directories(bases, job, settings))
    tm = job_tier_manager_config(config.tier_manager, directories, cpu_pool_size)
    node_id = tm.node_id or socket.gethostname()
    named = _named_scheduler(config) if scheduler is SchedulerUse.AUTO else ""
    started = None
    if scheduler is SchedulerUse.AUTO and not named:
        started = stack.enter_context(contextlib.closing(EmbeddedScheduler(config.scheduler)))
        started.spawn()  # serving while the tier manager starts
        named = started.address
    tm = dataclasses.replace(tm, scheduler_address=named, node_id=node_id)
    daemon = stack.enter_context(contextlib.closing(EmbeddedTierManager(tm, for_training=True)))
    daemon.spawn()
    for service in (started, daemon):
        if service is not None:
            service.wait_started()
    log.info("job %s: started a tier manager (NVMe pool at %s)%s", job, ", ".join(directories),
             f" and a scheduler at {named}" if started is not None else "")
    return NodeServices(daemon.address, named, node_id, tuple(directories), started=True)


def _node_id(config: TierstackConfig) -> str:
    return config.tier_manager.node_id or socket.gethostname()


def _named_scheduler(config: TierstackConfig) -> str:
    """The scheduler the config or the environment names ('' for none); it must answer."""
    if config.scheduler.listen:
        check_scheduler(config.scheduler.listen, "scheduler.listen")
        return config.scheduler.listen
    if os.environ.get(SCHEDULER_ENV):
        check_scheduler(os.environ[SCHEDULER_ENV], f"${SCHEDULER_ENV}")
        return os.environ[SCHEDULER_ENV]
    return ""


def _scheduler_for_node(config: TierstackConfig, use: SchedulerUse) -> str:
    """The scheduler a job on the node's (or a named) tier manager follows ('' for none)."""
    if use is SchedulerUse.OFF:
        return ""
    named = _named_scheduler(config)
    if named:
        return named
    address = default_scheduler_address()
    try:
        check_scheduler(address, "the per-user scheduler")
    except ConfigError:
        log.info("no scheduler answers at %s: the job keeps its configured prefetch depths "
                 "(start one with `tierstack scheduler`, or name it in scheduler.listen)", address)
        return ""
    return address
