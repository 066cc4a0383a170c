"""Activation policies: each offloaded block keeps its activations, only its input, or
sends its input to the tier manager (CPU pool or NVMe) until its backward; every policy
trains exactly as plain PyTorch does (fp32, same seed and data, a real daemon), and
nothing of the activations is left with the tier manager after a step."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch

from tests.worker.test_engine_tiers import _plain_losses, _train_config
from tests.worker.test_offload import TinyGPT
from tierstack.budgets import Budgets
from tierstack.config import load_config
from tierstack.errors import KeyNotFoundError, PoolExhaustedError
from tierstack.worker.engine.activation_stash import ActivationStash
from tierstack.worker.engine.offload_engine import OffloadEngine
from tierstack.worker.store.layer_store import LayerStore
from tierstack.errors import ConfigError
from tierstack.worker.engine.placement import DeviceFootprint, SavedBytes, place_blocks

SEQ, ROWS, LAYERS = 128, 8, 4
INPUT_BYTES = ROWS * SEQ * 64 * 4  # one block's fp32 input: 256 KiB


@pytest.fixture
def pool_size() -> str:
    return "16MiB"


@pytest.fixture
def daemon_config(tmp_path: Path, shm_dir: Path, pool_size: str) -> Path:
    """A node whose CPU pool is `pool_size` (smaller than the step's activations)."""
    path = tmp_path / "tier-manager.json"
    path.write_text(json.dumps({"tier_manager": {
        "cpu_pool": {"size": pool_size, "shm_dir": str(shm_dir)},
        "nvme_pool": {"paths": [str(tmp_path / "nvme0")], "size": "256MiB",
                      "aio": {"block_size": "256KiB", "queue_depth": 4}},
        "manifest_path": str(tmp_path / "manifest.sqlite"),
        "shutdown_grace_seconds": 10}}))
    return path


def _data(seed: int, count: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (ROWS, SEQ), generator=g),
             torch.randint(0, 256, (ROWS, SEQ), generator=g)) for _ in range(count)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyGPT(dim=64, layers=LAYERS, seq=SEQ)


def _activation_keys(store: LayerStore, engine: OffloadEngine) -> list[str]:
    """The keys that still exist of every input the engine ever stored."""
    left = []
    for n in range(engine.blocks.stash._count + LAYERS * 4):
        for i in range(LAYERS):
            try:
                store.client.describe(store.key(i, f"activation.{n}"))
                left.append(store.key(i, f"activation.{n}"))
            except KeyNotFoundError:
                pass
    return left


def _activation_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """What autograd saves in a plain forward of `model` (keeping every activation)."""
    with SavedBytes() as saved:
        model(x)
    return saved.bytes


# The CPU pool keeps "cpu" inputs (never evicted): room for them, not for the activations.
# "nvme" inputs pass through a pool that cannot hold them next to the layers (2 MiB).
@pytest.mark.parametrize("policy, pool_size", [("cpu", "4MiB"), ("nvme", "2MiB")])
def test_inputs_offloaded_to_the_tier_manager_train_like_plain_pytorch(daemon, policy):
    batches = _data(1, 3)
    expected = _plain_losses(_model(), batches)
    activations = _activation_bytes(_model(), batches[0][0])
    store = LayerStore(f"act-{policy}", device="cpu", device_budget=64 << 20,
                       address=daemon.address, durable=False)
    try:
        train = _train_config(params={"device": "nvme", "max_in_cpu": 0},
                              activations={"policy": policy})
        engine = OffloadEngine(_model(), store, train)
        assert [engine.blocks.policy(i) for i in range(LAYERS)] == [policy] * LAYERS
        before = store.tiers.stats()
        got, tensors = [], []
        for x, y in batches:
            got.append(engine.train_step(x, y))
            tensors.append(store.tiers.stats().tensors)
        after = store.tiers.stats()
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
        # Every block's input went through the tier manager, one write per block and step.
        assert engine.blocks.stash.bytes_written == len(batches) * LAYERS * INPUT_BYTES
        assert activations > after.cpu_capacity
        if policy == "nvme":
            assert after.nvme_bytes_written > before.nvme_bytes_written
        # Released as each block's backward ended: nothing left, nothing accumulates.
        assert engine.blocks.stash.live() == [] and _activation_keys(store, engine) == []
        assert tensors[1] == tensors[2]
        assert after.leases == 0 and after.cpu_used <= after.cpu_capacity
        engine.close()
    finally:
        store.close()


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_keep_and_recompute_policies_train_like_plain_pytorch(daemon, policy):
    batches = _data(2, 2)
    expected = _plain_losses(_model(), batches)
    store = LayerStore(f"act-{policy}", device="cpu", device_budget=1 << 20,
                       address=daemon.address, durable=False)
    try:
        engine = OffloadEngine(_model(), store,
                                           _train_config(params={"device": "cpu"},
                                                         activations={"policy": policy}))
        got = [engine.train_step(x, y) for x, y in batches]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
        assert [engine.blocks.policy(i) for i in range(LAYERS)] == [policy] * LAYERS
        assert engine.blocks.stash.bytes_written == 0 and store.resident_layers() == []
        engine.close()
    finally:
        store.close()


