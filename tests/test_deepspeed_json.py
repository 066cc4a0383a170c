"""DeepSpeed JSON as is: a ZeRO-Offload cpu file and a ZeRO-Infinity nvme file, written as
DeepSpeed users write them, train a small model unmodified through
`OffloadEngine.from_config` against a real daemon started from the same file."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from tests.worker.test_offload import TinyGPT
from tierstack.config import load_config
from tierstack.services.tier_manager.client import TierManagerClient
from tierstack.services.tier_manager.embedded import EmbeddedTierManager
from tierstack.worker.engine import OffloadEngine
from tierstack.worker.layers import LayerStore

HYPER = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def _deepspeed(device: str, nvme_path: str) -> dict:
    offload = {"device": device, "pin_memory": True}
    if device == "nvme":
        offload["nvme_path"] = nvme_path
    return {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": HYPER},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {**offload, "buffer_count": 4, "buffer_size": 1e8,
                              **({"max_in_cpu": 0} if device == "nvme" else {})},
            "offload_optimizer": {**offload, "buffer_count": 4, "fast_init": False},
            "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
            "stage3_prefetch_bucket_size": 5e8, "stage3_param_persistence_threshold": 1e4,
            "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        },
        "aio": {"block_size": 262144, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                "overlap_events": True, "use_gds": False},
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
    }


def _plain_losses(model, batches):
    opt = torch.optim.AdamW(model.parameters(), fused=True, lr=HYPER["lr"], betas=tuple(HYPER["betas"]),
                            eps=HYPER["eps"], weight_decay=HYPER["weight_decay"])
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_a_deepspeed_json_trains_unmodified(tmp_path, device):
    path = tmp_path / f"ds_{device}.json"
    nvme_path = tmp_path / "local_nvme"
    path.write_text(json.dumps(_deepspeed(device, str(nvme_path))))
    config = load_config(path)  # the file as a DeepSpeed user wrote it
    torch.manual_seed(0)
    reference = TinyGPT(dim=64, layers=3)
    model = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 256, (4, 32), generator=g), torch.randint(0, 256, (4, 32), generator=g))
               for _ in range(4)]
    expected = _plain_losses(reference, batches)
    # The daemon from the same file: pools 'auto' (sized by the machine's budgets, grown to
    # need), the NVMe pool at the file's nvme_path (a cpu file names none: the default).
    tm = config.tier_manager
    if device == "cpu":
        tm.nvme_pool.paths = [str(tmp_path / "spill")]
    tm.metrics.http_listen = ""
    with EmbeddedTierManager(tm) as daemon:
        store = LayerStore("ds", device="cpu", address=daemon.address, durable=False,
                           device_budget=config.train.device_budget_bytes(1 << 20))
        try:
            engine = OffloadEngine.from_config(model, store, config.train)
            got = [engine.train_step(x, y) for x, y in batches]
            engine.close()
            stats = TierManagerClient(daemon.address).stats()
        finally:
            store.close()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
    if device == "nvme":  # nvme_path honoured: the blocks went through the file's directory
        assert stats.nvme_bytes_written > 0
        assert os.path.exists(nvme_path / "tierstack-nvme.data")
    else:  # the state stays in the CPU pool: NVMe holds only the layouts (written durably)
        assert stats.evictions == 0 and stats.nvme_bytes_read == 0 and stats.cpu_used > 0
        # the layouts only: a few KiB each (a data block and its self-describing header)
        assert stats.nvme_used * 10 < stats.cpu_used, stats
