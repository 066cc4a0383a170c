"""The tierstack services of one Ray node, started by deploy/cluster.yaml's start commands.

`tierstack ray-node --role head|worker --node-ip IP --ray-address HEAD:PORT` runs this
node's tier manager (and, on the head, the cluster's scheduler, which serves the
cluster's dashboard) and stops them when this node's Ray stops: it watches the node's
raylet, so `ray down`, which runs `ray stop`, stops them too.

Everything here is scoped to one cluster, named by its Ray (GCS) address, which no two
running clusters share: the raylet watched is the one with this node's IP *and* this
cluster's `--gcs-address` (another cluster's raylet on the same host, even with the
same node IP, is not ours); per-node paths (sockets, configs, logs, the pid file, the
NVMe directories) carry the cluster and the node's IP, so several nodes of one cluster
or of several can share a host; the scheduler's port follows the cluster's Ray port.
A Ray actor finds its node's daemon from its own node IP and its cluster's GCS address.
Stopping touches only the children this supervisor started (never a process found by
name). Ray's own `ray stop` is not scoped: it kills every Ray process on the host that
the calling user may signal, whatever the cluster (deploy/cluster.yaml says more).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from tierstack.addresses import TIER_MANAGER_ENV, cluster_dir_name, node_dir, node_tier_manager_address
from tierstack.config import config_dict, load_config
from tierstack.errors import InvalidArgumentError
from tierstack.extras import require
from tierstack.service_process import ServiceProcess

log = logging.getLogger(__name__)

# The head's scheduler (which also serves the cluster's metrics and dashboard) listens on
# the head's address, this many ports above the cluster's Ray (GCS) port: 6390 next to
# Ray's default 6379, and a second cluster on the same head host, which must give Ray
# another port anyway, moves its scheduler with it. Every node's tier manager registers there.
SCHEDULER_PORT_OFFSET = 11
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


def cluster_ray_address(ray_address: str) -> str:
    """The cluster's Ray address as its raylets carry it (`--gcs-address`): a loopback
    host becomes the machine's address, as `ray start --address` makes it."""
    host, sep, port = ray_address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidArgumentError(f"Ray address {ray_address!r} is not host:port (e.g. 10.0.0.1:6379)")
    return f"{ray_node_ip(host)}:{port}"


def find_raylet(node_ip: str, ray_address: str) -> int | None:
    """Pid of the raylet of the Ray node with this IP in the cluster at `ray_address`.

    Both arguments match: two clusters on one host may each have a node with the same
    IP (Ray registers any loopback node under the machine's address), but never the
    same GCS address.
    """
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and is_raylet_of(int(entry.name), node_ip, ray_address):
            return int(entry.name)
    return None


def is_raylet_of(pid: int, node_ip: str, ray_address: str) -> bool:
    """Whether process `pid` is (still) the raylet of this node and cluster: false once it
    exited, is a zombie (its command line is empty) or the pid was reused."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    wanted = {f"--node_ip_address={node_ip}".encode(), f"--gcs-address={ray_address}".encode()}
    return argv[0].endswith(b"/raylet") and wanted <= set(argv)


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


def scheduler_address(ray_address: str) -> str:
    """Where the cluster's scheduler listens: the head's address, next to Ray's port."""
    head_ip, _, port = ray_address.rpartition(":")
    return f"{head_ip}:{int(port) + SCHEDULER_PORT_OFFSET}"


def node_tier_manager_config(config_path: str | None, node_ip: str, ray_address: str) -> dict:
    """The node config's tier_manager section with this cluster's per-node paths (NVMe
    directories, manifest) and this node's socket.

    The daemon registers with the head's scheduler under the node's IP (unique even for
    nodes sharing a host). Its HTTP API stays where metrics.http_listen says (loopback by
    default); a host of "{node_ip}" there binds it to the node's IP, where the head's
    cluster view can reach it when nodes are separate hosts.
    """
    tm = load_config(config_path).tier_manager
    tm.scheduler_address = tm.scheduler_address or scheduler_address(ray_address)
    tm.node_id = tm.node_id or node_ip
    # Dashboards label a node by this: the host alone would name every loopback node alike.
    tm.metrics.node_name = tm.metrics.node_name or f"{socket.gethostname()} {node_ip}"
    cluster = cluster_dir_name(ray_address)
    tm.nvme_pool.paths = [str(Path(p) / cluster / f"node-{node_ip}") for p in tm.nvme_pool.paths]
    tm.listen = node_tier_manager_address(node_ip, ray_address)
    host, _, port = tm.metrics.http_listen.rpartition(":")
    if host == NODE_IP_HOST:  # beyond loopback, the daemon requires the token and TLS
        tm.metrics.http_listen = f"[{node_ip}]:{port}" if ":" in node_ip else f"{node_ip}:{port}"
    tm.validate()
    return config_dict(tm)


