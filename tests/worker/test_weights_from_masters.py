"""train.params.weights_from_masters: exact AdamW at 12 bytes per parameter of host memory
(issue 36, item 2). With it on, the tier manager keeps an offloaded block's fp32 masters
and moments and no bf16 copy of its weights: each load rounds the masters on the way to
the device, and the daemon's AdamW writes no bf16 weights. The rounding is the one the
daemon does when it keeps the copy (to nearest even), so training is bit for bit the same.
Real daemons, device `cpu` (the CPU load rounds the pool's pinned masters in place of a
device staging copy; the arithmetic is the CUDA path's)."""

from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from tests.conftest import tier_manager_process
from tests.worker.test_offload import TinyGPT
from tierstack.config import MiB, load_config
from tierstack.errors import ConfigError, KeyNotFoundError
from tierstack.services.tier_manager.client import TierManagerClient
from tierstack.worker.engine.checkpoint import load_checkpoint, save_checkpoint
from tierstack.config import BudgetsConfig
from tierstack.worker.engine.offload_engine import (OffloadEngine, decide_weights_from_masters,
                                                    host_state_bytes, job_budgets, weights_from_masters)
from tierstack.worker.store.layer_store import LayerStore
from tierstack.worker.engine.sharded_engine import ShardedEngine

KINDS = ("params", "master", "exp_avg", "exp_avg_sq")
LAYERS = 4


@pytest.fixture
def daemon(shared_daemon):
    """One daemon for this module (16 MiB CPU pool): tests use only their own jobs."""
    return shared_daemon


def _train(setting: str, precision: str = "bf16"):
    return load_config({"tier_manager": {"nvme_pool": {"paths": ["/unused"]}},
                        "train": {"precision": precision,
                                  "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
                                  "params": {"weights_from_masters": setting, "buffer_count": 3}}}).train


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 256, (4, 32), generator=g), torch.randint(0, 256, (4, 32), generator=g))
            for _ in range(count)]


@dataclass
class Held:
    """What the daemon holds of a job's block state (params, masters, moments)."""

    in_cpu: int
    nvme_only: int
    keys: set[str]

    def per_parameter(self, numel: int) -> float:
        return (self.in_cpu + self.nvme_only) / numel


def _held(client: TierManagerClient, store: LayerStore) -> Held:
    in_cpu = nvme_only = 0
    keys = set()
    for i in range(len(store.layouts)):
        for kind in KINDS:
            try:
                info = client.describe(store.key(i, kind))
            except KeyNotFoundError:
                continue
            keys.add(kind)
            if info.in_cpu:
                in_cpu += info.nbytes
            elif info.on_nvme:
                nvme_only += info.nbytes
    return Held(in_cpu, nvme_only, keys)


@dataclass
class Run:
    losses: list[float]
    from_masters: bool
    held: Held
    numel: int
    masters: list[dict[str, torch.Tensor]]


def _run(address: str, setting: str, steps: int = 4, job: str | None = None,
         device: str = "cpu") -> Run:
    """`steps` bf16 steps of a 4-block GPT (0.8e6 block parameters) on the daemon, every
    block streamed (no HBM budget: nothing placed on the device for good)."""
    torch.manual_seed(0)
    model = TinyGPT(dim=128, heads=4, layers=LAYERS)
    numel = sum(p.numel() for p in model.blocks.parameters())
    client = TierManagerClient(address, reconnect_timeout=10)
    # The store's setting, decided as worker/job.py decides it for every door.
    from_masters = decide_weights_from_masters(model, "blocks", _train(setting),
                                               client.node().cpu_capacity)
    store = LayerStore(job or f"wfm-{uuid.uuid4().hex[:8]}", device=device, device_budget=64 << 20,
                       address=address, durable=False, from_masters=from_masters)
    try:
        budgets = job_budgets(BudgetsConfig(), store).with_(hbm=0)
        engine = OffloadEngine(model, store, _train(setting), budgets)
        try:
            losses = [engine.train_step(x, y) for x, y in _batches(steps)]
            engine.wait_for_optimizer()
            held = _held(client, store)
            masters = [store.read_layer(i, "master") for i in range(LAYERS)]
        finally:
            engine.close()
        return Run(losses, store.from_masters, held, numel, masters)
    finally:
        store.close()
        try:
            client.delete_job(store.job)  # its room now, not after the jobs' grace
        except KeyNotFoundError:
            pass
        client.close()


