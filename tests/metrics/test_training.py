"""The training view: a worker's loop reports its steps, the node shows them per job.

The pace is measured on the worker (WorkerMetrics.training_step, over its recent steps);
the node combines a job's workers (dashboards/training_view.py) and serves the figures in
its JSON and as Prometheus gauges, against a real daemon over real gRPC and HTTP.
"""

from __future__ import annotations

import math
import time

import grpc
import pytest

from tests.metrics.conftest import (LEARNING_RATE, TOKENS_PER_STEP, TOTAL_STEPS, Traffic, get,
                                    wait_for)
from tests.metrics.test_http_api import samples
from tierstack import metric_catalog as mc
from tierstack.dashboards import training_view
from tierstack.errors import InvalidArgumentError
from tierstack.proto import node_metrics_pb2 as pb
from tierstack.proto import node_metrics_pb2_grpc as pb_grpc
from tierstack.worker.store import worker_metrics
from tierstack.worker.store.worker_metrics import RATE_WINDOW_STEPS, WorkerMetrics


class FakeClock:
    """time.monotonic for worker_metrics, moved by hand: the pace is arithmetic, not timing."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(worker_metrics.time, "monotonic", fake)
    return fake


def report_of(metrics: WorkerMetrics, job: str = "job"):
    return metrics.report("w", job, "cpu", 0.0, 0, 0, 0).training


# ---- the worker's side -----------------------------------------------------------------------


def test_a_step_reports_its_figures_and_the_pace_of_the_recent_steps(clock):
    metrics = WorkerMetrics()
    assert report_of(metrics) is None  # no step yet: the report carries no training
    metrics.training_step(1, 2.5, 1000, learning_rate=1e-3, total_steps=50)
    first = report_of(metrics)
    assert (first.job, first.step, first.loss, first.learning_rate, first.total_steps) == \
        ("job", 1, 2.5, 1e-3, 50)
    assert first.tokens == 1000
    assert first.tokens_per_second == first.seconds_per_step == 0.0  # one step: no pace yet
    # Steps of 0.5 s, then of 2 s: after RATE_WINDOW_STEPS slow steps only they count.
    for step in range(2, 6):
        clock.now += 0.5
        metrics.training_step(step, 2.0, 1000)
    fast = report_of(metrics)
    assert fast.tokens == 5000 and fast.tokens_per_second == pytest.approx(2000.0)
    assert fast.seconds_per_step == pytest.approx(0.5)
    assert fast.learning_rate is None and fast.total_steps is None  # as this step said
    for step in range(6, 6 + RATE_WINDOW_STEPS):
        clock.now += 2.0
        metrics.training_step(step, 1.0, 1000, total_steps=50)
    slow = report_of(metrics)
    assert slow.seconds_per_step == pytest.approx(2.0)
    assert slow.tokens_per_second == pytest.approx(500.0)


def test_a_loop_that_starts_over_measures_its_pace_afresh(clock):
    metrics = WorkerMetrics()
    for step in (1, 2, 3):
        clock.now += 1.0
        metrics.training_step(step, None, 100)
    clock.now += 60.0  # a checkpoint load between two runs in one process
    metrics.training_step(1, None, 100)
    again = report_of(metrics)
    assert again.step == 1 and again.seconds_per_step == 0.0 and again.tokens_per_second == 0.0
    assert again.tokens == 400 and again.loss is None  # tokens count every step trained
    clock.now += 1.0
    metrics.training_step(2, None, 100)
    assert report_of(metrics).seconds_per_step == pytest.approx(1.0)


def test_a_negative_count_or_a_learning_rate_that_is_no_number_is_refused_with_what_to_pass():
    with pytest.raises(InvalidArgumentError, match="total_steps=None"):
        WorkerMetrics().training_step(1, 1.0, 10, total_steps=-1)
    with pytest.raises(InvalidArgumentError, match="counts are >= 0"):
        WorkerMetrics().training_step(1, 1.0, -10)
    # Refused here, or the node would refuse the worker's whole report, its bytes too.
    with pytest.raises(InvalidArgumentError, match="learning-rate schedule"):
        WorkerMetrics().training_step(1, 1.0, 10, learning_rate=float("nan"))


def test_a_ranks_store_reports_its_jobs_name():
    metrics = WorkerMetrics()
    metrics.training_step(1, 1.0, 10)
    assert report_of(metrics, "llama.rank3of8").job == "llama"
    assert report_of(metrics, "llama.v2").job == "llama.v2"


# ---- one rule for a job's workers ---------------------------------------------------------


def step_of(job="j", step=10, loss=1.0, total=None, lr=None, tokens=100, rate=50.0, pace=0.5):
    return training_view.training_step(job, step, total, loss, lr, tokens, rate, pace)


def test_a_jobs_loss_is_the_mean_of_its_workers_at_its_furthest_step():
    [job] = training_view.combine([step_of(step=10, loss=2.0, lr=1e-4, total=110),
                                   step_of(step=10, loss=3.0, lr=1e-4, pace=0.7),
                                   step_of(step=9, loss=9.0)])  # one step behind: left out
    assert (job.step, job.loss, job.loss_workers, job.workers) == (10, 2.5, 2, 3)
    assert job.tokens == 300 and job.tokens_per_second == 150.0
    assert job.learning_rate == 1e-4 and job.total_steps == 110
    assert job.eta_seconds == pytest.approx(100 * 0.7)  # the slowest worker's pace
    [other, j] = training_view.combine([step_of(job="j"), step_of(job="b", loss=None)])
    assert other.job == "b" and other.loss is None and other.loss_finite and other.loss_workers == 0
    assert j.eta_seconds is None  # no total: no ETA


def test_a_diverged_loss_shows_as_not_finite():
    [job] = training_view.combine([step_of(loss=float("nan")), step_of(loss=1.0)])
    assert job.loss is None and not job.loss_finite and job.loss_workers == 2
    assert training_view.merge_loss_histories([[(1, 2.0), (2, 1.0)], [(2, 3.0), (3, 1.5)]], 2) == \
        [(2, 2.0), (3, 1.5)]


def test_figures_past_a_floats_range_stay_numbers_json_can_carry():
    """Else a node reading this one's snapshot would find nulls where numbers are due."""
    [job] = training_view.combine([step_of(step=0, total=2**64 - 1, rate=1e308, pace=1e308,
                                           loss=1e308)] * 2)
    assert job.eta_seconds is None and math.isfinite(job.tokens_per_second)
    assert job.loss == 1e308


