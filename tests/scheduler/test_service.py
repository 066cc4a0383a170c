"""The scheduler as a real process: registration, plans, watch streams, drift re-planning,
and a real tier manager + worker following its plans (the worker its prefetch depths,
the tier manager its tiers: what it evicts)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

import grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import tier_manager_process
from tests.metrics.conftest import get, wait_for
from tierstack.services.scheduler.synthetic import node, transformer_trace
from tests.worker.pass_worker import bit_equal, make_layer
from tierstack.config import SchedulerConfig
from tierstack.errors import InvalidArgumentError, KeyNotFoundError, SchedulerUnavailableError
from tierstack.services.scheduler.client import SchedulerClient
from tierstack.services.scheduler.embedded import EmbeddedScheduler
from tierstack.proto import node_metrics_pb2, node_metrics_pb2_grpc
from tierstack.services.scheduler.model import NVME, Bandwidths
from tierstack.worker.plans.watcher import PlanWatcher
from tierstack.worker.store.layer_store import LayerStore
from tierstack.worker.plans.follower import PlanFollower

FAST_REPLAN = SchedulerConfig(report_interval_seconds=0.2, replan_threshold=0.25, replan_after_seconds=0.5)
# No drift re-plans: a test's plan versions come only from what the test does.
STEADY = SchedulerConfig(report_interval_seconds=0.2, replan_after_seconds=3600.0)


@pytest.fixture
def scheduler():
    with EmbeddedScheduler(FAST_REPLAN) as s:
        yield s


@pytest.fixture
def steady_scheduler():
    with EmbeddedScheduler(STEADY) as s:
        yield s


def test_plans_are_versioned_watched_and_replanned_only_on_sustained_drift(scheduler):
    client = SchedulerClient(scheduler.address)
    nd = node("n0", gpu_gb=0.3, cpu_gb=0.3)  # most parameters stream from NVMe
    assert client.register_node(nd) == pytest.approx(0.2)
    trace = transformer_trace(layers=16, forward_s=0.004, nodes=("n0",), kinds=("params",))
    v1 = client.report_trace(trace)
    assert v1.version == 1 and v1.fits and set(v1.nodes) == {"n0"}
    assert client.plan("job").version == 1
    watcher = PlanWatcher(client, "job").start()
    assert watcher.wait_for_version(1, timeout=10).version == 1

    slow = Bandwidths(disk_read=nd.bandwidth.disk_read / 4)
    # A burst: off the assumption, then back in range before the window ends.
    client.report_bandwidth("n0", slow)
    client.report_bandwidth("n0", Bandwidths(disk_read=nd.bandwidth.disk_read))
    time.sleep(0.6)
    assert client.report_bandwidth("n0", Bandwidths(disk_read=nd.bandwidth.disk_read * 1.1)) == []
    assert client.plan("job").version == 1

    # Sustained: every report off for longer than replan_after_seconds.
    replanned = []
    deadline = time.time() + 10
    while not replanned and time.time() < deadline:
        replanned = client.report_bandwidth("n0", slow)
        time.sleep(0.1)
    assert replanned == ["job"]
    v2 = watcher.wait_for_version(2, timeout=10)
    assert v2 is not None and "drift" in v2.reason and "disk_read" in v2.reason
    assert v2.nodes["n0"].assumed.disk_read == pytest.approx(slow.disk_read)
    assert client.node_bandwidths()["n0"].disk_read == pytest.approx(slow.disk_read)
    # A slower disk under streamed parameters: the new plan predicts a slower step.
    assert v2.predicted_step_seconds > v1.predicted_step_seconds
    watcher.close()
    client.close()


def test_a_node_watches_the_plans_of_the_jobs_on_it(scheduler):
    """WatchNodePlans: every plan of the node's jobs now (a full update, even when none),
    then each new version and each forgotten job; other nodes' jobs never show."""
    client = SchedulerClient(scheduler.address)
    for name in ("n0", "n1"):
        client.register_node(node(name, gpu_gb=0.3, cpu_gb=0.3))
    client.report_trace(transformer_trace(layers=4, nodes=("n0", "n1"), job="both"))
    stream = client.watch_node_plans("n0")
    updates = iter(stream)
    first = next(updates)
    assert first.full and first.node_id == "n0" and first.forgotten == []
    [both] = first.plans
    assert (both.job, both.version, both.reason) == ("both", 1, "trace")
    assert both.plan.node_id == "n0"  # this node's part only
    assert both.tensor_keys == [f"both/layer{i}/{k}" for i in range(4)
                                for k in ("params", "grad", "optimizer")]
    assert len(both.plan.tiers) == len(both.tensor_keys)

    client.report_trace(transformer_trace(layers=4, nodes=("n1",), job="elsewhere"))
    client.report_trace(transformer_trace(layers=4, nodes=("n0",), job="here"))
    update = next(updates)
    assert not update.full and [(p.job, p.version) for p in update.plans] == [("here", 1)]
    client.forget_job("both")
    update = next(updates)
    assert update.plans == [] and update.forgotten == ["both"]
    stream.cancel()
    with pytest.raises(SchedulerUnavailableError, match="WatchNodePlans"):
        next(updates)
    client.close()


