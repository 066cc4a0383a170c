"""Finding the node's tier manager (and a scheduler), or saying in one line that nothing answers.

A store waits a minute for a daemon that restarts (tier_session.py); that suits a
restart, not a typo or a daemon never started: before the first call, the address is
checked here within REACH_SECONDS. Imports no torch (the CLI checks flags with it).
"""

from __future__ import annotations

from tierstack.addresses import (default_tier_manager_address, grpc_target, unix_socket_path,
                                 unix_socket_unserved)
from tierstack.errors import ConfigError, TierManagerUnavailableError, TierstackError

REACH_SECONDS = 2.0
"""How long a tier manager named by an address may take to answer before we give up."""


def check_reachable(address: str, setting: str = "--tier-manager",
                    hint: str = "start one (`tierstack tier-manager --listen ADDRESS`) or leave "
                                "the address out to start an embedded one") -> None:
    """Fail within REACH_SECONDS, in one line naming `setting`, when no tier manager
    answers at `address`."""
    from tierstack.services.tier_manager.client import TierManagerClient

    _check(address, setting, hint, "tier manager",
           lambda: TierManagerClient(address, reconnect_timeout=REACH_SECONDS), "node",
           TierManagerUnavailableError)


def check_scheduler(address: str, setting: str,
                    hint: str = "start one (`tierstack scheduler`) or leave it out") -> None:
    """Fail within REACH_SECONDS, in one line naming `setting`, when no scheduler answers
    at `address`."""
    from tierstack.services.scheduler.client import SchedulerClient

    _check(address, setting, hint, "scheduler",
           lambda: SchedulerClient(address, timeout=REACH_SECONDS), "list_nodes")


def _check(address: str, setting: str, hint: str, service: str, make_client, call: str,
           unanswered: type[Exception] = TierstackError) -> None:
    """A unix socket nothing serves (missing, or left by a killed daemon) at once, else one
    call (`call`) within REACH_SECONDS; `unanswered`: the errors that mean no answer."""
    socket_path = unix_socket_path(grpc_target(address))
    if socket_path is not None:
        why = unix_socket_unserved(socket_path, REACH_SECONDS)
        if why:
            raise ConfigError(f"{setting} {address}: nothing listens there ({why}); {hint}")
    client = make_client()
    try:
        getattr(client, call)()
    except unanswered:
        raise ConfigError(f"{setting} {address}: no {service} answered within "
                          f"{REACH_SECONDS:.0f} s; {hint}") from None
    finally:
        client.close()


def running_tier_manager() -> str | None:
    """The node's default tier manager ($TIERSTACK_TIER_MANAGER or the per-user socket)
    when one answers there now, else None."""
    address = default_tier_manager_address()
    try:
        check_reachable(address)
    except ConfigError:
        return None
    return address
