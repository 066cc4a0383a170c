"""The tierstack services of one Ray node, started by deploy/cluster.yaml's start commands.

`tierstack ray-node --role head|worker --node-ip IP` runs this node's tier manager (and,
on the head, the cluster's scheduler and dashboard when this tierstack has those
commands) and stops them when this node's Ray stops: it watches the node's raylet, so
`ray down`, which runs `ray stop`, stops them too. Per-node paths carry the node's IP,
so several "nodes" can share one host (the end-to-end test runs two on loopback
addresses), and a Ray actor finds its node's daemon from its own node IP alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tierstack.config import config_dict, load_config
from tierstack.errors import InvalidArgumentError

log = logging.getLogger(__name__)

# Services the head runs once per cluster, as `tierstack <name>`, started when this
# install has the subcommand. The scheduler (issue 5) and the dashboard (issue 6) plug
# in here by adding their subcommand; each gets the head's tier-manager address through
# $TIERSTACK_TIER_MANAGER.
HEAD_SERVICES = ("scheduler", "dashboard")
# The head's scheduler listens on this port of the head's address; every node's tier
# manager registers there (tier_manager.scheduler_address, when this tierstack has it).
SCHEDULER_PORT = 6390
POLL_SECONDS = 1.0


def ray_node_ip(address: str) -> str:
    """The IP Ray gives the node reached at `address`.

    `ray start --node-ip-address=127.0.0.1` (or localhost) registers the machine's own
    address instead, so a loopback name is resolved the same way here.
    """
    if address in ("127.0.0.1", "localhost", "::1"):
        import ray

        return ray.util.get_node_ip_address()
    return address


def node_dir(node_ip: str) -> Path:
    """This node's state directory: sockets, configs, logs, the supervisor's pid."""
    if not node_ip or "/" in node_ip or node_ip.startswith("."):
        raise InvalidArgumentError(f"node IP {node_ip!r} is not an address")
    return Path(f"/tmp/tierstack-{os.getuid()}") / f"node-{node_ip}"


def tier_manager_address(node_ip: str) -> str:
    """The gRPC address of the tier manager of the node with this IP (a unix socket)."""
    return f"unix:{node_dir(node_ip) / 'tier-manager.sock'}"


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

    With a scheduler in this install, the daemon registers with the head's scheduler
    under the node's IP (unique even for nodes sharing a host).
    """
    tm = load_config(config_path).tier_manager
    if head_ip and hasattr(tm, "scheduler_address") and "scheduler" in _head_services():
        tm.scheduler_address = tm.scheduler_address or scheduler_address(head_ip)
        if hasattr(tm, "node_id"):
            tm.node_id = tm.node_id or node_ip
    tm.nvme_pool.paths = [str(Path(p) / f"node-{node_ip}") for p in tm.nvme_pool.paths]
    if not tm.manifest_path:
        tm.manifest_path = str(Path(tm.nvme_pool.paths[0]) / "manifest.sqlite")
    tm.listen = tier_manager_address(node_ip)
    tm.validate()
    return config_dict(tm)


def _head_services() -> list[str]:
    from tierstack.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [name for name in HEAD_SERVICES if name in sub.choices]


class NodeServices:
    """The node's daemons as child processes, stopped together."""

    def __init__(self, role: str, node_ip: str, config_path: str | None,
                 head_ip: str | None = None) -> None:
        self.role, self.node_ip = role, node_ip
        self.head_ip = head_ip or (node_ip if role == "head" else None)
        self.dir = node_dir(node_ip)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config_path = config_path
        self.children: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        if self.role == "head":  # the scheduler first: the tier managers register with it
            for name in _head_services():
                extra = ["--listen", scheduler_address(self.node_ip)] if name == "scheduler" else []
                self._spawn(name, [name, *extra])
        tm = node_tier_manager_config(self.config_path, self.node_ip, self.head_ip)
        for path in tm["nvme_pool"]["paths"]:
            Path(path).mkdir(parents=True, exist_ok=True)
        config_file = self.dir / "tier-manager.json"
        config_file.write_text(json.dumps({"tier_manager": tm}))
        self._spawn("tier-manager", ["tier-manager", "--config", str(config_file)])

    def _spawn(self, name: str, argv: list[str]) -> None:
        env = dict(os.environ, TIERSTACK_TIER_MANAGER=tier_manager_address(self.node_ip))
        out = open(self.dir / f"{name}.log", "ab")
        self.children[name] = subprocess.Popen(
            [sys.executable, "-m", "tierstack.cli", *argv], stdin=subprocess.DEVNULL,
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.dir)
        log.info("started %s (pid %d)", name, self.children[name].pid)

    def exited(self) -> str | None:
        for name, proc in self.children.items():
            if proc.poll() is not None:
                return f"{name} exited with status {proc.returncode}"
        return None

    def stop(self, grace: float = 60.0) -> None:
        for proc in self.children.values():
            if proc.poll() is None:
                proc.terminate()  # the tier manager finishes in-flight writes on SIGTERM
        deadline = time.monotonic() + grace
        for name, proc in self.children.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s: killing it", name, grace)
                proc.kill()
                proc.wait()


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
    from tierstack.worker.client import TierManagerClient

    node_ip = ray_node_ip(node_ip)
    client = TierManagerClient(tier_manager_address(node_ip), reconnect_timeout=timeout)
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", choices=["head", "worker"], required=True)
    parser.add_argument("--node-ip", required=True, help="this node's Ray node IP")
    parser.add_argument("--config", help="node config JSON (its tier_manager section)")
    parser.add_argument("--head-ip", help="the head node's IP (where the scheduler listens); "
                                          "default: this node's on the head")
    parser.add_argument("--wait-ready", type=float, metavar="SECONDS",
                        help="only wait until the node's tier manager answers, then exit")


def run(args: argparse.Namespace) -> int:
    if args.wait_ready is not None:
        return wait_ready(args.node_ip, args.wait_ready)
    return supervise(args.role, args.node_ip, args.config, args.head_ip)
