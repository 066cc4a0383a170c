"""The tierstack services of one Ray node, started by deploy/cluster.yaml's start commands.

`tierstack ray-node --role head|worker --node-ip IP` runs this node's tier manager (and,
on the head, the cluster's scheduler, which serves the cluster's dashboard) and stops
them when this node's Ray stops: it watches the node's raylet, so
`ray down`, which runs `ray stop`, stops them too. Per-node paths carry the node's IP,
so several "nodes" can share one host (the end-to-end test runs two on loopback
addresses), and a Ray actor finds its node's daemon from its own node IP alone.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path

from tierstack.addresses import TIER_MANAGER_ENV, node_dir, node_tier_manager_address
from tierstack.config import config_dict, load_config
from tierstack.errors import InvalidArgumentError
from tierstack.service_process import ServiceProcess

log = logging.getLogger(__name__)

# The head's scheduler (which also serves the cluster's metrics and dashboard) listens on
# this port of the head's address; every node's tier manager registers there.
SCHEDULER_PORT = 6390
# The cluster's token and TLS certificate, in the checkout that `ray up` copies to every
# node (git ignores it); start-node-services.sh points $TIERSTACK_SECURITY_DIR at it.
DEFAULT_SECRETS = "deploy/secrets"
POLL_SECONDS = 1.0
# In the node config's metrics.http_listen, this host stands for the node's own IP: the
# config is the same on every node, and the head's cluster view reaches each node's HTTP
# API at the address it registered (its own loopback one is no use on another host).
NODE_IP_HOST = "{node_ip}"


def ray_node_ip(address: str) -> str:
    """The IP Ray gives the node reached at `address`.

    `ray start --node-ip-address=127.0.0.1` (or localhost) registers the machine's own
    address instead, so a loopback name is resolved the same way here.
    """
    if address in ("127.0.0.1", "localhost", "::1"):
        import ray

        return ray.util.get_node_ip_address()
    return address


def find_raylet(node_ip: str) -> int | None:
    """Pid of the raylet of the Ray node with this IP on this host, if one runs."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"/raylet") and f"--node_ip_address={node_ip}".encode() in argv:
            return int(entry.name)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes (a raylet reaped late by its parent).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def scheduler_address(head_ip: str) -> str:
    return f"{head_ip}:{SCHEDULER_PORT}"


def node_tier_manager_config(config_path: str | None, node_ip: str, head_ip: str | None = None) -> dict:
    """The node config's tier_manager section with per-node paths and this node's socket.

    The daemon registers with the head's scheduler under the node's IP (unique even for
    nodes sharing a host). Its HTTP API stays where metrics.http_listen says (loopback by
    default); a host of "{node_ip}" there binds it to the node's IP, where the head's
    cluster view can reach it when nodes are separate hosts.
    """
    tm = load_config(config_path).tier_manager
    if head_ip:
        tm.scheduler_address = tm.scheduler_address or scheduler_address(head_ip)
        tm.node_id = tm.node_id or node_ip
    tm.nvme_pool.paths = [str(Path(p) / f"node-{node_ip}") for p in tm.nvme_pool.paths]
    if not tm.manifest_path:
        tm.manifest_path = str(Path(tm.nvme_pool.paths[0]) / "manifest.sqlite")
    tm.listen = node_tier_manager_address(node_ip)
    host, _, port = tm.metrics.http_listen.rpartition(":")
    if host == NODE_IP_HOST:  # beyond loopback, the daemon requires the token and TLS
        tm.metrics.http_listen = f"[{node_ip}]:{port}" if ":" in node_ip else f"{node_ip}:{port}"
    tm.validate()
    return config_dict(tm)


class NodeServices:
    """The node's daemons as child processes (`ServiceProcess`), stopped together. Their
    configs and logs stay in the node's directory."""

    def __init__(self, role: str, node_ip: str, config_path: str | None,
                 head_ip: str | None = None) -> None:
        self.role, self.node_ip = role, node_ip
        self.head_ip = head_ip or (node_ip if role == "head" else None)
        self.dir = node_dir(node_ip)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config_path = config_path
        self.children: dict[str, ServiceProcess] = {}

    def start(self) -> None:
        env = {TIER_MANAGER_ENV: node_tier_manager_address(self.node_ip)}
        if self.role == "head":  # the scheduler first: the tier managers register with it
            scheduler = load_config(self.config_path).scheduler
            self._start(ServiceProcess("scheduler", "scheduler", config_dict(scheduler),
                                       listen=scheduler_address(self.node_ip), workdir=self.dir,
                                       env=env))
        tm = node_tier_manager_config(self.config_path, self.node_ip, self.head_ip)
        for path in tm["nvme_pool"]["paths"]:
            Path(path).mkdir(parents=True, exist_ok=True)
        self._start(ServiceProcess("tier-manager", "tier_manager", tm, name="tier manager",
                                   listen=tm["listen"], workdir=self.dir, env=env))

    def _start(self, service: ServiceProcess) -> None:
        self.children[service.command] = service
        service.start()
        log.info("started %s (pid %d)", service.name, service.proc.pid)

    def exited(self) -> str | None:
        for name, service in self.children.items():
            if not service.running():
                return f"{name} exited with status {service.proc.returncode}"
        return None

    def stop(self, grace: float = 60.0) -> None:
        for service in self.children.values():
            if service.running():
                service.proc.terminate()  # the tier manager finishes in-flight writes on SIGTERM
        for service in self.children.values():
            service.stop(timeout=grace)


