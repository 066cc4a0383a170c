"""The node's HTTP API over real HTTP, fed by a real daemon and a worker moving bytes."""

from __future__ import annotations

import json
import os
import urllib.error

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import tier_manager_process
from tests.metrics.conftest import LAYERS, Traffic, get, wait_for
from tierstack import metric_catalog as mc
from tierstack.proto import node_metrics_pb2 as pb
from tierstack.proto import node_metrics_pb2_grpc as pb_grpc


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_node_snapshot_counts_exactly_the_bytes_the_worker_moved(metrics_daemon, traffic):
    for _ in range(3):
        traffic.one_pass()
    traffic.store.reports.send()  # the periodic report, now
    layer = traffic.store.layouts[0].nbytes
    node = get(metrics_daemon.url, "/api/v1/node")
    links = node["links"]
    # Every ensure_layer copied one layer from the CPU pool to the device.
    assert links["cpu->device"]["bytes_total"] == 3 * LAYERS * layer
    # register_layers uploaded every layer, and each pass wrote one back.
    assert links["device->cpu"]["bytes_total"] == (LAYERS + 3) * layer
    # NVMe figures are the daemon's own IO counters, as GetStats reports them.
    stats = traffic.store.tiers.stats()
    assert links["nvme->cpu"]["bytes_total"] == stats.nvme_bytes_read > 0
    assert links["cpu->nvme"]["bytes_total"] == stats.nvme_bytes_written > 0
    assert node["node"] == "test-node" and node["instance_id"] == stats.instance_id
    assert node["tiers"]["cpu"]["capacity_bytes"] == 16 << 20
    assert node["tiers"]["nvme"]["capacity_bytes"] == 256 << 20
    assert node["tiers"]["device"]["capacity_bytes"] == traffic.store.figures().device_capacity
    assert node["tiers"]["cpu"]["used_bytes"] == stats.cpu_used
    [worker] = node["workers"]
    assert worker["job"] == "metrics-test" and worker["device"] == "cpu"
    # No scheduler: the node runs no plan, and says so. register_layers declared the
    # layer order once: that is the access order, counted apart from plans.
    plan = node["plan"]
    assert plan["scheduler"] == "" and plan["jobs"] == []
    assert plan["access_order_version"] == 1 and plan["access_order_keys"] == LAYERS
    assert "furthest next use in the access order" in plan["eviction_policy"]
    assert get(metrics_daemon.url, "/api/v1/plan") == plan


def test_history_shows_bandwidth_while_bytes_move_and_peaks_bound_it(metrics_daemon, traffic):
    traffic.run_for(30)

    def moving():
        h = get(metrics_daemon.url, "/api/v1/node/history?window_seconds=60")
        busy = [s for s in h["samples"] if s["links"]["nvme->cpu"] > 0 and s["links"]["cpu->nvme"] > 0]
        return (h, busy) if len(busy) >= 2 else None

    history, busy = wait_for(moving, what="two samples with NVMe traffic both ways")
    assert history["interval_seconds"] == 0.25
    for link in mc.LINKS:
        assert history["peaks"][link] >= max(s["links"][link] for s in history["samples"])
    assert [s["timestamp"] for s in history["samples"]] == sorted(s["timestamp"] for s in history["samples"])
    # A layer store's device never holds more than its budget, in every sample.
    assert all(s["tiers_used"]["device"] <= traffic.store.figures().device_capacity for s in history["samples"])

    # The worker is counted once its first report is in (it reports once a second).
    cluster = wait_for(lambda: (c := get(metrics_daemon.url, "/api/v1/cluster"))["workers"] and c,
                       what="the worker's first report in the cluster view")
    assert [n["node"] for n in cluster["nodes"]] == ["test-node"] and cluster["unreachable"] == []
    assert cluster["workers"] == 1
    totals = get(metrics_daemon.url, "/api/v1/cluster/history?window_seconds=60")
    assert totals["total"]["node"] == "cluster" and len(totals["nodes"]) == 1
    assert max(s["links"]["nvme->cpu"] for s in totals["total"]["samples"]) > 0