# ---- through a real daemon ------------------------------------------------------------------


def test_a_jobs_step_loss_pace_and_eta_reach_the_json_and_the_metrics(metrics_daemon, traffic):
    for _ in range(3):
        traffic.train_pass()
    traffic.store.reports.send()
    sent = traffic.store.reports.report().training  # exactly what the worker reported
    assert sent.tokens_per_second > 0 and sent.seconds_per_step > 0

    node = get(metrics_daemon.url, "/api/v1/node")
    [job] = node["training"]
    assert job["job"] == "metrics-test" and job["workers"] == 1 and job["loss_workers"] == 1
    assert (job["step"], job["total_steps"]) == (3, TOTAL_STEPS)
    assert job["loss"] == Traffic.loss_at(3) and job["loss_finite"] is True
    assert job["learning_rate"] == LEARNING_RATE
    assert job["tokens"] == 3 * TOKENS_PER_STEP
    assert job["tokens_per_second"] == sent.tokens_per_second
    assert job["seconds_per_step"] == sent.seconds_per_step
    assert job["eta_seconds"] == pytest.approx((TOTAL_STEPS - 3) * sent.seconds_per_step)
    [worker] = node["workers"]
    assert worker["training"]["job"] == "metrics-test" and worker["training"]["step"] == 3
    # The cluster view combines the same workers by the same rule.
    cluster_job = get(metrics_daemon.url, "/api/v1/cluster")["training"][0]
    assert {k: v for k, v in cluster_job.items() if k != "loss_history"} == \
        {k: v for k, v in job.items() if k != "loss_history"}

    values = samples(get(metrics_daemon.url, "/metrics", parse=False))
    label = (("job", "metrics-test"),)
    assert values[(mc.TRAINING_STEP.name, label)] == 3
    assert values[(mc.TRAINING_TOTAL_STEPS.name, label)] == TOTAL_STEPS
    assert values[(mc.TRAINING_LOSS.name, label)] == Traffic.loss_at(3)
    assert values[(mc.TRAINING_LEARNING_RATE.name, label)] == LEARNING_RATE
    assert values[(mc.TRAINING_TOKENS.name, label)] == 3 * TOKENS_PER_STEP
    assert values[(mc.TRAINING_TOKENS_PER_SECOND.name, label)] == pytest.approx(sent.tokens_per_second)
    assert values[(mc.TRAINING_SECONDS_PER_STEP.name, label)] == pytest.approx(sent.seconds_per_step)
    assert values[(mc.TRAINING_ETA.name, label)] == pytest.approx(job["eta_seconds"])

    # The sampler keeps the loss at each step it sees, for the dashboard's sparkline.
    traffic.train_pass()
    traffic.store.reports.send()
    history = wait_for(lambda: (h := get(metrics_daemon.url, "/api/v1/node")["training"][0]
                                ["loss_history"]) and h[-1][0] == 4 and h,
                       what="the loss at step 4 in the job's history")
    assert history[-1] == [4, Traffic.loss_at(4)]
    assert [step for step, _ in history] == sorted({step for step, _ in history})


