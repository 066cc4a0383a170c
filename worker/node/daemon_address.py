"""Finding the node's tier manager, or saying in one line that nothing answers.

A store waits a minute for a daemon that restarts (tier_session.py); that suits a
restart, not a typo or a daemon never started: before the first call, the address is
checked here within REACH_SECONDS. Imports no torch (the CLI checks flags with it).
"""

from __future__ import annotations

from tierstack.addresses import default_tier_manager_address, grpc_target, unix_socket_path
from tierstack.errors import ConfigError, TierManagerUnavailableError

REACH_SECONDS = 2.0
"""How long a tier manager named by an address may take to answer before we give up."""


def check_reachable(address: str, setting: str = "--tier-manager",
                    hint: str = "start one (`tierstack tier-manager --listen ADDRESS`) or leave "
                                "the address out to start an embedded one") -> None:
    """Fail within REACH_SECONDS, in one line naming `setting`, when no tier manager
    answers at `address`."""
    socket_path = unix_socket_path(grpc_target(address))
    if socket_path is not None and not socket_path.exists():
        raise ConfigError(f"{setting} {address}: nothing listens there ({socket_path} does "
                          f"not exist); {hint}")
    from tierstack.services.tier_manager.client import TierManagerClient

    client = TierManagerClient(address, reconnect_timeout=REACH_SECONDS)
    try:
        client.node()
    except TierManagerUnavailableError:
        raise ConfigError(f"{setting} {address}: no tier manager answered within "
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