def test_metrics_pass_promtool_and_agree_with_the_snapshot(metrics_daemon, traffic, tmp_path):
    import shutil
    import subprocess

    for _ in range(2):
        traffic.train_pass()  # two steps: the training gauges have every figure
    traffic.store.reports.send()
    text = get(metrics_daemon.url, "/metrics", parse=False)
    promtool = shutil.which("promtool")
    if promtool is None:
        assert os.environ.get("CI") != "true", "no promtool in CI: make's system-packages step failed"
        pytest.skip("promtool is not installed (Debian's prometheus package; `make test` installs it)")
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert lint.returncode == 0 and lint.stdout.strip() == "" and lint.stderr.strip() == "", \
        lint.stdout + lint.stderr
    (tmp_path / "metrics.txt").write_text(text)

    values = samples(text)
    names = {name for name, _ in values}
    # Every family the catalog lists for a node is there, with samples.
    for spec in mc.NODE_METRICS:
        if spec in (mc.RPC_FAILURES, mc.PLAN_VERSION):
            continue  # none failed yet; no scheduler, so no plan (tests/scheduler checks it)
        assert set(spec.sample_names) <= names, spec.name
    node = get(metrics_daemon.url, "/api/v1/node")
    for link in node["links_present"]:  # this machine's: no cpu<->device (test_training)
        assert values[("tierstack_link_bytes_total", (("link", link),))] == \
            node["links"][link]["bytes_total"]
    worker = traffic.store.reports.worker_id
    # Each layer load used (and released) is one observation of the wait for it.
    assert values[("tierstack_worker_ensure_layer_wait_seconds_count", (("worker", worker),))] == 2 * LAYERS
    assert values[("tierstack_rpc_duration_seconds_count", (("method", "Fetch"),))] >= 2 * LAYERS
    # Without a scheduler the node runs no plan: the family is there, with no job in it.
    assert f"# TYPE {mc.PLAN_VERSION.name} gauge" in text
    assert not any(name == mc.PLAN_VERSION.name for name, _ in values)


def test_failed_rpcs_are_counted_by_method_and_status(metrics_daemon, traffic):
    from tierstack.errors import KeyNotFoundError

    with pytest.raises(KeyNotFoundError):
        traffic.store.client.describe("no/such/key")
    values = samples(get(metrics_daemon.url, "/metrics", parse=False))
    assert values[("tierstack_rpc_failures_total",
                   (("code", "NOT_FOUND"), ("method", "Describe")))] == 1


def test_health_and_the_generated_openapi_schema(metrics_daemon):
    assert get(metrics_daemon.url, "/healthz") == {"status": "serving", "node": "test-node"}
    schema = get(metrics_daemon.url, "/openapi.json")
    assert {"/metrics", "/api/v1/node", "/api/v1/node/history", "/api/v1/plan",
            "/api/v1/cluster", "/api/v1/cluster/history"} <= set(schema["paths"])
    assert {"NodeSnapshot", "ClusterSnapshot", "History"} <= set(schema["components"]["schemas"])
    with pytest.raises(urllib.error.HTTPError) as bad:
        get(metrics_daemon.url, "/api/v1/node/history?window_seconds=-5")
    assert bad.value.code == 422
    assert "tierstack" in get(metrics_daemon.url, "/dashboard/", parse=False)


def test_cluster_view_adds_up_nodes_and_names_the_one_that_does_not_answer(
        metrics_daemon, traffic, tmp_path, shm_dir):
    traffic.one_pass()
    traffic.store.reports.send()
    dead = "http://127.0.0.1:9"  # the discard port: nothing serves HTTP there
    config = tmp_path / "second.json"
    config.write_text(json.dumps({"tier_manager": {
        "cpu_pool": {"size": "8MiB", "shm_dir": str(shm_dir)},
        "nvme_pool": {"paths": [str(tmp_path / "second-nvme")], "size": "64MiB"},
        "manifest_path": str(tmp_path / "second.sqlite"),
        "metrics": {"http_listen": "127.0.0.1:0", "node_name": "second",
                    "cluster_nodes": [metrics_daemon.url, dead]}}}))
    second = tier_manager_process(config, tmp_path / "second.sock").start()
    try:
        with grpc.insecure_channel(second.address) as channel:
            url = pb_grpc.NodeMetricsStub(channel).GetHttpEndpoint(pb.GetHttpEndpointRequest()).url
        cluster = get(url, "/api/v1/cluster")
        assert sorted(n["node"] for n in cluster["nodes"]) == ["second", "test-node"]
        assert [u["node"] for u in cluster["unreachable"]] == [dead]
        first = next(n for n in cluster["nodes"] if n["node"] == "test-node")
        assert cluster["links"]["cpu->device"]["bytes_total"] == first["links"]["cpu->device"]["bytes_total"] > 0
        assert cluster["tiers"]["cpu"]["capacity_bytes"] == (16 << 20) + (8 << 20)
        history = get(url, "/api/v1/cluster/history?window_seconds=30")
        assert sorted(h["node"] for h in history["nodes"]) == ["second", "test-node"]
    finally:
        second.kill()