def test_the_ranks_of_a_job_are_one_job(metrics_daemon):
    from tierstack.worker.store.layer_store import LayerStore

    ranks = [LayerStore(f"ranked.rank{r}of2", device="cpu", device_budget=1 << 20,
                        address=metrics_daemon.address, durable=False) for r in range(2)]
    try:
        for rank, loss in zip(ranks, (2.0, 3.0)):
            rank.reports.training(7, loss, 100, learning_rate=0.01)
            rank.reports.send()
        [job] = get(metrics_daemon.url, "/api/v1/node")["training"]
        assert (job["job"], job["workers"], job["step"], job["loss"], job["loss_workers"]) == \
            ("ranked", 2, 7, 2.5, 2)
        assert job["tokens"] == 200 and job["total_steps"] is None and job["eta_seconds"] is None
        ranks[1].reports.training(8, 1.0, 100, learning_rate=0.01)
        ranks[1].reports.send()
        [job] = get(metrics_daemon.url, "/api/v1/node")["training"]
        assert (job["step"], job["loss"], job["loss_workers"]) == (8, 1.0, 1)  # rank 0 is behind
    finally:
        for rank in ranks:
            rank.close()


def test_a_non_finite_loss_is_shown_not_finite_and_exported_as_nan(metrics_daemon, traffic):
    traffic.one_pass()
    traffic.store.reports.training(1, float("inf"), 10)
    traffic.store.reports.send()
    [job] = get(metrics_daemon.url, "/api/v1/node")["training"]
    assert job["loss"] is None and job["loss_finite"] is False and job["loss_workers"] == 1
    values = samples(get(metrics_daemon.url, "/metrics", parse=False))
    assert math.isnan(values[(mc.TRAINING_LOSS.name, (("job", "metrics-test"),))])


def test_a_store_without_metrics_reports_nothing(metrics_daemon):
    from tierstack.worker.store.layer_store import LayerStore

    store = LayerStore("quiet", device="cpu", device_budget=1 << 20, address=metrics_daemon.address,
                       durable=False, metrics=False)
    try:
        assert store.reports is None  # a job's steps go nowhere (worker/job.py checks)
    finally:
        store.close()
    assert get(metrics_daemon.url, "/api/v1/node")["training"] == []


def report(worker_id: str, device: str, **training) -> pb.WorkerReport:
    return pb.WorkerReport(worker_id=worker_id, job="j", device=device, timestamp=time.time(),
                           wait_bucket_bounds=mc.WAIT_BUCKETS,
                           wait_bucket_counts=[0] * (len(mc.WAIT_BUCKETS) + 1),
                           training=pb.TrainingFigures(**training) if training else None)


