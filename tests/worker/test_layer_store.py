"""The worker SDK against a real daemon process, with workers in other processes."""

import json
import subprocess
import sys
import time

import pytest
import torch

from tests.worker.pass_worker import bit_equal, make_layer, run_passes
from tierstack.errors import DeviceBudgetError, InvalidArgumentError
from tierstack.worker.store.layer_store import LayerStore


def spawn_worker(daemon, job, seed, layers, passes, mode, budget=8 << 20):
    return subprocess.Popen(
        [sys.executable, "-m", "tests.worker.pass_worker", daemon.address, job, str(seed),
         str(layers), str(passes), mode, str(budget)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=240) -> list[dict]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_hundred_layers_larger_than_the_cpu_pool_verify_bit_exact(daemon):
    total = sum(v.numel() * v.element_size() for i in range(100) for v in make_layer(1, i).values())
    assert total > 2 * (16 << 20)  # the model is over twice the CPU pool: NVMe is used
    with LayerStore("job1", device="cpu", device_budget=8 << 20, address=daemon.address) as store:
        store.register_layers([make_layer(1, i) for i in range(100)])
        checked = run_passes(store, 1, 100, passes=2)
        assert checked == 2 * sum(
            sum(v.numel() * v.element_size() for v in make_layer(1, i).values()) for i in range(100))
        assert store.figures().device_peak <= store.figures().device_capacity
        assert store.resident_layers() == []
        stats = store.tiers.stats()
        assert stats.nvme_bytes_read > 16 << 20  # layers really came back from NVMe
        assert stats.cpu_used <= stats.cpu_capacity
        assert stats.pinned == 0  # every fetch was released


def test_two_worker_processes_at_once(daemon):
    # Worker A registers and reads job "a"; worker B registers "b"; worker C attaches to
    # A's layers once they exist (a second data-parallel replica reading the same job),
    # while A holds the job open (its last holder gone, a job is deleted after its grace).
    a = spawn_worker(daemon, "a", 2, 40, 2, "register-hold")
    b = spawn_worker(daemon, "b", 3, 40, 2, "register")
    first = json.loads(a.stdout.readline())  # A finished registering and one pass
    assert first["bad"] == []
    c = spawn_worker(daemon, "a", 2, 40, 2, "attach")
    for proc in (c, b):
        lines = finish(proc)
        assert lines[-1]["done"] and lines[-1]["peak"] <= lines[-1]["budget"]
    out, err = a.communicate("\n", timeout=240)  # C is done: A may let go of the job
    assert a.returncode == 0, err[-3000:]
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert lines[-1]["done"] and lines[-1]["peak"] <= lines[-1]["budget"]


def test_daemon_killed_and_restarted_mid_run_loses_nothing(daemon):
    worker = spawn_worker(daemon, "crash", 4, 60, 8, "register")
    first = json.loads(worker.stdout.readline())
    assert first == {"pass": 0, "bad": []}
    daemon.kill()  # SIGKILL while the worker is mid-pass
    time.sleep(0.5)
    daemon.start()
    lines = [first] + finish(worker)
    assert lines[-1]["done"]
    assert [line["pass"] for line in lines[:-1]] == list(range(8))


def test_write_back_replaces_a_layer_and_other_kinds_live_beside_it(daemon):
    with LayerStore("wb", device="cpu", device_budget=8 << 20, address=daemon.address) as store:
        store.register_layers([make_layer(5, i) for i in range(3)])
        new = {k: (v + 1 if v.dtype != torch.uint8 else v ^ 1) for k, v in make_layer(5, 1).items()}
        store.write_back(1, new)
        got = store.ensure_layer(1)
        assert all(bit_equal(got[k], new[k]) for k in new)
        store.release_layer(1)
        grads = {"w0.grad": torch.randn(1000)}
        store.write_back(1, grads, kind="grad", durable=False)
        assert torch.equal(store.read_layer(1, "grad")["w0.grad"], grads["w0.grad"])
        with pytest.raises(InvalidArgumentError, match="registered with"):
            store.write_back(0, {k: v[:1] for k, v in make_layer(5, 0).items()})


def test_device_budget_is_never_exceeded(daemon):
    layers = [{"w": torch.randn(250_000)} for _ in range(4)]  # 1 MB each
    with LayerStore("budget", device="cpu", device_budget=2_200_000, address=daemon.address) as store:
        store.register_layers(layers)
        store.ensure_layer(0)
        assert store.prefetch(1)
        assert not store.prefetch(2)  # would exceed the budget: skipped, not an error
        with pytest.raises(DeviceBudgetError, match="release layers first"):
            store.ensure_layer(2)
        store.release_layer(0)
        assert torch.equal(store.ensure_layer(2)["w"], layers[2]["w"])
        assert store.figures().device_peak <= 2_200_000
        with pytest.raises(InvalidArgumentError, match="layer 9 does not exist"):
            store.ensure_layer(9)


def test_a_failed_load_gives_its_device_budget_back(daemon):
    with LayerStore("fail", device="cpu", device_budget=4 << 20, address=daemon.address) as store:
        store.register_layers([{"w": torch.randn(250_000)} for _ in range(2)])
        store.client.delete([store.key(1)])  # the layer vanishes behind the worker's back
        store.prefetch(1)
        from tierstack.errors import KeyNotFoundError
        for _ in range(3):
            with pytest.raises(KeyNotFoundError):
                store.ensure_layer(1)
        assert store.figures().device_used == 0
        assert store.tiers.stats().pinned == 0