def test_place_blocks_sends_the_first_inputs_out_when_the_streamed_step_is_over_budget():
    MiB = 1 << 20
    footprint = DeviceFootprint(peak=100 * MiB, block_state=(40 * MiB,) * 4,
                                block_layer=(10 * MiB,) * 4, block_activations=(20 * MiB,) * 4,
                                block_inputs=(10 * MiB,) * 4)
    # 105 MiB planned (5% margin) against 90: one input out leaves 94.5, two leave 84.
    p = place_blocks(footprint, 90 * MiB, [True] * 4, window_layers=3)
    assert p.offload_inputs == (0, 1) and p.resident == () and p.keep_activations == ()
    assert p.layer_budget == 3 * 10 * MiB and p.planned_peak <= 90 * MiB
    # Every input out still needs 60 MiB (63 planned): the error names that budget.
    with pytest.raises(ConfigError, match=r"still needs 60 MiB .* at least 63 MiB"):
        place_blocks(footprint, 50 * MiB, [True] * 4, window_layers=3)


def test_the_placement_sends_inputs_to_the_tier_manager_when_the_budget_cannot_hold_them(daemon):
    """An HBM budget just under the streamed step's footprint: instead of refusing, the
    placement sends the fewest block inputs to the tier manager (policy "auto")."""
    batches = _data(3, 3)
    expected = _plain_losses(_model(), batches)
    store = LayerStore("act-auto", device="cpu", device_budget=64 << 20,
                       address=daemon.address, durable=False)
    try:
        probe = OffloadEngine(_model(), LayerStore("act-probe", device="cpu",
                                          address=daemon.address, durable=False),
                                          _train_config(params={"device": "cpu"}))
        footprint = probe._probe(lambda: probe._loss(*batches[0]))
        probe.close()
        probe.store.close()
        assert footprint.block_inputs == (INPUT_BYTES,) * LAYERS
        hbm = int((footprint.peak - INPUT_BYTES) * 1.05) + 1024  # room for all inputs but one
        engine = OffloadEngine(_model(), store, _train_config(params={"device": "cpu"}),
                                           budgets=Budgets(hbm=hbm, host=8 << 30, nvme=8 << 30))
        got = [engine.train_step(x, y) for x, y in batches]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
        assert engine.placement.offload_inputs == (0,)  # the first block's: needed last
        assert engine.placement.resident == () and engine.placement.keep_activations == ()
        assert [engine.blocks.policy(i) for i in range(LAYERS)] == ["auto"] + ["recompute"] * 3
        assert engine.blocks.stash.bytes_written == len(batches) * INPUT_BYTES
        assert _activation_keys(store, engine) == []
        engine.close()
    finally:
        store.close()


def test_a_deepspeed_json_with_activation_checkpointing_trains(daemon, tmp_path):
    ds = {"train_micro_batch_size_per_gpu": ROWS,
          "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95],
                                                    "eps": 1e-8, "weight_decay": 0.1}},
          "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                       "number_checkpoints": LAYERS,
                                       "contiguous_memory_optimization": False,
                                       "synchronize_checkpoint_boundary": False, "profile": False}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    train = load_config(str(path)).train
    assert train.activations.policy == "cpu" and train.activations.partition
    batches = _data(4, 2)
    expected = _plain_losses(_model(), batches)
    store = LayerStore("act-ds", device="cpu", device_budget=64 << 20, address=daemon.address,
                       durable=False)
    try:
        engine = OffloadEngine(_model(), store, train)
        # One rank: partition_activations has no other tier manager; inputs stay whole here.
        assert type(engine.blocks.stash) is ActivationStash
        got = [engine.train_step(x, y) for x, y in batches]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
        assert engine.blocks.stash.bytes_written == len(batches) * LAYERS * INPUT_BYTES
        assert engine.blocks.stash.peak_bytes_held == LAYERS * INPUT_BYTES
        assert _activation_keys(store, engine) == []
        engine.close()
    finally:
        store.close()


def test_a_forward_without_backward_leaves_no_input_behind(daemon):
    store = LayerStore("act-eval", device="cpu", device_budget=64 << 20, address=daemon.address,
                       durable=False)
    try:
        engine = OffloadEngine(_model(), store,
                                           _train_config(params={"device": "cpu"},
                                                         activations={"policy": "cpu"}))
        x, _ = _data(5, 1)[0]
        with torch.no_grad():
            engine.model(x)
        assert engine.blocks.stash.bytes_written == 0  # no backward would take them back
        engine.model(x)  # with grad, never backpropagated: the next zero_grad deletes them
        assert len(engine.blocks.stash.live()) == LAYERS
        engine.zero_grad()
        assert engine.blocks.stash.live() == [] and _activation_keys(store, engine) == []
        engine.close()
    finally:
        store.close()


def _stash_store(daemon) -> LayerStore:
    return LayerStore("act-stash", device="cpu", device_budget=64 << 20, address=daemon.address,
                      durable=False)