def test_a_cpu_only_node_has_no_device_link_until_a_worker_on_a_device_reports(metrics_daemon, traffic):
    for _ in range(2):
        traffic.one_pass()
    traffic.store.reports.send()
    node = get(metrics_daemon.url, "/api/v1/node")
    # This machine's workers run on the CPU: they read the pool in place, through no link.
    assert node["links_present"] == ["nvme->cpu", "cpu->nvme"]
    assert get(metrics_daemon.url, "/api/v1/cluster")["links_present"] == ["nvme->cpu", "cpu->nvme"]
    assert node["links"]["cpu->device"]["bandwidth_bytes_per_second"] == 0.0
    assert node["tiers"]["device"]["bandwidth_bytes_per_second"] == 0.0
    values = samples(get(metrics_daemon.url, "/metrics", parse=False))
    links = {dict(labels)["link"] for name, labels in values if name == mc.LINK_BYTES.name}
    assert links == {"nvme->cpu", "cpu->nvme"}
    history = get(metrics_daemon.url, "/api/v1/node/history?window_seconds=60")
    assert all(s["links"]["cpu->device"] == 0 for s in history["samples"])

    with grpc.insecure_channel(metrics_daemon.address) as channel:
        pb_grpc.NodeMetricsStub(channel).ReportWorker(report("gpu-worker", "cuda:0"), timeout=10)
    assert get(metrics_daemon.url, "/api/v1/node")["links_present"] == list(mc.LINKS)


def test_a_report_with_a_non_finite_learning_rate_or_pace_is_refused(metrics_daemon):
    with grpc.insecure_channel(metrics_daemon.address) as channel:
        stub = pb_grpc.NodeMetricsStub(channel)
        for bad in ({"learning_rate": float("nan")}, {"tokens_per_second": -1.0},
                    {"seconds_per_step": float("inf")}, {"job": "j" * 1000}):
            with pytest.raises(grpc.RpcError) as e:
                stub.ReportWorker(report("w", "cpu", step=1, **bad), timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
            assert "finite" in e.value.details()
        stub.ReportWorker(report("w", "cpu", step=1, loss=float("nan")), timeout=10)  # diverged: shown


def test_a_job_whose_ranks_report_to_two_nodes_is_one_job_in_the_cluster_view(
        metrics_daemon, tmp_path, shm_dir):
    import json

    from tests.conftest import tier_manager_process
    from tierstack.worker.store.layer_store import LayerStore

    config = tmp_path / "second.json"
    config.write_text(json.dumps({"tier_manager": {
        "cpu_pool": {"size": "8MiB", "shm_dir": str(shm_dir)},
        "nvme_pool": {"paths": [str(tmp_path / "second-nvme")], "size": "64MiB"},
        "manifest_path": str(tmp_path / "second.sqlite"),
        "metrics": {"http_listen": "127.0.0.1:0", "node_name": "second",
                    "sample_interval_seconds": 0.25, "cluster_nodes": [metrics_daemon.url]}}}))
    second = tier_manager_process(config, tmp_path / "second.sock").start()
    ranks = []
    try:
        with grpc.insecure_channel(second.address) as channel:
            url = pb_grpc.NodeMetricsStub(channel).GetHttpEndpoint(pb.GetHttpEndpointRequest()).url
        for rank, address in enumerate((metrics_daemon.address, second.address)):
            ranks.append(LayerStore(f"spread.rank{rank}of2", device="cpu", device_budget=1 << 20,
                                    address=address, durable=False))
        for rank, loss in zip(ranks, (1.0, 3.0)):
            rank.reports.training(5, loss, 64, learning_rate=0.5, total_steps=10)
            rank.reports.send()
        # Each node sees its own rank; the cluster view (read over HTTP) sees the job.
        assert [j["loss"] for j in get(url, "/api/v1/node")["training"]] == [3.0]

        for node in (metrics_daemon.url, url):  # each node's sampler has seen its rank's loss
            wait_for(lambda: get(node, "/api/v1/node")["training"][0]["loss_history"],
                     what=f"the loss history of {node}")
        [job] = get(url, "/api/v1/cluster")["training"]
        assert (job["job"], job["workers"], job["step"], job["loss"], job["loss_workers"]) == \
            ("spread", 2, 5, 2.0, 2)
        assert job["tokens"] == 128 and job["total_steps"] == 10
        assert job["loss_history"] == [[5, 2.0]]  # the two nodes' points at step 5, averaged
    finally:
        for rank in ranks:
            rank.close()
        second.kill()
