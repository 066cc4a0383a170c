"""The one training loop (worker/engine/training_loop.py) driving a real engine and tier manager."""

import copy

import pytest
import torch

from tests.worker.test_engine_tiers import _data, _plain_losses, _train_config
from tests.worker.test_offload import TinyGPT
from tierstack.errors import InvalidArgumentError
from tierstack.worker.engine.offload_engine import OffloadEngine
from tierstack.worker.store.layer_store import LayerStore
from tierstack.worker.engine.training_loop import StopSignal, run_steps


def test_run_steps_trains_times_and_measures_each_step(daemon):
    """Per step: the engine's loss, the step's own time, and the counters' growth over it;
    on_step sees every record as soon as its step is done."""
    torch.manual_seed(0)
    reference = TinyGPT(dim=64, layers=3)
    model = copy.deepcopy(reference)
    batches = _data(11, 4)
    expected = _plain_losses(reference, batches)
    store = LayerStore("loop", device="cpu", device_budget=64 << 20, address=daemon.address, durable=False)
    try:
        engine = OffloadEngine(model, store, _train_config(params={"device": "cpu"}))
        counters = lambda: {"to_device": store.metrics.cpu_to_device_bytes,  # noqa: E731
                            "adamw_steps": engine.block_optimizer.steps}
        start = counters()
        seen = []
        records = run_steps(engine.train_step, iter(batches), "cpu", steps=3, counters=counters,
                            on_step=lambda r: seen.append((r.index, counters()["adamw_steps"])))
        assert seen == [(0, 1), (1, 2), (2, 3)]  # called right after each step, in order
        assert [r.index for r in records] == [0, 1, 2]
        torch.testing.assert_close(torch.tensor([r.loss for r in records]),
                                   torch.tensor(expected[:3]), rtol=1e-5, atol=0)
        assert all(r.seconds > 0 for r in records)
        block_bytes = sum(layout.nbytes for layout in store.layouts)
        assert all(r.moved == {"to_device": 2 * block_bytes, "adamw_steps": 1} for r in records)
        assert records[-1].counters == {"to_device": start["to_device"] + 3 * 2 * block_bytes,
                                        "adamw_steps": 3}
        engine.close()
    finally:
        store.close()


def test_run_steps_without_a_count_takes_every_batch_and_a_short_iterator_is_named():
    model = torch.nn.Linear(4, 4)

    def step(x, y):
        return torch.nn.functional.mse_loss(model(x), y).item()

    batches = [(torch.ones(2, 4), torch.zeros(2, 4))] * 3
    assert [r.index for r in run_steps(step, batches, "cpu")] == [0, 1, 2]
    with pytest.raises(InvalidArgumentError, match="the batches ran out after 3 of 5 steps"):
        run_steps(step, batches, "cpu", steps=5)


def test_a_sigterm_during_a_step_ends_the_loop_after_that_step():
    """The handler only sets a flag: the step in progress finishes, no later step starts;
    the same stop arriving twice at once (a group signal a wrapper also passes on) is one
    stop; outside, the old handler is back. (A second SIGTERM seconds later stops the
    process at once: tests/test_cli.py.)"""
    import os
    import signal

    seen = []

    def step(x, y):
        seen.append(len(seen))
        if len(seen) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
        return 1.0

    before = signal.getsignal(signal.SIGTERM)
    batches = iter(lambda: (torch.zeros(1), torch.zeros(1)), None)
    with StopSignal() as stop:
        records = run_steps(step, batches, "cpu", 10, stop=stop)
    assert stop.requested and len(records) == 2 and seen == [0, 1]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_sigterm_later_stops_the_process_at_once():
    import subprocess
    import sys

    script = (
        "import os, signal, time\n"
        "from tierstack.worker.engine.training_loop import StopSignal\n"
        "with StopSignal(repeat_seconds=0.5) as stop:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(1.0)\n"
        "    print('first: stop asked', stop.requested, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(5)\n"
        "    print('survived', flush=True)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == -15, out.stdout + out.stderr
    assert out.stdout == "first: stop asked True\n"