def test_bad_requests_get_statuses_that_name_the_problem(scheduler):
    client = SchedulerClient(scheduler.address)
    with pytest.raises(KeyNotFoundError, match="ghost"):
        client.report_bandwidth("ghost", Bandwidths(disk_read=1e9))
    with pytest.raises(KeyNotFoundError, match="no plan for job"):
        client.plan("nobody")
    with pytest.raises(InvalidArgumentError, match="never registered"):
        client.report_trace(transformer_trace(nodes=("n9",)))
    client.register_node(node("n0"))
    bad = transformer_trace(nodes=("n0",))
    bad.tier_overrides = {"*": "tape"}
    with pytest.raises(InvalidArgumentError, match="tape"):
        client.report_trace(bad)
    with pytest.raises(InvalidArgumentError, match="unknown"):
        client.register_node(node("n1", disk_gbs=0))
    with pytest.raises(InvalidArgumentError, match="node_id"):
        next(iter(client.watch_node_plans("")))
    client.close()


def _tier_manager(tmp_path, daemon_config, scheduler_address, node_id, http: bool = False):
    data = json.loads(daemon_config.read_text())
    data["tier_manager"].update(scheduler_address=scheduler_address, node_id=node_id)
    if http:
        data["tier_manager"]["metrics"] = {"http_listen": "127.0.0.1:0", "node_name": node_id}
    daemon_config.write_text(json.dumps(data))
    daemon = tier_manager_process(daemon_config, tmp_path / "tm.sock").start()
    if http:
        with grpc.insecure_channel(daemon.address) as channel:
            daemon.url = node_metrics_pb2_grpc.NodeMetricsStub(channel).GetHttpEndpoint(
                node_metrics_pb2.GetHttpEndpointRequest(), timeout=10).url
    return daemon


def _node_plans(daemon) -> dict[str, int]:
    """job -> the scheduler plan version the node runs, from its own HTTP API."""
    return {j["job"]: j["version"] for j in get(daemon.url, "/api/v1/plan")["jobs"]}


def _plan_version_samples(daemon) -> dict[str, float]:
    """job -> tierstack_plan_version{job} as the node's /metrics exports it."""
    families = text_string_to_metric_families(get(daemon.url, "/metrics", parse=False))
    return {s.labels["job"]: s.value for f in families if f.name == "tierstack_plan_version"
            for s in f.samples}


def test_tier_manager_registers_its_probed_node_and_reports_disk_bandwidth(scheduler, tmp_path, daemon_config):
    daemon = _tier_manager(tmp_path, daemon_config, scheduler.address, "node-a")
    try:
        client = SchedulerClient(scheduler.address)
        deadline = time.time() + 30
        while not client.list_nodes() and time.time() < deadline:
            time.sleep(0.1)
        (state,) = client.list_nodes()
        assert state.node.node_id == "node-a"
        assert state.node.cpu_bytes == 16 << 20 and state.node.nvme_bytes == 256 << 20
        probe = state.node.bandwidth
        assert min(probe.disk_read, probe.disk_write, probe.h2d, probe.d2h) > 1e6
        # Traffic through the daemon shows up as a measured disk bandwidth.
        with LayerStore("traffic", device="cpu", address=daemon.address, device_budget=64 << 20) as store:
            store.register_layers([make_layer(7, i) for i in range(60)])  # > the CPU pool
            for _ in range(3):
                for i in range(60):
                    store.ensure_layer(i)
                    store.release_layer(i)
                time.sleep(0.3)
                measured = [s.last_measured.disk_read for s in client.list_nodes()]
                if measured[0] > 0:
                    break
        assert measured[0] > 1e6
        client.close()
    finally:
        daemon.kill()


LAYER_ELEMENTS = 1 << 19  # float32: 2 MiB per layer


def _sweep(store, layers: int) -> None:
    """Forward then backward over the layers, each layer checked (no compute)."""
    for step, i in enumerate(list(range(layers)) + list(reversed(range(layers)))):
        got = store.ensure_layer(i)
        store.prefetch_ahead(i, 1 if step < layers else -1)
        assert torch.equal(got["w"], torch.full((LAYER_ELEMENTS,), float(i)))
        store.release_layer(i)