def test_an_input_changed_in_place_before_its_write_is_confirmed_fails_the_step_every_time(daemon):
    """The write runs behind the forward, so a change in place before the caller next waits
    for it may or may not reach the copy: it fails the step with a clear error whatever the
    timing, never gives back a torn or changed input, and leaves nothing stored."""
    store = _stash_store(daemon)
    stash = ActivationStash(store)
    try:
        for trial in range(8):
            x = torch.full((1 << 20,), float(trial))  # 4 MiB
            entry = stash.put(0, x, "cpu")
            if trial % 2:
                time.sleep(0.05)  # the copy is done by now: refused all the same
            x.add_(100.0)
            with pytest.raises(RuntimeError, match="changed in place while it was being offloaded"):
                stash.take(entry)
            stash.release(entry)
        assert stash.live() == [] and stash.bytes_held == 0
        for n in range(8):  # each refused input was deleted by its release
            with pytest.raises(KeyNotFoundError):
                store.client.describe(store.key(0, f"activation.{n}"))
        # Refused at the next put too (the step's forward), and the stash goes on after it.
        x = torch.full((1 << 20,), 1.0)
        stash.put(0, x, "cpu")
        x.mul_(2.0)
        with pytest.raises(RuntimeError, match="changed in place"):
            stash.put(1, torch.ones(4), "cpu")
        stash.clear()
        entry = stash.put(0, torch.full((8,), 3.0), "cpu")
        assert torch.equal(stash.take(entry), torch.full((8,), 3.0))
        stash.release(entry)
    finally:
        stash.close()
        store.close()


def test_an_input_changed_after_its_write_is_confirmed_comes_back_as_it_was_put(daemon):
    """The next put waits for the write before it: a change after that cannot reach the
    stored copy, so it is no error, and the stash holds no reference to the input."""
    store = _stash_store(daemon)
    stash = ActivationStash(store)
    try:
        x0, x1 = torch.full((1 << 20,), 5.0), torch.full((1 << 20,), 6.0)
        first = stash.put(0, x0, "cpu")
        second = stash.put(1, x1, "cpu")  # waits for x0's write and checks it
        x0.add_(100.0)
        assert torch.equal(stash.take(second), torch.full((1 << 20,), 6.0))
        assert torch.equal(stash.take(first), torch.full((1 << 20,), 5.0))
        stash.release(second)
        stash.release(first)
    finally:
        stash.close()
        store.close()


@pytest.mark.parametrize("pool_size", ["6MiB"])
def test_a_write_that_finds_the_pool_full_fails_the_step_once_and_leaves_nothing(daemon):
    """"cpu" inputs are never evicted: the one that does not fit fails at the next put or
    at its take, with the pool's error; clearing the step leaves no key, and the stash
    works again."""
    store = _stash_store(daemon)
    stash = ActivationStash(store)
    try:
        x = torch.ones(1 << 20)  # 4 MiB: the second does not fit next to the first
        with pytest.raises(PoolExhaustedError, match="CPU pool full"):
            entries = [stash.put(i, x, "cpu") for i in range(3)]
            for entry in reversed(entries):
                stash.take(entry)
        stash.clear()
        assert stash.live() == []
        entry = stash.put(0, x, "cpu")
        assert torch.equal(stash.take(entry), x)
        stash.release(entry)
        for n in range(6):
            for i in range(3):
                with pytest.raises(KeyNotFoundError):
                    store.client.describe(store.key(i, f"activation.{n}"))
    finally:
        stash.close()
        store.close()


def test_the_probe_sends_every_input_out_when_they_overflow_half_the_budget_and_measures_the_same_footprint(daemon):
    """A step whose block inputs alone overflow the HBM budget (a 7B model at 32k tokens in
    16 GiB): the placement's probe keeps the inputs on the device only if all of them fit in
    half the budget, else sends all of them to the tier manager (the safe placement), so
    the probe itself stays within it; its footprint is the one a probe keeping every input
    measures, and it leaves nothing with the tier manager."""
    batches = _data(6, 1)

    def probed(hbm: int):
        store = LayerStore("act-probe-half", device="cpu", address=daemon.address, durable=False)
        engine = OffloadEngine(_model(), store, _train_config(params={"device": "cpu"}),
                                           budgets=Budgets(hbm=hbm, host=8 << 30, nvme=8 << 30))
        try:
            footprint = engine._probe(lambda: engine._loss(*batches[0]))
            assert engine.blocks.stash.live() == [] and _activation_keys(store, engine) == []
            return footprint, engine.blocks.probe_stashed_bytes, engine.blocks.stash.bytes_written
        finally:
            engine.close()
            store.close()

    whole, none_out, none_written = probed(1 << 40)
    assert none_out == none_written == 0
    assert probed(2 * LAYERS * INPUT_BYTES)[1] == 0  # half of it holds them all: all kept
    footprint, out, written = probed(2 * LAYERS * INPUT_BYTES - 2)  # one byte short: none kept
    assert out == written == LAYERS * INPUT_BYTES
    assert footprint == whole
