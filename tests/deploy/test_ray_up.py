"""The README's cluster commands, as written: `tierstack local-cluster up`, two ranks on two
loopback nodes through Ray's token auth, `tierstack local-cluster down`.

`local-cluster up` starts a local sshd listening on 127.0.0.1 and 127.0.0.2, standing for
two machines, and `ray up` of deploy/cluster-local.yaml; Ray's cluster launcher reaches
both over SSH and runs the file's own setup and start commands there. The block is read
from README.md (tests/test_readme.py's parser: it skips the block, naming this file), run
up to its `down` line, checked, then `down` runs and everything `up` made must be gone.
Root only: the launcher's SSH port is 22.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.test_readme import README, readme_blocks
from tierstack.addresses import node_dir, node_tier_manager_address, user_dir
from tierstack.deploy import local_cluster
from tierstack.deploy.ray_node import ray_node_ip, scheduler_address
from tierstack.rpc import security_from_dir
from tierstack.services.tier_manager.client import TierManagerClient

REPO = Path(__file__).resolve().parents[2]
NODES = ("127.0.0.1", "127.0.0.2")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the launcher's sshd needs port 22 (root)")


def readme_cluster_block() -> tuple[str, str]:
    """The README's cluster block, split before its `local-cluster down` line."""
    [block] = [b for b in readme_blocks(README) if b.run_by == "tests/deploy/test_ray_up.py"]
    lines = block.code.splitlines(keepends=True)
    [down] = [i for i, line in enumerate(lines) if "local-cluster down" in line]
    return "".join(lines[:down]), "".join(lines[down:])


def _bash(code: str, timeout: float, log: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # a user's shell
    out = subprocess.run(["bash", "-c", "set -euo pipefail\n" + code], cwd=REPO, env={**env, "COLUMNS": "200"},
                         timeout=timeout, text=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log.write_text(out.stdout)
    return out


def _shown(output: str) -> str:
    """A failed run's output for the assertion: without `ray down`'s per-second state
    lines (they pushed the reason out of the tail once), its beginning and its end."""
    kept = "\n".join(line for line in output.splitlines()
                     if not re.search(r"node_provider\.py|nodes remaining after|nodes to shut down", line))
    return kept if len(kept) <= 8000 else kept[:4000] + "\n[...]\n" + kept[-4000:]


def _snapshot() -> dict[str, object]:
    """What `up` could leave behind, to compare after `down`."""
    home = Path.home()
    return {"bashrc": (home / ".bashrc").read_text() if (home / ".bashrc").exists() else None,
            "home": sorted(p.name for p in home.glob("ray_bootstrap*")),
            "ray_state": sorted(p.name for p in Path("/tmp/ray").glob("cluster-*")),
            "config_caches": sorted(p.name for p in Path(tempfile.gettempdir()).glob("ray-config-*")),
            "ray_ssh": sorted(p.name for p in Path("/tmp").glob("ray_ssh_*")),
            "local_cluster": local_cluster.state_dir().exists(),
            "secrets": (REPO / "deploy" / "secrets").exists(),
            # the nodes' directories and logs (other processes may use the rest meanwhile)
            "nodes": sorted(p.name for p in user_dir().glob("cluster-*")) +
            sorted(p.name for p in user_dir().glob("ray-node-*"))}


@pytest.mark.timeout(1500)  # about a minute on an idle 2-core machine; far more when it is busy
def test_the_readmes_cluster_commands_train_two_ranks_on_two_nodes_and_down_removes_all(tmp_path):
    up_and_train, down = readme_cluster_block()
    assert "local-cluster up" in up_and_train and "--address auto" in up_and_train
    before = _snapshot()
    nodes = [ray_node_ip(h) for h in NODES]  # Ray names the head by the machine's address
    cluster = f"{nodes[0]}:6379"  # the Ray (GCS) address, which names the cluster
    stopped = False
    try:
        run = _bash(up_and_train, 1200, tmp_path / "up-and-train.log")
        assert run.returncode == 0, _shown(run.stdout)
        assert "done: 3 steps on 2 ranks" in run.stdout
        rows = [line for line in run.stdout.splitlines() if line.startswith("│ ")]
        placed = {cell.strip() for row in rows for cell in row.split("│")[2:3]}
        assert placed == set(nodes), rows  # one rank per node
        for node in nodes:  # every run with a dashboard prints its URL
            assert f"dashboard of node {node}: https://" in run.stdout, run.stdout[-3000:]
        assert "cluster view: https://" in run.stdout and "curl --cacert" in run.stdout
        assert "ActorDiedError" not in run.stdout
        _check_registered_with_the_scheduler(nodes, cluster)
        for node in nodes:  # each rank kept its shards with its own node's tier manager
            client = TierManagerClient(node_tier_manager_address(node, cluster),
                                       reconnect_timeout=10)
            try:
                assert client.stats().tensors > 0, node
            finally:
                client.close()
        out = _bash(down, 600, tmp_path / "down.log")
        stopped = True
        assert out.returncode == 0, _shown(out.stdout)
    finally:
        if not stopped:
            _bash(down, 600, tmp_path / "down.log")
    for node in nodes:
        assert not (node_dir(node, cluster) / "ray-node.pid").exists()
    assert _snapshot() == before


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
