"""`ray up deploy/cluster-local.yaml` for real: two loopback nodes, 2 ranks, `ray down`.

A local sshd (openssh-server, installed by the Makefile) listens on 127.0.0.1 and
127.0.0.2, standing for two machines; Ray's cluster launcher reaches both over SSH and
runs the file's own setup and start commands there. The sshd gives each session
TIERSTACK_HOME (this checkout), which is what the commands read on a real node too.
Root only: the launcher's SSH port is 22.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tierstack.addresses import SECURITY_DIR_ENV, cluster_dir_name, node_dir, node_tier_manager_address
from tierstack.deploy.ray_node import ray_node_ip, scheduler_address
from tierstack.rpc import security_from_dir
from tierstack.services.tier_manager.client import TierManagerClient

REPO = Path(__file__).resolve().parents[2]
RAY = REPO / ".venv" / "bin" / "ray"
TIERSTACK = REPO / ".venv" / "bin" / "tierstack"
NODES = ("127.0.0.1", "127.0.0.2")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the launcher's sshd needs port 22 (root)")


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


@pytest.fixture(scope="module")
def local_sshd(tmp_path_factory):
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.path.exists(sshd):
        pytest.fail("sshd not found: `make test` installs openssh-server (apt-get, as root)")
    if any(_port_open(h, 22) for h in NODES):
        pytest.fail("something already listens on port 22 of 127.0.0.1/127.0.0.2; stop it first")
    d = tmp_path_factory.mktemp("sshd")
    for name in ("host", "client"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    shutil.copy(d / "client.pub", d / "authorized_keys")
    (d / "sshd_config").write_text("\n".join([
        "Port 22", *(f"ListenAddress {h}" for h in NODES),
        f"HostKey {d / 'host'}", f"PidFile {d / 'sshd.pid'}",
        f"AuthorizedKeysFile {d / 'authorized_keys'}", "StrictModes no",
        "PermitRootLogin prohibit-password", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "UsePAM no",
        f"SetEnv TIERSTACK_HOME={REPO}", ""]))
    Path("/run/sshd").mkdir(exist_ok=True)  # its privilege-separation directory
    proc = subprocess.Popen([sshd, "-D", "-f", str(d / "sshd_config"), "-E", str(d / "sshd.log")])
    deadline = time.monotonic() + 20
    while not all(_port_open(h, 22) for h in NODES):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"sshd did not start: {(d / 'sshd.log').read_text()[-2000:]}")
        time.sleep(0.2)
    yield d / "client"
    proc.terminate()
    proc.wait(timeout=30)


def _answers(node_ip: str, ray_address: str, timeout: float = 2.0) -> str | None:
    """The instance id of the node's tier manager in that cluster, or None if none answers."""
    client = TierManagerClient(node_tier_manager_address(node_ip, ray_address), reconnect_timeout=timeout)
    try:
        return client.node().instance_id
    except Exception:  # noqa: BLE001 - not (or no longer) running
        return None
    finally:
        client.close()


