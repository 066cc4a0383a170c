"""Ranks as Ray actors on a real local Ray: partitioned training placed by Ray."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tierstack.config import OptimizerConfig
from tierstack.process_tree import alive, children
from tierstack.worker.jobs.gpt import GPT, GPTConfig
from tierstack.worker.jobs.partitioned_job import PartitionedSpec, global_batches, small_embedded_node


@contextlib.contextmanager
def _environment_kept():
    environ = dict(os.environ)
    try:
        yield
    finally:
        # ray.init leaves RAY_AUTH_MODE=token (and more) in this process's environment,
        # which later tests' subprocesses would inherit.
        os.environ.clear()
        os.environ.update(environ)


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    from tierstack.worker.jobs.ray_workers import start_local_ray
    with _environment_kept():
        start_local_ray(num_cpus=2, object_store_memory=128 << 20)
        yield ray
        ray.shutdown()


def test_a_ray_start_whose_raylet_misses_the_deadline_is_stopped_and_started_again(caplog):
    """The suite's Ray start failed in CI on a busy machine ("The current node timed out
    during startup"). A raylet stopped (SIGSTOP) before it registers is that start. Three
    tries: on a loaded 2-core machine the suite once saw the second, unstopped try miss
    Ray's 30 s too, and the test is about the retry, not about one start's speed."""
    ray = pytest.importorskip("ray")
    from tierstack.worker.jobs.ray_workers import start_local_ray
    stopped: list[int] = []
    done = threading.Event()

    def stop_the_first_raylet() -> None:
        while not done.is_set() and not stopped:
            for pid in children(os.getpid()):
                comm = ""
                with contextlib.suppress(OSError):  # a child that just exited
                    comm = Path(f"/proc/{pid}/comm").read_text().strip()
                if comm == "raylet":
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
                    break
            time.sleep(0.002)

    watcher = threading.Thread(target=stop_the_first_raylet, daemon=True)
    watcher.start()
    with _environment_kept():
        try:
            start_local_ray(num_cpus=1, object_store_memory=128 << 20, attempts=3)
            assert ray.get(ray.remote(lambda: 42).remote()) == 42
        finally:
            done.set()
            ray.shutdown()
    assert stopped, "no raylet was started"
    assert not alive(stopped[0]), "the failed try's raylet was left running"
    assert "missed its start-up deadline (try 1 of 3" in caplog.text


def test_two_cpu_actors_train_like_plain_pytorch_on_the_global_batch(local_ray):
    from tierstack.worker.jobs.ray_workers import train_with_ray
    spec = PartitionedSpec(gpt=GPTConfig(vocab_size=256, seq_len=16, dim=32, heads=2, layers=3),
                           steps=3, global_batch=4, seed=5, data="random",
                           optimizer=OptimizerConfig(lr=1e-3), device="cpu",
                           embedded=small_embedded_node(size_mib=1))
    results = train_with_ray(spec, 2, use_gpu=False)
    assert [r.rank for r in results] == [0, 1]
    assert all(r.device == "cpu" for r in results)

    torch.manual_seed(spec.seed)
    reference = GPT(spec.gpt)
    opt = torch.optim.AdamW(reference.parameters(), fused=True, lr=1e-3)
    batches = global_batches(spec)
    for step in range(spec.steps):
        x, y = next(batches)
        loss = torch.nn.functional.cross_entropy(reference(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        for r in results:
            assert abs(r.steps[step].loss - loss.item()) <= 1e-5 * loss.item(), (step, r.rank)
    assert all(r.steps[-1].gathered > 0 for r in results)


def test_too_many_ranks_for_the_cluster_is_a_clear_error(local_ray):
    from tierstack.errors import InvalidArgumentError
    from tierstack.worker.jobs.ray_workers import train_with_ray
    with pytest.raises(InvalidArgumentError, match="3 ranks need 3 CPU but the Ray cluster has 2"):
        train_with_ray(PartitionedSpec(), 3, use_gpu=False)


def test_tierstack_train_with_ranks_starts_an_embedded_ray(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tierstack.cli", "train", "--ranks", "2", "--steps", "4",
         "--layers", "2", "--dim", "32", "--heads", "2", "--seq-len", "32", "--batch-size", "4",
         "--cpu-pool-size", "1MiB", "--nvme-path", str(tmp_path / "nvme")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = out.stdout.replace("\n", " ")
    assert "done: 4 steps on 2 ranks" in summary
    first, last = summary.split("loss ")[-1].split(",")[0].split(" -> ")
    assert float(last) < float(first)
