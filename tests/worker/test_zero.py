"""DeepSpeed's zero surface over the tiers: a model built under `zero.Init` (its parameters
spilled as it is built, taken block by block at initialize) trains as the same model built
plainly; the engine's model shows every parameter (`state_dict()` with real values, one
block read at a time; `parameters()` and attribute access with real shapes; a value read
outside a gather refused in one line naming the fix); and a change made inside
`GatheredParameters` reaches training. Real tier managers started by initialize, plain
PyTorch on the same seed and data as the reference."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tierstack
from tierstack.worker.engine.block_views import OffloadedTensorError

VOCAB, DIM, LAYERS, ROWS, SEQ = 64, 32, 4, 4, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)
        # An init of the model's own after its children exist, on their weights: it runs
        # on parameters zero.Init parked already, as a Hugging Face post_init does.
        with torch.no_grad():
            for block in self.blocks:
                block.down.weight.mul_(0.5)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _config(nvme: Path) -> dict:
    return {"train_micro_batch_size_per_gpu": ROWS,
            "zero_optimization": {"stage": 3,
                                  "offload_param": {"device": "nvme", "nvme_path": str(nvme)},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}}


@pytest.fixture
def alone(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERSTACK_TIER_MANAGER", f"unix:{tmp_path}/no-tier-manager.sock")
    monkeypatch.delenv("TIERSTACK_SCHEDULER", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path


def _batches(count: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g) for _ in range(count)]


def _loss(model, ids) -> torch.Tensor:
    return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


def _train(engine, plain, optimizer, batches) -> list[tuple[float, float]]:
    pairs = []
    for ids in batches:
        loss = _loss(engine, ids)
        engine.backward(loss)
        engine.step()
        ref = _loss(plain, ids)
        ref.backward()
        optimizer.step()
        optimizer.zero_grad()
        pairs.append((loss.item(), ref.item()))
    return pairs


def _runs(state: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in (state / "tierstack" / "runs").glob("*.json")]


def test_a_model_built_under_zero_init_is_never_whole_and_trains_as_the_plain_one(alone):
    torch.manual_seed(0)
    plain = Net()
    torch.manual_seed(0)
    # A live budget below one block: nearly every parameter is parked as the model is built.
    with tierstack.zero.Init(config_dict_or_path=_config(alone / "nvme"), host_bytes=4096):
        model = Net()
    parked = [n for n, p in model.named_parameters() if type(p).__name__ == "OffloadedParameter"]
    assert len(parked) >= len(list(model.parameters())) - 2  # the last registered stay live
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in plain.parameters())
    spills = _runs(alone / "state")
    assert len(spills) == 1 and Path(spills[0]["directories"][0]).is_dir()
    # The same numbers as a plain construction: the inits ran (the model's own included).
    with tierstack.zero.GatheredParameters(list(model.parameters())):
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert torch.equal(p, q), name
    engine, _, _, _ = tierstack.initialize(model=model, config=_config(alone / "nvme"))
    try:
        assert not Path(spills[0]["directories"][0]).exists()  # every block taken: the spill went
        optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.0)
        for ours, theirs in _train(engine, plain, optimizer, _batches(3)):
            assert ours == pytest.approx(theirs, abs=1e-5)
    finally:
        engine.close()
    assert _runs(alone / "state") == []


def test_the_engines_model_shows_every_parameter_and_saves_with_real_values(alone, tmp_path):
    torch.manual_seed(0)
    model = Net()
    plain = copy.deepcopy(model)
    engine, _, _, _ = tierstack.initialize(model=model, config=_config(alone / "nvme"))
    try:
        optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.0)
        _train(engine, plain, optimizer, _batches(2))
        # Every key, every parameter, with its shape: the offloaded blocks are not dropped.
        names = [n for n, _ in engine.module.named_parameters()]
        assert names == [n for n, _ in plain.named_parameters()]
        assert sum(p.numel() for p in engine.module.parameters()) == sum(
            p.numel() for p in plain.parameters())
        up = engine.module.blocks[0].up
        assert isinstance(up, nn.Linear) and up.weight.shape == (2 * DIM, DIM)
        with pytest.raises(OffloadedTensorError, match=r"blocks\.0\.up\.weight .*save_16bit_model"):
            up.weight.sum()
        with pytest.raises(OffloadedTensorError, match="GatheredParameters"):
            engine.module.blocks[1].down.weight.tolist()
        # The most common save line, then a plain model from it: the engine's outputs.
        torch.save(engine.module.state_dict(), tmp_path / "model.pt")
        reloaded = Net()
        reloaded.load_state_dict(torch.load(tmp_path / "model.pt"))
        ids = _batches(1)[0][:, :-1]
        engine.eval()
        reloaded.eval()
        with torch.no_grad():
            assert torch.equal(engine(ids), reloaded(ids))
            # ... and the weights plain PyTorch trained to, within AdamW's rounding.
            for (name, ours), theirs in zip(reloaded.state_dict().items(), plain.state_dict().values()):
                assert torch.allclose(ours, theirs, atol=1e-5), name
    finally:
        engine.close()


def test_a_change_made_inside_gathered_parameters_reaches_training(alone):
    torch.manual_seed(0)
    model = Net()
    plain = copy.deepcopy(model)
    engine, _, _, _ = tierstack.initialize(model=model, config=_config(alone / "nvme"))
    try:
        optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.0)
        batches = _batches(5)
        _train(engine, plain, optimizer, batches[:2])
        block, head = engine.module.blocks[2], engine.module.head
        with tierstack.zero.GatheredParameters(list(block.parameters()) + [head.weight],
                                               modifier_rank=0):
            assert torch.allclose(block.up.weight, plain.blocks[2].up.weight, atol=1e-5)
            with torch.no_grad():
                block.up.weight.zero_()
                head.weight.mul_(0.5)
        with torch.no_grad():
            plain.blocks[2].up.weight.zero_()
            plain.head.weight.mul_(0.5)
        assert type(block.up.weight).__name__ == "OffloadedParameter"  # parked again after
        # A read-only gather changes nothing, whatever the body does.
        with tierstack.zero.GatheredParameters([block.down.weight]):
            with torch.no_grad():
                block.down.weight.add_(1.0)
        with torch.no_grad():
            engine.eval()
            assert engine.module.state_dict()["blocks.2.up.weight"].abs().max() == 0
            assert torch.allclose(engine.module.state_dict()["blocks.2.down.weight"],
                                  plain.blocks[2].down.weight, atol=1e-5)
            engine.train()
        for ours, theirs in _train(engine, plain, optimizer, batches[2:]):
            assert ours == pytest.approx(theirs, abs=1e-5)  # the masters moved with the weights
    finally:
        engine.close()