def _run(argv, env, timeout, log: Path) -> subprocess.CompletedProcess:
    out = subprocess.run([str(a) for a in argv], env=env, timeout=timeout, text=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log.write_text(out.stdout)
    return out


@pytest.mark.timeout(1500)  # about a minute on an idle 2-core machine; far more when it is busy
def test_ray_up_trains_two_ranks_on_two_nodes_and_ray_down_stops_everything(local_sshd, tmp_path):
    config = yaml.safe_load((REPO / "deploy" / "cluster-local.yaml").read_text())
    assert config["provider"]["head_ip"] == NODES[0] and config["provider"]["worker_ips"] == [NODES[1]]
    name = f"tierstack-e2e-{uuid.uuid4().hex[:6]}"
    config["cluster_name"] = name
    config["auth"]["ssh_private_key"] = str(local_sshd)
    cluster_yaml = tmp_path / "cluster.yaml"
    cluster_yaml.write_text(yaml.safe_dump(config))
    # The cluster runs with Ray's token auth off (deploy/cluster.yaml says why): its
    # clients must not send tokens either, whatever an earlier ray.init left in os.environ.
    # The head's scheduler listens on the machine's address, beyond loopback: it takes only
    # TLS calls with the cluster's token. As the README says, make them before `ray up`
    # (in the checkout, which the nodes share here) and give this side's clients the same.
    secrets = REPO / "deploy" / "secrets"
    subprocess.run([TIERSTACK, "ray-node", "--make-secrets", secrets], check=True,
                   stdout=subprocess.DEVNULL)
    env = {**os.environ, "RAY_UP_enable_autoscaler_v2": "0", "RAY_AUTH_MODE": "disabled",
           "COLUMNS": "200", SECURITY_DIR_ENV: str(secrets)}
    home = Path.home()
    bashrc = home / ".bashrc"
    bashrc_before = bashrc.read_text() if bashrc.exists() else None
    bootstrap = [home / "ray_bootstrap_config.yaml", home / "ray_bootstrap_key.pem"]
    bootstrap_existed = [p.exists() for p in bootstrap]
    nodes = [ray_node_ip(h) for h in NODES]  # Ray names the head by the machine's address
    cluster = f"{nodes[0]}:6379"  # the file's Ray (GCS) address, which names the cluster
    node_config = json.loads((REPO / "deploy" / "node.json").read_text())["tier_manager"]
    drives = [Path(p) / cluster_dir_name(cluster) for p in node_config["nvme_pool"]["paths"]]
    drives = [d for d in drives if not d.exists()]  # the nodes' NVMe pools this test creates
    # ...and their parents (deploy/node.json's /var/tmp/tierstack), where this test makes them
    parents = [Path(p) for p in node_config["nvme_pool"]["paths"] if not Path(p).exists()]
    config_caches = set(Path(tempfile.gettempdir()).glob("ray-config-*"))
    try:
        up = _run([RAY, "up", "-y", "--no-config-cache", cluster_yaml], env, 420, tmp_path / "up.log")
        assert up.returncode == 0, up.stdout[-4000:]
        deadline = time.monotonic() + 300  # the head's autoscaler launches the worker node
        while not all(_answers(n, cluster) for n in nodes):
            assert time.monotonic() < deadline, (
                f"tier managers up: {[n for n in nodes if _answers(n, cluster)]} of {nodes}")
            time.sleep(3)
        _check_registered_with_the_scheduler(nodes, cluster)

        train = _run([TIERSTACK, "train", "--address", f"{nodes[0]}:6379", "--ranks", "2",
                      "--placement", "STRICT_SPREAD", "--steps", "3", "--layers", "2", "--dim", "32",
                      "--heads", "2", "--seq-len", "32", "--batch-size", "4"],
                     env, 400, tmp_path / "train.log")
        assert train.returncode == 0, train.stdout[-4000:]
        assert "done: 3 steps on 2 ranks" in train.stdout
        rows = [line for line in train.stdout.splitlines() if line.startswith("│ ")]
        placed = {cell.strip() for row in rows for cell in row.split("│")[2:3]}
        assert placed == set(nodes), rows  # one rank per node
        for node in nodes:  # each rank kept its shards with its own node's tier manager
            client = TierManagerClient(node_tier_manager_address(node, cluster), reconnect_timeout=10)
            try:
                assert client.stats().tensors > 0, node
            finally:
                client.close()
    finally:
        down = _run([RAY, "down", "-y", cluster_yaml], env, 300, tmp_path / "down.log")
        if bashrc_before is not None and bashrc.read_text() != bashrc_before:
            bashrc.write_text(bashrc_before)  # the setup command's PATH line
        for path, existed in zip(bootstrap, bootstrap_existed):
            if not existed:
                path.unlink(missing_ok=True)
        for suffix in ("state", "lock"):
            Path(f"/tmp/ray/cluster-{name}.{suffix}").unlink(missing_ok=True)
        # `ray down` caches the resolved config in the temp directory (`ray up` was told
        # --no-config-cache; `ray down` has no such option): one file per run was left.
        for cache in set(Path(tempfile.gettempdir()).glob("ray-config-*")) - config_caches:
            cache.unlink(missing_ok=True)
    assert down.returncode == 0, down.stdout[-4000:]
    deadline = time.monotonic() + 90  # `ray stop` stopped the raylets; the services follow
    while any(_answers(n, cluster, 1.0) or (node_dir(n, cluster) / "ray-node.pid").exists()
              for n in nodes):
        assert time.monotonic() < deadline, [n for n in nodes if _answers(n, cluster, 1.0)]
        time.sleep(2)
    for drive in drives:
        shutil.rmtree(drive, ignore_errors=True)
    for parent in parents:
        with contextlib.suppress(OSError):  # not empty: another cluster's pool is there
            parent.rmdir()


def _check_registered_with_the_scheduler(nodes: list[str], cluster: str) -> None:
    """Each node's tier manager registered with the head's scheduler, under its node IP."""
    from tierstack.services.scheduler.client import SchedulerClient

    client = SchedulerClient(scheduler_address(cluster),
                             security=security_from_dir(REPO / "deploy" / "secrets"))
    try:
        deadline = time.monotonic() + 60
        while set(client.nodes()) != set(nodes):
            assert time.monotonic() < deadline, f"registered: {sorted(client.nodes())}, nodes: {nodes}"
            time.sleep(1)
    finally:
        client.close()