def test_a_departed_worker_keeps_its_bytes_in_the_node_totals(metrics_daemon):
    traffic = Traffic(metrics_daemon.address)
    traffic.one_pass()
    moved = LAYERS * traffic.store.layouts[0].nbytes
    traffic.stop()  # sends a last report
    assert get(metrics_daemon.url, "/api/v1/node")["links"]["cpu->device"]["bytes_total"] == moved
    # After worker_stale_seconds (5 s here) it no longer counts as connected...
    node = wait_for(lambda: (n := get(metrics_daemon.url, "/api/v1/node"))["workers"] == [] and n,
                    timeout=20, what="the worker to be retired")
    # ...and its bytes still do: counters never go down.
    assert node["links"]["cpu->device"]["bytes_total"] == moved
    assert node["tiers"]["device"]["capacity_bytes"] == 0


def test_a_report_with_other_buckets_is_refused_with_the_reason(metrics_daemon):
    with grpc.insecure_channel(metrics_daemon.address) as channel:
        stub = pb_grpc.NodeMetricsStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.ReportWorker(pb.WorkerReport(worker_id="w", wait_bucket_bounds=[1.0],
                                              wait_bucket_counts=[0, 0]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "same tierstack version" in e.value.details()


def test_with_metrics_disabled_the_daemon_serves_and_workers_still_train(tmp_path, shm_dir):
    config = tmp_path / "off.json"
    config.write_text(json.dumps({"tier_manager": {
        "cpu_pool": {"size": "16MiB", "shm_dir": str(shm_dir)},
        "nvme_pool": {"paths": [str(tmp_path / "nvme")], "size": "128MiB"},
        "manifest_path": str(tmp_path / "off.sqlite"), "metrics": {"enabled": False}}}))
    daemon = tier_manager_process(config, tmp_path / "off.sock").start()
    try:
        traffic = Traffic(daemon.address)
        traffic.one_pass()
        assert traffic.store.reports.dashboard_url() == ""
        assert traffic.store.reports.send() is False  # the daemon takes no reports
        traffic.stop()
    finally:
        daemon.kill()


def test_a_cluster_only_app_as_the_scheduler_will_serve_it(metrics_daemon, traffic):
    """The seam for the scheduler: its own app over a ClusterView of its node list."""
    from prometheus_client import CollectorRegistry, Gauge

    from tierstack.metric_catalog import SCHEDULER_NODES
    from tierstack.dashboards.cluster_view import ClusterView, RemoteNode
    from tierstack.dashboards.http_api import HttpServer, create_app

    traffic.one_pass()
    traffic.store.reports.send()
    registry = CollectorRegistry()
    Gauge(SCHEDULER_NODES.name, SCHEDULER_NODES.help, registry=registry).set(1)
    nodes = [RemoteNode(metrics_daemon.url)]
    server = HttpServer(create_app(ClusterView(lambda: nodes), lambda: True, registry=registry),
                        "127.0.0.1:0", "scheduler.metrics_listen")
    server.start()
    try:
        cluster = get(server.url, "/api/v1/cluster")
        assert [n["node"] for n in cluster["nodes"]] == ["test-node"]
        assert cluster["links"]["cpu->device"]["bytes_total"] == LAYERS * traffic.store.layouts[0].nbytes
        assert "tierstack_scheduler_nodes 1.0" in get(server.url, "/metrics", parse=False)
        assert "/api/v1/node" not in get(server.url, "/openapi.json")["paths"]
        assert "tierstack" in get(server.url, "/dashboard/", parse=False)
    finally:
        server.stop()