def test_tier_manager_follows_its_jobs_plans_and_evicts_what_they_put_on_nvme(
        steady_scheduler, tmp_path, daemon_config):
    """Scheduler -> tier manager: the node's registry runs each job's newest plan (its
    /api/v1/plan and tierstack_plan_version{job} say which) and, with a CPU pool that
    cannot hold every layer, evicts the layers the plan streams from NVMe, never those it
    keeps in the pool. Forgetting the job drops its plan on the node."""
    scheduler = steady_scheduler
    daemon = _tier_manager(tmp_path, daemon_config, scheduler.address, "node-a", http=True)
    client = SchedulerClient(scheduler.address)
    layers = 12  # 24 MiB of layers through a 16 MiB CPU pool
    try:
        wait_for(client.list_nodes, what="the tier manager to register", timeout=30)
        plan_page = get(daemon.url, "/api/v1/plan")
        assert plan_page["scheduler"] == scheduler.address and plan_page["jobs"] == []
        with LayerStore("planned", device="cpu", address=daemon.address,
                        device_budget=4 * 4 * LAYER_ELEMENTS) as store:
            store.register_layers([{"w": torch.full((LAYER_ELEMENTS,), float(i))} for i in range(layers)])
            follower = PlanFollower(store, scheduler.address, node_id="node-a")
            _sweep(store, layers)
            plan = follower.report_trace()
            keys = [store.key(i) for i in range(layers)]
            tiers = plan.nodes["node-a"].tiers
            streamed = {k for k, tier in zip(keys, tiers) if tier == NVME}
            kept = set(keys) - streamed
            assert streamed and kept, "the plan should split the layers between the tiers"

            wait_for(lambda: _node_plans(daemon) == {"planned": 1}, what="plan v1 on the node", timeout=10)
            [job] = get(daemon.url, "/api/v1/plan")["jobs"]
            assert (job["reason"], job["tensor_keys"]) == ("trace", layers)
            assert _plan_version_samples(daemon) == {"planned": 1.0}
            evictions = store.tiers.stats().evictions
            for _ in range(2):
                _sweep(store, layers)
            assert store.tiers.stats().evictions > evictions  # the pool was full: it chose
            resident = {k for k in keys if store.client.describe(k).in_cpu}
            assert kept <= resident, f"evicted although the plan keeps them: {sorted(kept - resident)}"

            # A new version reaches the node (the node registered again: a re-plan)...
            client.register_node(client.nodes()["node-a"])
            wait_for(lambda: _node_plans(daemon) == {"planned": 2}, what="plan v2 on the node", timeout=10)
            assert _plan_version_samples(daemon) == {"planned": 2.0}
            # ...and a job the scheduler forgets is forgotten on the node.
            follower.close()
            client.forget_job("planned")
            wait_for(lambda: _node_plans(daemon) == {}, what="the plan to be dropped", timeout=10)
            assert _plan_version_samples(daemon) == {}
    finally:
        client.close()
        daemon.kill()


def test_the_node_follows_plans_across_a_scheduler_restart(tmp_path, daemon_config):
    """A restarted scheduler knows no job: the node's plan stream, opened again, drops the
    plans it ran, and the node (registered again by itself) follows the new ones."""
    address = f"unix:{tmp_path / 'scheduler.sock'}"
    scheduler = EmbeddedScheduler(STEADY, listen=address, workdir=tmp_path / "scheduler")
    scheduler.start()
    daemon = _tier_manager(tmp_path, daemon_config, address, "node-a", http=True)
    client = SchedulerClient(address)

    def trace(job: str):
        t = transformer_trace(layers=4, param_bytes=1e6, nodes=("node-a",), job=job)
        t.device_budget = 8 << 20
        return t

    try:
        wait_for(client.list_nodes, what="the tier manager to register", timeout=30)
        client.report_trace(trace("before"))
        wait_for(lambda: _node_plans(daemon) == {"before": 1}, what="the plan on the node", timeout=10)
        scheduler.kill()  # a crash: the scheduler forgets every node and job
        client.close()
        scheduler.start()
        client = SchedulerClient(address)
        wait_for(lambda: _node_plans(daemon) == {}, what="the stale plan to be dropped", timeout=30)
        wait_for(client.list_nodes, what="the tier manager to register again", timeout=30)
        client.report_trace(trace("after"))
        wait_for(lambda: _node_plans(daemon) == {"after": 1}, what="the new plan on the node", timeout=10)
        assert _plan_version_samples(daemon) == {"after": 1.0}
    finally:
        client.close()
        daemon.kill()
        scheduler.kill()


def _iteration(store, layers, seed, verify_errors, compute):
    """Forward then backward over the layers, every byte checked, with real compute."""
    order = list(range(layers)) + list(reversed(range(layers)))
    for step, i in enumerate(order):
        got = store.ensure_layer(i)
        store.prefetch_ahead(i, 1 if step < layers else -1)
        expected = make_layer(seed, i)
        if set(got) != set(expected) or not all(bit_equal(got[k], expected[k]) for k in got):
            verify_errors.append((step, i))
        compute()
        store.release_layer(i)


