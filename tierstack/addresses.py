"""Where tierstack's services listen, and how an address becomes a gRPC target.

A service listens on a unix socket by default (one per user: only its owner can talk to
it) or on host:port for a cluster. The defaults are per user under /tmp, or the
address in the service's environment variable. A Ray node's services live in a
directory named after its cluster (the cluster's Ray address) and the node's IP, so
several "nodes", of one cluster or of several, can share one host.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

from tierstack.errors import InvalidArgumentError

TIER_MANAGER_ENV = "TIERSTACK_TIER_MANAGER"
SCHEDULER_ENV = "TIERSTACK_SCHEDULER"
JOB_ENV = "TIERSTACK_JOB"
"""A job's name on its node (`tierstack launch` sets it; tierstack.initialize reads it)."""
SECURITY_DIR_ENV = "TIERSTACK_SECURITY_DIR"
"""A directory with the cluster's token, cert.pem, key.pem and ca.pem (config.SecurityConfig)."""


def user_dir() -> Path:
    """The per-user directory of default sockets and node state."""
    return Path(f"/tmp/tierstack-{os.getuid()}")


def default_token_path() -> Path:
    """The per-user token of services on loopback TCP (tierstack/rpc.py: default_token)."""
    return user_dir() / "token"


def default_tier_manager_address() -> str:
    """The node's tier manager: $TIERSTACK_TIER_MANAGER, else a per-user socket."""
    return os.environ.get(TIER_MANAGER_ENV) or f"unix:{user_dir() / 'tier-manager.sock'}"


def default_scheduler_address() -> str:
    """The cluster's scheduler: $TIERSTACK_SCHEDULER, else a per-user socket."""
    return os.environ.get(SCHEDULER_ENV) or f"unix:{user_dir() / 'scheduler.sock'}"


def grpc_target(address: str) -> str:
    """A gRPC target from an address: a bare path becomes a unix socket."""
    if address.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")):
        return address
    if address.startswith("/") or address.startswith("./"):
        return f"unix:{os.path.abspath(address)}"
    return address


def unix_socket_path(target: str) -> Path | None:
    """The socket file of a unix: target (None for a TCP one)."""
    if target.startswith("unix://"):
        return Path(target[len("unix://"):])
    if target.startswith("unix:"):
        return Path(target[len("unix:"):])
    return None


def unix_socket_unserved(path: Path, within: float) -> str:
    """Why no service takes connections on the unix socket `path` now, '' when one does.

    Looked at on the filesystem and connected to once, nothing sent: a missing socket, and
    one a killed daemon left (connections refused), are told at once, where a call would
    wait out its deadline for a service to come. `within` bounds the connect (a listener
    with a full backlog)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return f"{path} does not exist"
    except OSError as e:
        return f"cannot look at {path}: {e.strerror}"
    if not stat.S_ISSOCK(st.st_mode):
        return f"{path} is not a socket"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(within)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        return (f"nothing listens on {path}: a daemon that was killed leaves its socket, and "
                f"the next one to start replaces it")
    except OSError as e:  # a timeout, a permission
        return f"cannot connect to {path}: {e.strerror or e}"
    finally:
        probe.close()
    return ""


def cluster_dir_name(ray_address: str) -> str:
    """The name of a Ray cluster's directories on a host: its Ray (GCS) address host:port,
    which no two running clusters share (a second cluster on the same head host must
    take another port)."""
    host, sep, port = ray_address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or "/" in host or host.startswith("."):
        raise InvalidArgumentError(f"Ray address {ray_address!r} is not host:port (e.g. 10.0.0.1:6379)")
    return f"cluster-{host}-{port}"


def node_dir(node_ip: str, ray_address: str) -> Path:
    """A Ray node's state directory: its sockets, configs, logs, the supervisor's pid."""
    if not node_ip or "/" in node_ip or node_ip.startswith("."):
        raise InvalidArgumentError(f"node IP {node_ip!r} is not an address")
    return user_dir() / cluster_dir_name(ray_address) / f"node-{node_ip}"


def node_tier_manager_address(node_ip: str, ray_address: str) -> str:
    """The tier manager of the Ray node with this IP in the cluster at `ray_address` (a
    unix socket in its node_dir)."""
    return f"unix:{node_dir(node_ip, ray_address) / 'tier-manager.sock'}"
