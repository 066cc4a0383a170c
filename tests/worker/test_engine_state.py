"""An engine's state by name (worker/engine/engine_state.py), through checkpoints: blocks the
placement made resident (on a GPU: whatever fits the HBM budget, the default) are saved
and restored like the offloaded ones, so a checkpoint resumes bit for bit whichever
blocks are resident on either side; a checkpoint from before the model map (format 1: the
persistent state inside engine.pt) still loads. bf16 with fp32 masters, a real daemon."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.worker.test_engine_tiers import _data, _train_config
from tests.worker.test_offload import TinyGPT
from tierstack.budgets import Budgets
from tierstack.checkpoint_layout import crc32, weight_names
from tierstack.errors import InvalidArgumentError
from tierstack.worker.engine import checkpoint
from tierstack.worker.engine.offload_engine import OffloadEngine
from tierstack.worker.store.layer_store import LayerStore

BATCHES = _data(5, 4)


def _engine(daemon, job: str, hbm: int, seed: int = 0, dim: int = 64):
    torch.manual_seed(seed)
    store = LayerStore(job, device="cpu", device_budget=64 << 20, address=daemon.address, durable=False)
    engine = OffloadEngine(TinyGPT(dim=dim, layers=3), store,
                           _train_config(precision="bf16", params={"device": "auto"}),
                           budgets=Budgets(hbm=hbm, host=8 << 30, nvme=8 << 30))
    return engine, store


def _steps(engine, batches) -> list[float]:
    return [engine.train_step(x, y) for x, y in batches]


def test_resident_blocks_are_saved_and_restored_into_any_placement(shared_daemon, tmp_path):
    resident, store = _engine(shared_daemon, "resident", 1 << 40)
    try:
        _steps(resident, BATCHES[:2])
        assert resident.placement.resident == (0, 1, 2)  # every block on the device
        checkpoint.save_checkpoint(resident, tmp_path / "ckpt")
        expected = _steps(resident, BATCHES[2:])
        # Into the same engine, its blocks resident: their device tensors, masters, moments.
        checkpoint.load_checkpoint(resident, tmp_path / "ckpt")
        assert _steps(resident, BATCHES[2:]) == expected
        resident.close()
    finally:
        store.close()
    block = load_file(str(tmp_path / "ckpt" / "block-00001.safetensors"))  # a resident block's file
    for weight in weight_names(list(block)):
        assert block[weight].dtype == torch.bfloat16 and block[f"{weight}.master"].dtype == torch.float32
        assert f"{weight}.exp_avg" in block and f"{weight}.exp_avg_sq" in block
    streamed, store = _engine(shared_daemon, "streamed", 0, seed=1)  # other weights, nothing resident
    try:
        checkpoint.load_checkpoint(streamed, tmp_path / "ckpt")
        assert _steps(streamed, BATCHES[2:]) == expected
        assert streamed.blocks.resident == set()
        streamed.close()
    finally:
        store.close()


def test_a_checkpoint_of_another_model_is_refused_before_anything_changes(shared_daemon, tmp_path):
    engine, store = _engine(shared_daemon, "dim64", 0)
    try:
        _steps(engine, BATCHES[:1])
        checkpoint.save_checkpoint(engine, tmp_path / "ckpt")
        engine.close()
    finally:
        store.close()
    narrower, store = _engine(shared_daemon, "dim32", 0, dim=32)
    try:
        before = checkpoint.block_state(narrower, 0)
        with pytest.raises(InvalidArgumentError, match=r"checkpoint .*ckpt has '(\w+\.)+\w+' of shape "
                                                       r"\[\d+(, \d+)*\], the model \[\d+(, \d+)*\]; "
                                                       r"load it into the model it was saved from"):
            checkpoint.load_checkpoint(narrower, tmp_path / "ckpt")
        after = checkpoint.block_state(narrower, 0)
        assert all(torch.equal(before[k], after[k]) for k in before)
        narrower.close()
    finally:
        store.close()


def test_a_format_1_checkpoint_still_loads(shared_daemon, tmp_path):
    """The layout before the model map: the same block files, the persistent parameters,
    their masters and their optimizer's state dict inside engine.pt, no map in the
    listing. Loaded into a fresh engine, training goes on bit for bit."""
    engine, store = _engine(shared_daemon, "format1", 0)
    try:
        _steps(engine, BATCHES[:2])
        checkpoint.save_checkpoint(engine, tmp_path / "ckpt")
        _as_format_1(engine, tmp_path / "ckpt")
        expected = _steps(engine, BATCHES[2:])
        engine.close()
    finally:
        store.close()
    fresh, store = _engine(shared_daemon, "format1-fresh", 0, seed=1)
    try:
        assert checkpoint.load_checkpoint(fresh, tmp_path / "ckpt") == {}
        assert _steps(fresh, BATCHES[2:]) == expected
        fresh.close()
    finally:
        store.close()


def _as_format_1(engine: OffloadEngine, directory) -> None:
    """Rewrite a checkpoint of `engine` (saved just now) as format 1 wrote it."""
    meta = torch.load(directory / "engine.pt", weights_only=False)
    meta.update(blocks=len(engine.blocks.blocks), persistent=engine.model.state_dict(),
                persistent_optimizer=engine.persistent_optimizer.state_dict(),
                persistent_masters=[m.detach().cpu() for m in engine.persistent_masters])
    torch.save(meta, directory / "engine.pt")
    (directory / "persistent.safetensors").unlink()
    listing = json.loads((directory / "checkpoint.json").read_text())
    del listing["model"], listing["files"]["persistent.safetensors"]
    path = directory / "engine.pt"
    listing["files"]["engine.pt"] = {"bytes": path.stat().st_size, "crc32": crc32(path)}
    (directory / "checkpoint.json").write_text(json.dumps(listing))