def test_worker_switches_plans_mid_run_without_losing_or_corrupting_a_layer(scheduler, tmp_path, daemon_config):
    daemon = _tier_manager(tmp_path, daemon_config, scheduler.address, "node-a")
    client = SchedulerClient(scheduler.address)
    layers, seed = 20, 11
    a = torch.randn(256, 256)

    def compute():  # a little real work per layer, as a model's layer would do
        for _ in range(4):
            torch.mm(a, a)

    try:
        deadline = time.time() + 30
        while not client.list_nodes() and time.time() < deadline:
            time.sleep(0.1)
        budget = 8 * max(sum(v.numel() * v.element_size() for v in make_layer(seed, i).values())
                         for i in range(layers))
        with LayerStore("switch", device="cpu", address=daemon.address, device_budget=budget) as store:
            store.register_layers([make_layer(seed, i) for i in range(layers)])
            follower = PlanFollower(store, scheduler.address, node_id="node-a")
            errors: list = []
            _iteration(store, layers, seed, errors, compute)
            v1 = follower.report_trace()
            first = v1.nodes["node-a"]
            # The plan's placement goes to the node's tier manager, not the worker (see
            # test_tier_manager_follows_its_jobs_plans_and_evicts_what_they_put_on_nvme): nothing pinned here.
            assert store.placements == {}
            _iteration(store, layers, seed, errors, compute)
            assert store.figures().plan_version == 1 and store.figures().prefetch_depth == first.prefetch_depth

            # The node's device link slows to a crawl (a neighbour's copies, throttling):
            # reported for longer than the re-plan window while the worker keeps training.
            probe = client.node_bandwidths()["node-a"]
            stop = threading.Event()

            def drift():
                while not stop.is_set():
                    client.report_bandwidth("node-a", Bandwidths(h2d=probe.h2d / 500))
                    stop.wait(0.1)

            reporter = threading.Thread(target=drift, daemon=True)
            reporter.start()
            iterations = 0
            deadline = time.time() + 60
            while store.figures().plan_version < 2 and time.time() < deadline:
                _iteration(store, layers, seed, errors, compute)
                iterations += 1
            stop.set()
            reporter.join()
            _iteration(store, layers, seed, errors, compute)  # one more under the new plan
            assert store.figures().plan_version >= 2, "no new plan reached the worker"
            second = follower.plan.nodes["node-a"]
            assert "drift" in follower.plan.reason
            # Planned for the slow link (the depth it picks depends on how the copies
            # compare with the measured compute, which the machine's load moves).
            assert second.assumed.h2d < first.assumed.h2d / 100
            assert second.predicted_step_seconds >= first.predicted_step_seconds
            assert store.figures().prefetch_depth == second.prefetch_depth
            # Every switch happened at a layer boundary, between two ensure_layer calls.
            (switch_at, version, depth) = list(store.figures().plan_switches)[-1]
            assert version >= 2 and depth == second.prefetch_depth and switch_at > 0
            assert errors == []  # every byte of every layer, before, across and after the switch
            assert store.figures().device_peak <= store.figures().device_capacity
            assert store.resident_layers() == []
            follower.close()
            stats = store.tiers.stats()
            assert stats.pinned == 0 and stats.checksum_failures == 0
    finally:
        client.close()
        daemon.kill()


def test_worker_reports_its_trace_again_after_the_scheduler_restarts(daemon, tmp_path):
    address = f"unix:{tmp_path / 'scheduler.sock'}"
    process = EmbeddedScheduler(listen=address, workdir=tmp_path / "scheduler")

    def start():
        process.start()
        client = SchedulerClient(address)
        client.register_node(node("node-a", gpu_gb=0.1, cpu_gb=0.1))  # as its tier manager would
        return process, client

    proc, client = start()
    layers, seed = 6, 5
    with LayerStore("again", device="cpu", address=daemon.address, device_budget=32 << 20) as store:
        store.register_layers([make_layer(seed, i) for i in range(layers)])
        follower = PlanFollower(store, address, node_id="node-a")
        errors: list = []
        _iteration(store, layers, seed, errors, lambda: None)
        assert follower.report_trace().version == 1
        proc.kill()  # a crash: the scheduler forgets every node and job
        client.close()
        proc, client = start()
        try:
            deadline = time.time() + 30
            while time.time() < deadline:
                try:
                    client.plan("again")
                    break
                except KeyNotFoundError:
                    time.sleep(0.2)
            assert client.plan("again").version == 1  # the worker reported its trace again
            _iteration(store, layers, seed, errors, lambda: None)
            assert store.figures().plan_version == 1 and errors == []
            follower.close()
        finally:
            client.close()
            proc.kill()