def supervise(role: str, node_ip: str, config_path: str | None, head_ip: str | None = None,
              raylet_timeout: float = 120.0) -> int:
    """Run the node's services until this node's raylet stops (or a service dies)."""
    node_ip = ray_node_ip(node_ip)
    head_ip = ray_node_ip(head_ip) if head_ip else None
    directory = node_dir(node_ip)
    directory.mkdir(parents=True, exist_ok=True)
    pid_file = directory / "ray-node.pid"
    if pid_file.exists():
        try:
            old = int(pid_file.read_text())
        except ValueError:
            old = 0
        if old and _alive(old):
            log.info("node %s's services already run (pid %d)", node_ip, old)
            return 0
    deadline = time.monotonic() + raylet_timeout
    while (raylet := find_raylet(node_ip)) is None:
        if time.monotonic() > deadline:
            log.error("no raylet with --node_ip_address=%s on this host after %.0f s: start Ray "
                      "on this node first (`ray start ... --node-ip-address=%s`)",
                      node_ip, raylet_timeout, node_ip)
            return 1
        time.sleep(POLL_SECONDS)
    pid_file.write_text(str(os.getpid()))
    services = NodeServices(role, node_ip, config_path, head_ip)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append("SIGTERM"))
    signal.signal(signal.SIGINT, lambda *_: stopping.append("SIGINT"))
    try:
        services.start()
        log.info("node %s (%s): services up next to raylet %d", node_ip, role, raylet)
        while not stopping:
            if not _alive(raylet):
                log.info("raylet %d stopped: stopping the node's services", raylet)
                break
            if (why := services.exited()) is not None:
                log.error("%s: stopping the node's services", why)
                break
            time.sleep(POLL_SECONDS)
    finally:
        services.stop()
        pid_file.unlink(missing_ok=True)
    return 0


def wait_ready(node_ip: str, timeout: float) -> int:
    """Wait until the node's tier manager answers; 0 when it does."""
    from tierstack.services.tier_manager.client import TierManagerClient

    node_ip = ray_node_ip(node_ip)
    client = TierManagerClient(node_tier_manager_address(node_ip), reconnect_timeout=timeout)
    try:
        node = client.node()
    except Exception as e:  # noqa: BLE001 - reported with the log to read
        print(f"tier manager of node {node_ip} did not answer within {timeout:.0f} s ({e}); "
              f"see {node_dir(node_ip)}/ray-node.log and tier-manager.log", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(f"tier manager of node {node_ip} ready (instance {node.instance_id})")
    return 0


def make_secrets(directory: str) -> int:
    """Write the cluster's token and TLS certificate into `directory` (kept if present)."""
    from tierstack.rpc import write_secrets

    path = write_secrets(directory)
    print(f"the cluster's token, certificate and key are in {path} (0600 files in a 0700 "
          f"directory); `ray up` copies {DEFAULT_SECRETS} with the checkout to every node")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", choices=["head", "worker"],
                        help="head: also run the cluster scheduler; worker: the tier manager only")
    parser.add_argument("--node-ip", help="this node's Ray node IP")
    parser.add_argument("--config", help="node config JSON (its tier_manager section)")
    parser.add_argument("--head-ip", help="the head node's IP (where the scheduler listens); "
                                          "default: this node's on the head")
    parser.add_argument("--wait-ready", type=float, metavar="SECONDS",
                        help="only wait until the node's tier manager answers, then exit")
    parser.add_argument("--make-secrets", metavar="DIR",
                        help=f"only write a cluster's token and TLS certificate into DIR, "
                             f"then exit (run once before `ray up`, with DIR {DEFAULT_SECRETS})")


def run(args: argparse.Namespace) -> int:
    if args.make_secrets:
        return make_secrets(args.make_secrets)
    if not args.role or not args.node_ip:
        raise InvalidArgumentError("ray-node needs --role and --node-ip (or --make-secrets DIR)")
    if args.wait_ready is not None:
        return wait_ready(args.node_ip, args.wait_ready)
    return supervise(args.role, args.node_ip, args.config, args.head_ip)
