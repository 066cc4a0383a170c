"""The scheduler's own /metrics and its cluster view over the nodes that registered."""

from __future__ import annotations

import json
import re

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import tier_manager_process
from tests.metrics.conftest import get, wait_for
from tierstack.config import SchedulerConfig
from tierstack.service_process import ServiceProcess
from tierstack.services.scheduler.embedded import EmbeddedScheduler


def _node(tmp_path, shm_dir, name: str, scheduler: str) -> ServiceProcess:
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps({"tier_manager": {
        "cpu_pool": {"size": "16MiB", "shm_dir": str(shm_dir)},
        "nvme_pool": {"paths": [str(tmp_path / f"{name}-nvme")], "size": "64MiB",
                      "aio": {"block_size": "256KiB", "queue_depth": 4}},
        "manifest_path": str(tmp_path / f"{name}.sqlite"),
        "scheduler_address": scheduler, "node_id": name,
        "metrics": {"http_listen": "127.0.0.1:0", "node_name": name,
                    "sample_interval_seconds": 0.25}}}))
    return tier_manager_process(config, tmp_path / f"{name}.sock").start()


def test_the_scheduler_serves_its_metrics_and_the_cluster_of_its_nodes(tmp_path, shm_dir):
    with EmbeddedScheduler(SchedulerConfig(metrics_listen="127.0.0.1:0")) as scheduler:
        url = wait_for(lambda: (m := re.search(r"cluster metrics and dashboard on (\S+)/dashboard/",
                                               scheduler.log_text())) and m.group(1),
                       what="the scheduler's URL", timeout=60.0)
        nodes = [_node(tmp_path, shm_dir, name, scheduler.address) for name in ("node-a", "node-b")]
        try:
            def both():
                c = get(url, "/api/v1/cluster")
                return c if len(c["nodes"]) == 2 else None

            cluster = wait_for(both, what="both nodes in the cluster view", timeout=60.0)
            assert sorted(n["node"] for n in cluster["nodes"]) == ["node-a", "node-b"]
            assert cluster["tiers"]["cpu"]["capacity_bytes"] == 2 * (16 << 20)
            assert cluster["tiers"]["nvme"]["capacity_bytes"] == 2 * (64 << 20)
            families = {f.name: f for f in text_string_to_metric_families(get(url, "/metrics", parse=False))}
            assert families["tierstack_scheduler_nodes"].samples[0].value == 2
            assert "tierstack_scheduler_replans" in families  # the parser drops _total
            assert get(url, "/dashboard/", parse=False).lstrip().lower().startswith("<!doctype html")
            nodes.pop().kill()  # a dead node is listed as unreachable; the other still counts
            cluster = get(url, "/api/v1/cluster")
            assert [n["node"] for n in cluster["nodes"]] == ["node-a"]
            assert len(cluster["unreachable"]) == 1
        finally:
            for node in nodes:
                node.kill()