def test_same_losses_and_masters_bit_for_bit_and_12_bytes_per_parameter(daemon):
    off, on = _run(daemon.address, "off"), _run(daemon.address, "on")
    assert (off.from_masters, on.from_masters) == (False, True)
    assert on.losses == off.losses  # the same rounding: not close, equal
    for a, b in zip(on.masters, off.masters):
        for name in a:
            assert torch.equal(a[name], b[name]), name
    # The daemon holds no bf16 weights with it on: 14 -> 12 bytes per parameter.
    assert off.held.keys == set(KINDS) and on.held.keys == set(KINDS) - {"params"}
    assert 13.9 < off.held.per_parameter(off.numel) < 14.1, off.held
    assert 11.9 < on.held.per_parameter(on.numel) < 12.1, on.held


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_masters_rounded_on_the_device_train_bit_for_bit_as_the_stored_weights(daemon):
    """The CUDA load: fp32 masters copied into a staging buffer on the device and rounded
    there on the copy stream; the same losses as the bf16 weights the daemon rounds."""
    off, on = _run(daemon.address, "off", device="cuda"), _run(daemon.address, "on", device="cuda")
    assert on.from_masters and on.losses == off.losses
    assert 11.9 < on.held.per_parameter(on.numel) < 12.1


def test_auto_keeps_the_stored_weights_where_the_pool_holds_them(daemon):
    run = _run(daemon.address, "auto")  # 11 MB at 14 bytes per parameter, 16 MiB pool
    assert not run.from_masters and "params" in run.held.keys


def test_auto_rule():
    n, at_14, at_12 = 10**6, host_state_bytes(10**6, "bf16", False), host_state_bytes(10**6, "bf16", True)
    assert (at_14, at_12) == (14 * n, 12 * n)
    assert not weights_from_masters("auto", "bf16", n, at_14)  # fits as it is
    assert weights_from_masters("auto", "bf16", n, at_14 - 1)
    assert weights_from_masters("auto", "bf16", n, at_12)
    assert not weights_from_masters("auto", "bf16", n, at_12 - 1)  # fits neither way
    assert not weights_from_masters("auto", "fp32", n, at_12)  # fp32 weights are the masters
    assert weights_from_masters("on", "bf16", n, 100 * at_14)
    assert not weights_from_masters("off", "bf16", n, at_12)
    assert not weights_from_masters("auto", "bf16", n, at_12, unsupported="why")
    with pytest.raises(ConfigError, match=r"^train\.params\.weights_from_masters 'on': why; set it"):
        weights_from_masters("on", "bf16", n, at_12, unsupported="why")


def test_bad_values_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^train\.params\.weights_from_masters: 'yes' is not one "
                                          r"of auto, on, off$"):
        _train("yes")
    with pytest.raises(ConfigError, match=r"^train\.params\.weights_from_masters 'on' needs "
                                          r"train\.precision bf16 or fp16"):
        _train("on", precision="fp32")


def test_partitioned_engines_refuse_on():
    why = ShardedEngine._why_not_from_masters(None, nn.ModuleList(), "blocks", [])
    assert why.startswith("partitioned (multi-rank) jobs")
    with pytest.raises(ConfigError, match="partitioned"):
        weights_from_masters("on", "bf16", 1, 1, why)


class BlockWithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("scale", torch.ones(16))

    def forward(self, x):
        return x + self.fc(x) * self.scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(BlockWithBuffer() for _ in range(2))
        self.head = nn.Linear(16, 32)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_block_with_a_buffer_refuses_on_and_auto_stays_off(daemon):
    store = LayerStore(f"wfm-{uuid.uuid4().hex[:8]}", device="cpu", address=daemon.address,
                       durable=False)
    try:
        with pytest.raises(ConfigError, match=r"block blocks\.0 holds 'scale', which has no fp32 "
                                              r"master .* set it to 'auto' or 'off'"):
            OffloadEngine(Net(), store, _train("on"))
        assert not weights_from_masters("auto", "bf16", 1, 13, "a buffer")
    finally:
        store.close()


