"""A real tier-manager daemon serving its HTTP API, and a worker moving real bytes."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from tests.conftest import tier_manager_process
from tierstack.proto import node_metrics_pb2 as pb
from tierstack.proto import node_metrics_pb2_grpc as pb_grpc


@pytest.fixture
def metrics_daemon(tmp_path: Path, shm_dir: Path):
    """A daemon with a 16 MiB CPU pool and metrics on a free port; `.url` is its HTTP API."""
    config = tmp_path / "tier-manager.json"
    config.write_text(json.dumps({"tier_manager": {
        "cpu_pool": {"size": "16MiB", "shm_dir": str(shm_dir)},
        "nvme_pool": {"paths": [str(tmp_path / "nvme0")], "size": "256MiB",
                      "aio": {"block_size": "256KiB", "queue_depth": 4}},
        "manifest_path": str(tmp_path / "manifest.sqlite"),
        "metrics": {"http_listen": "127.0.0.1:0", "node_name": "test-node",
                    "sample_interval_seconds": 0.25, "worker_stale_seconds": 5}}}))
    proc = tier_manager_process(config, tmp_path / "tm.sock").start()
    with grpc.insecure_channel(proc.address) as channel:
        proc.url = pb_grpc.NodeMetricsStub(channel).GetHttpEndpoint(
            pb.GetHttpEndpointRequest(), timeout=10).url
    yield proc
    proc.kill()


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    """`predicate()`'s first true value, polled until `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def get(url: str, path: str, parse: bool = True):
    with urllib.request.urlopen(url + path, timeout=10) as response:
        body = response.read()
    return json.loads(body) if parse else body.decode()


LAYER_BYTES = 4 << 20
LAYERS = 8  # 32 MiB of layers through a 16 MiB CPU pool: every pass reads NVMe


TOKENS_PER_STEP = 2048
TOTAL_STEPS = 1000
LEARNING_RATE = 3e-4


class Traffic:
    """A worker in this process streaming layers through the daemon: NVMe -> CPU pool ->
    device on every pass, and write_back (device -> CPU pool -> NVMe) of one layer. A
    training pass is also one optimizer step of its loop (`train_pass`)."""

    def __init__(self, address: str) -> None:
        from tierstack.worker.store.layer_store import LayerStore

        self.store = LayerStore("metrics-test", device="cpu", device_budget=3 * LAYER_BYTES,
                                address=address, durable=True)
        torch.manual_seed(0)
        self.layers = [{"w": torch.randn(LAYER_BYTES // 4)} for _ in range(LAYERS)]
        self.store.register_layers(self.layers)
        self.passes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def one_pass(self) -> None:
        store = self.store
        store.prefetch(0)
        for i in range(LAYERS):
            if i + 1 < LAYERS:
                store.prefetch(i + 1)
            store.ensure_layer(i)
            store.release_layer(i)
        store.write_back(self.passes % LAYERS, self.layers[self.passes % LAYERS])
        self.passes += 1

    @staticmethod
    def loss_at(step: int) -> float:
        """The loss the training passes report: falling, as a training run's does."""
        return 4.0 / step

    def train_pass(self) -> None:
        """A pass and the step its loop reports after it, as the engine does."""
        self.one_pass()
        self.store.reports.training(self.passes, self.loss_at(self.passes), TOKENS_PER_STEP,
                                   LEARNING_RATE, TOTAL_STEPS)

    def run_for(self, seconds: float, train: bool = False) -> None:
        """Passes (training passes if `train`) in the background until `seconds` have gone
        by or `stop`."""
        deadline = time.monotonic() + seconds
        one = self.train_pass if train else self.one_pass

        def loop():
            while not self._stop.is_set() and time.monotonic() < deadline:
                one()

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.store.close()


@pytest.fixture
def traffic(metrics_daemon):
    t = Traffic(metrics_daemon.address)
    yield t
    t.stop()
