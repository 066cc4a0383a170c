"""A Ray node's HTTP API where the head's cluster view can reach it: loopback unless the
node config binds it to the node's IP (metrics.http_listen "{node_ip}:PORT", the same
config on every node). Two real tier managers standing for nodes 127.0.0.2 and 127.0.0.3
register with a real scheduler, whose cluster view then reads both over HTTP."""

from __future__ import annotations

import json
import re
import urllib.parse

from tests.conftest import tier_manager_process
from tests.metrics.conftest import get, wait_for
from tierstack.config import SchedulerConfig
from tierstack.deploy.ray_node import node_tier_manager_config
from tierstack.services.scheduler.embedded import EmbeddedScheduler
from tierstack.services.tier_manager.client import TierManagerClient


def _node_config(tmp_path, shm_dir, scheduler: str = "", http_listen: str | None = None):
    tm = {"cpu_pool": {"size": "16MiB", "shm_dir": str(shm_dir)},
          "nvme_pool": {"paths": [str(tmp_path / "nvme")], "size": "64MiB",
                        "aio": {"block_size": "256KiB", "queue_depth": 4}},
          "scheduler_address": scheduler}
    if http_listen is not None:
        tm["metrics"] = {"http_listen": http_listen, "sample_interval_seconds": 0.25}
    path = tmp_path / "node.json"
    path.write_text(json.dumps({"tier_manager": tm}))
    return str(path)


def test_a_nodes_http_api_stays_on_loopback_by_default(tmp_path, shm_dir):
    config = node_tier_manager_config(_node_config(tmp_path, shm_dir), "10.1.2.3",
                                      "10.1.2.1:6379")
    assert config["metrics"]["http_listen"] == "127.0.0.1:8470"


def test_nodes_bound_to_their_ips_are_all_in_the_heads_cluster_view(tmp_path, shm_dir):
    with EmbeddedScheduler(SchedulerConfig(metrics_listen="127.0.0.1:0")) as scheduler:
        url = wait_for(lambda: (m := re.search(r"cluster metrics and dashboard on (\S+)/dashboard/",
                                               scheduler.log_text())) and m.group(1),
                       what="the scheduler's URL", timeout=60.0)
        shared = _node_config(tmp_path, shm_dir, scheduler.address, http_listen="{node_ip}:0")
        nodes = []
        try:
            for ip in ("127.0.0.2", "127.0.0.3"):
                section = node_tier_manager_config(shared, ip, "127.0.0.2:6379")
                section["node_id"] = ip
                section["nvme_pool"]["paths"] = [str(tmp_path / f"nvme-{ip}")]
                section["manifest_path"] = str(tmp_path / f"{ip}.sqlite")
                path = tmp_path / f"{ip}.json"
                path.write_text(json.dumps({"tier_manager": section}))
                nodes.append(tier_manager_process(path, tmp_path / f"{ip}.sock").start())
            for ip, node in zip(("127.0.0.2", "127.0.0.3"), nodes):
                client = TierManagerClient(node.address)
                endpoint = client.http_endpoint()
                client.close()
                assert urllib.parse.urlsplit(endpoint).hostname == ip, endpoint
                assert get(endpoint, "/api/v1/node")["node"]  # answers at the node's address

            def both():
                cluster = get(url, "/api/v1/cluster")
                return cluster if len(cluster["nodes"]) == 2 else None

            cluster = wait_for(both, what="both nodes in the head's cluster view", timeout=60.0)
            assert not cluster["unreachable"]
        finally:
            for node in nodes:
                node.kill()


def test_each_node_is_named_by_its_host_and_address(tmp_path, shm_dir):
    """Two loopback nodes of one host would both be the host's name in the cluster view."""
    import socket

    names = {ip: node_tier_manager_config(_node_config(tmp_path, shm_dir), ip, "10.1.2.1:6379")
             ["metrics"]["node_name"] for ip in ("10.1.2.1", "10.1.2.2")}
    assert names == {ip: f"{socket.gethostname()} {ip}" for ip in names}