def test_checkpoint_resume_eval_attach_and_the_device_budget(daemon, tmp_path):
    """Resumed from a checkpoint, training continues bit for bit; an eval forward and a
    second worker attaching the job see the weights the masters round to; a load reserves
    its staging bytes in the device budget."""
    batches = _batches(4)
    whole = _run(daemon.address, "on", steps=4)
    job = f"wfm-{uuid.uuid4().hex[:8]}"
    for half in range(2):
        torch.manual_seed(0)
        store = LayerStore(job if half == 0 else job + "-b", device="cpu", device_budget=64 << 20,
                           address=daemon.address, durable=False, from_masters=True)
        try:
            engine = OffloadEngine(TinyGPT(dim=128, heads=4, layers=LAYERS), store, _train("on"))
            try:
                if half == 1:
                    load_checkpoint(engine, tmp_path / "ckpt")
                losses = [engine.train_step(x, y) for x, y in batches[2 * half:2 * half + 2]]
                assert losses == whole.losses[2 * half:2 * half + 2]
                if half == 0:
                    save_checkpoint(engine, tmp_path / "ckpt")
                    continue
                engine.wait_for_optimizer()
                weights = store.read_layer(0)
                masters = store.read_layer(0, "master")
                assert all(torch.equal(t, masters[f"{n}.master"].to(torch.bfloat16))
                           for n, t in weights.items())
                staging = store.loader.staging_nbytes(0)
                assert staging == 2 * store.layouts[0].nbytes  # fp32 masters of bf16 weights
                assert store.layer_nbytes(0) == store.layouts[0].nbytes + staging
                assert store.layer_nbytes(0) <= store.figures().device_peak <= store.figures().device_capacity
                with torch.no_grad():  # an eval forward loads the blocks as training does
                    logits = engine.model(batches[0][0])
                    assert torch.isfinite(logits.float()).all()
                other = LayerStore(store.job, device="cpu", address=daemon.address, durable=False,
                                   metrics=False)
                try:
                    other.attach()
                    assert other.from_masters
                    got = other.ensure_layer(0)
                    assert all(torch.equal(got[n], t) for n, t in weights.items())
                    other.release_layer(0)
                finally:
                    other.close()
            finally:
                engine.close()
        finally:
            store.close()


# ---- a model that fits the CPU pool only at 12 bytes per parameter ---------------------------


@pytest.fixture
def pool_at_13_bytes(tmp_path: Path):
    """A daemon whose CPU pool holds the 4-block GPT's block state at 13 bytes per
    parameter: at 12 it fits, at 14 it does not."""
    numel = sum(p.numel() for p in TinyGPT(dim=128, heads=4, layers=LAYERS).blocks.parameters())
    shm = Path("/dev/shm") / f"tierstack-test-{uuid.uuid4().hex[:10]}"
    shm.mkdir(mode=0o700)
    config = tmp_path / "tier-manager.json"
    config.write_text(json.dumps({"tier_manager": {
        "cpu_pool": {"size": 13 * numel, "shm_dir": str(shm)},
        "nvme_pool": {"paths": [str(tmp_path / "nvme")], "size": "256MiB",
                      "aio": {"block_size": "256KiB", "queue_depth": 4}},
        "manifest_path": str(tmp_path / "manifest.sqlite")}}))
    proc = tier_manager_process(config, tmp_path / "tm.sock").start()
    try:
        yield proc
    finally:
        proc.kill()
        shutil.rmtree(shm, ignore_errors=True)


def test_fits_only_at_12_bytes_auto_rounds_and_spills_less(pool_at_13_bytes):
    address = pool_at_13_bytes.address
    off, auto = _run(address, "off"), _run(address, "auto")
    assert auto.from_masters and not off.from_masters
    assert auto.losses == off.losses
    # Today's 14 bytes per parameter overflow the pool; at 12 the state stays in it.
    assert off.held.nvme_only > MiB // 2, off.held
    assert auto.held.nvme_only < off.held.nvme_only / 4, (auto.held, off.held)
