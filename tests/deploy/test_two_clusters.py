"""Two clusters' node services on one host: stopping one leaves the other's untouched.

Clusters A and B each have a head node with the *same* node IP (127.0.0.2), as two
`ray up`s of the local provider on one machine would (Ray registers any loopback node
under the machine's address); only their Ray (GCS) addresses differ. Each node's
services are started by deploy/start-node-services.sh itself, as the cluster YAML's
start command does, next to a stand-in raylet: a process whose command line is a
raylet's as `ray start` writes it (`.../raylet --node_ip_address=IP --gcs-address=HOST:PORT
...`), which is all `tierstack ray-node` looks at. A real `ray start --head` takes ~8 s
per cluster on 2 busy cores, and Ray has no scoped stop to end one of them with
(`ray stop` kills every cluster's Ray on the host: deploy/cluster.yaml), so the test
stops cluster A the way `ray stop` stops a raylet, SIGTERM, to A's raylet alone.
tests/deploy/test_ray_up.py runs real Ray end to end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tierstack.addresses import SECURITY_DIR_ENV, cluster_dir_name, node_dir
from tierstack.deploy.local_cluster import tier_manager_instance
from tierstack.deploy.ray_node import scheduler_address
from tierstack.rpc import security_from_dir, write_secrets
from tierstack.services.scheduler.client import SchedulerClient

REPO = Path(__file__).resolve().parents[2]
NODE_IP = "127.0.0.2"


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _command(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still running after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive


def _free_ray_port() -> int:
    """A free port whose scheduler port (11 above) is free too."""
    while True:
        with socket.socket() as s:
            s.bind((NODE_IP, 0))
            port = s.getsockname()[1]
        if port + 11 < 65536:
            with socket.socket() as s:
                if s.connect_ex((NODE_IP, port + 11)) != 0:
                    return port


class Cluster:
    """One fake cluster's head on this host: a stand-in raylet and the node's services."""

    def __init__(self, tmp_path: Path, name: str, node_config: Path, env: dict) -> None:
        self.ray_address = f"{NODE_IP}:{_free_ray_port()}"
        self.dir = node_dir(NODE_IP, self.ray_address)
        self.nvme = json.loads(node_config.read_text())["tier_manager"]["nvme_pool"]["paths"][0]
        self.log = Path(f"/tmp/tierstack-{os.getuid()}/ray-node-head-{NODE_IP}-for-{self.ray_address}.log")
        raylet = tmp_path / name / "raylet"  # Ray's raylet binary is named `raylet`
        raylet.parent.mkdir()
        raylet.symlink_to(shutil.which("bash"))
        # bash runs the builtin `read` until its stdin closes or SIGTERM: no child, one pid.
        self.raylet = subprocess.Popen(
            [str(raylet), "-c", "read -r _", "raylet", f"--node_ip_address={NODE_IP}",
             f"--gcs-address={self.ray_address}", f"--session-name=session_{name}"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.env = env
        self.supervisor: int | None = None
        self.services: list[int] = []

    def start_services(self) -> None:
        """deploy/start-node-services.sh, as the YAML's head start command runs it."""
        out = subprocess.run([str(REPO / "deploy" / "start-node-services.sh"), "head", NODE_IP,
                              self.ray_address], env=self.env, stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=150)
        assert out.returncode == 0, out.stdout + out.stderr + self._log_tail()
        self.supervisor = int((self.dir / "ray-node.pid").read_text())
        self.services = _children(self.supervisor)
        commands = sorted(_command(p)[_command(p).index("--config") - 1] for p in self.services)
        assert commands == ["scheduler", "tier-manager"], commands

    def tier_manager_id(self, timeout: float = 5.0) -> str | None:
        return tier_manager_instance(NODE_IP, self.ray_address, timeout)

    def scheduler_nodes(self, security) -> list[str]:
        client = SchedulerClient(scheduler_address(self.ray_address), timeout=10.0, security=security)
        try:
            deadline = time.monotonic() + 30  # the tier manager registers after it serves
            while not (nodes := sorted(client.nodes())) and time.monotonic() < deadline:
                time.sleep(0.5)
            return nodes
        finally:
            client.close()

    def processes(self) -> list[int]:
        """The supervisor and the services it started."""
        return [p for p in [self.supervisor, *self.services] if p is not None]

    def _log_tail(self) -> str:
        return self.log.read_text()[-3000:] if self.log.exists() else ""

    def cleanup(self) -> None:
        """Stop what this test started, by pid, and remove the cluster's files."""
        if self.raylet.poll() is None:
            self.raylet.terminate()
        self.raylet.wait(timeout=10)
        for pid in _wait_gone(self.processes(), timeout=30):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.dir.parent, ignore_errors=True)
        shutil.rmtree(Path(self.nvme) / cluster_dir_name(self.ray_address), ignore_errors=True)
        self.log.unlink(missing_ok=True)


@pytest.mark.timeout(240)  # about 30 s on an idle 2-core machine
def test_stopping_one_cluster_leaves_the_other_clusters_services_running(tmp_path, shm_dir):
    secrets = write_secrets(tmp_path / "secrets")
    security = security_from_dir(secrets)
    node_config = tmp_path / "node.json"
    node_config.write_text(json.dumps({"tier_manager": {
        "cpu_pool": {"size": "16MiB", "shm_dir": str(shm_dir)},
        "nvme_pool": {"paths": [str(tmp_path / "nvme")], "size": "64MiB",
                      "aio": {"block_size": "256KiB", "queue_depth": 4}}}}))
    env = {**os.environ, "TIERSTACK_NODE_CONFIG": str(node_config), SECURITY_DIR_ENV: str(secrets)}
    a = Cluster(tmp_path, "a", node_config, env)
    b = Cluster(tmp_path, "b", node_config, env)
    try:
        a.start_services()
        b.start_services()
        assert a.dir != b.dir
        a_id, b_id = a.tier_manager_id(), b.tier_manager_id()
        assert a_id and b_id and a_id != b_id  # two daemons, though the node IP is the same
        assert a.scheduler_nodes(security) == [NODE_IP] == b.scheduler_nodes(security)
        assert (Path(a.nvme) / cluster_dir_name(a.ray_address) / f"node-{NODE_IP}").is_dir()

        a.raylet.send_signal(signal.SIGTERM)  # what `ray stop` does to a raylet, to A's only
        alive = _wait_gone(a.processes(), timeout=90)
        assert not alive, f"cluster A's processes still running: {[_command(p) for p in alive]}"
        assert not (a.dir / "ray-node.pid").exists()
        assert not (a.dir / "tier-manager.sock").exists()
        assert a.tier_manager_id(timeout=1.0) is None

        assert all(_running(p) for p in b.processes())
        assert b.tier_manager_id() == b_id  # the same daemon, still answering
        assert b.scheduler_nodes(security) == [NODE_IP]
        assert b.raylet.poll() is None
    finally:
        a.cleanup()
        b.cleanup()