class NodeServices:
    """The node's daemons as child processes (`ServiceProcess`), stopped together. Their
    configs and logs stay in the node's directory."""

    def __init__(self, role: str, node_ip: str, ray_address: str, config_path: str | None) -> None:
        self.role, self.node_ip, self.ray_address = role, node_ip, ray_address
        self.dir = node_dir(node_ip, ray_address)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config_path = config_path
        self.children: dict[str, ServiceProcess] = {}

    def start(self) -> None:
        env = {TIER_MANAGER_ENV: node_tier_manager_address(self.node_ip, self.ray_address)}
        if self.role == "head":  # the scheduler first: the tier managers register with it
            scheduler = load_config(self.config_path).scheduler
            self._start(ServiceProcess("scheduler", "scheduler", config_dict(scheduler),
                                       listen=scheduler_address(self.ray_address),
                                       workdir=self.dir, env=env))
        tm = node_tier_manager_config(self.config_path, self.node_ip, self.ray_address)
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


def supervise(role: str, node_ip: str, ray_address: str, config_path: str | None,
              raylet_timeout: float = 120.0) -> int:
    """Run the node's services until this node's raylet stops (or a service dies)."""
    node_ip = ray_node_ip(node_ip)
    ray_address = cluster_ray_address(ray_address)
    directory = node_dir(node_ip, ray_address)
    directory.mkdir(parents=True, exist_ok=True)
    pid_file = directory / "ray-node.pid"
    if pid_file.exists():
        try:
            old = int(pid_file.read_text())
        except ValueError:
            old = 0
        if old and _alive(old):
            log.info("node %s's services of cluster %s already run (pid %d)", node_ip,
                     ray_address, old)
            return 0
    deadline = time.monotonic() + raylet_timeout
    while (raylet := find_raylet(node_ip, ray_address)) is None:
        if time.monotonic() > deadline:
            log.error("no raylet with --node_ip_address=%s --gcs-address=%s on this host after "
                      "%.0f s: start Ray on this node first (`ray start ... --node-ip-address=%s`, "
                      "with --port or --address naming %s)",
                      node_ip, ray_address, raylet_timeout, node_ip, ray_address)
            return 1
        time.sleep(POLL_SECONDS)
    pid_file.write_text(str(os.getpid()))
    services = NodeServices(role, node_ip, ray_address, config_path)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append("SIGTERM"))
    signal.signal(signal.SIGINT, lambda *_: stopping.append("SIGINT"))
    try:
        services.start()
        log.info("node %s (%s) of cluster %s: services up next to raylet %d", node_ip, role,
                 ray_address, raylet)
        while not stopping:
            if not is_raylet_of(raylet, node_ip, ray_address):
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


def wait_ready(node_ip: str, ray_address: str, timeout: float) -> int:
    """Wait until the node's tier manager answers; 0 when it does."""
    from tierstack.services.tier_manager.client import TierManagerClient

    node_ip, ray_address = ray_node_ip(node_ip), cluster_ray_address(ray_address)
    client = TierManagerClient(node_tier_manager_address(node_ip, ray_address),
                               reconnect_timeout=timeout)
    try:
        node = client.node()
    except Exception as e:  # noqa: BLE001 - reported with the log to read
        print(f"tier manager of node {node_ip} did not answer within {timeout:.0f} s ({e}); "
              f"see {node_dir(node_ip, ray_address)}/tier-manager.log", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(f"tier manager of node {node_ip} of cluster {ray_address} ready "
          f"(instance {node.instance_id})")
    return 0


def make_secrets(directory: str) -> int:
    """Write the cluster's token and TLS certificate into `directory` (kept if present)."""
    from tierstack.rpc import write_secrets

    # The loopback names too: a browser or curl on a node reaches its dashboards there.
    path = write_secrets(directory, hosts=("127.0.0.1", "::1", "localhost"))
    print(f"the cluster's token, certificate and key are in {path} (0600 files in a 0700 "
          f"directory); `ray up` copies {DEFAULT_SECRETS} with the checkout to every node. "
          f"Clients trust {path / 'ca.pem'}: `curl --cacert {path / 'ca.pem'} https://...`, "
          f"or import it into a browser as a certificate authority")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", choices=["head", "worker"],
                        help="head: also run the cluster scheduler; worker: the tier manager only")
    parser.add_argument("--node-ip", help="this node's Ray node IP")
    parser.add_argument("--config", help="node config JSON (its tier_manager section)")
    parser.add_argument("--ray-address", metavar="HEAD:PORT",
                        help="the cluster's Ray (GCS) address, as `ray start --address` takes it "
                             "(on the head: its IP and `--port`); names the cluster on this host, "
                             "and the scheduler listens on the head next to it")
    parser.add_argument("--wait-ready", type=float, metavar="SECONDS",
                        help="only wait until the node's tier manager answers, then exit")
    parser.add_argument("--make-secrets", metavar="DIR",
                        help=f"only write a cluster's token and TLS certificate into DIR, "
                             f"then exit (run once before `ray up`, with DIR {DEFAULT_SECRETS})")


def run(args: argparse.Namespace) -> int:
    require("cluster", "tierstack ray-node")
    if args.make_secrets:
        return make_secrets(args.make_secrets)
    if not args.role or not args.node_ip or not args.ray_address:
        raise InvalidArgumentError(
            "ray-node needs --role, --node-ip and --ray-address (or --make-secrets DIR)")
    if args.wait_ready is not None:
        return wait_ready(args.node_ip, args.ray_address, args.wait_ready)
    return supervise(args.role, args.node_ip, args.ray_address, args.config)
