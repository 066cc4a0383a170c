"""The engine as the config places it: per-module tiers, gradient clipping, the overlapped
optimizer step in the tier manager; always against plain PyTorch on the same seed and data."""

import copy
import logging

import pytest
import torch

from tests.worker.test_offload import TinyGPT, assert_hf_steps_match
from tierstack.config import load_config
from tierstack.errors import ConfigError, InvalidArgumentError
from tierstack.worker.engine.offload_engine import OffloadEngine, block_tiers, state_tiers
from tierstack.worker.store.layer_store import LayerStore

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@pytest.fixture
def daemon(shared_daemon):
    """One daemon for this module: every test uses only its own jobs (conftest.shared_daemon)."""
    return shared_daemon


def _data(seed, count):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (4, 32), generator=g), torch.randint(0, 256, (4, 32), generator=g))
            for _ in range(count)]


def _plain_losses(model, batches, clip=0.0):
    opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses


def _train_config(**train):
    optimizer = {"lr": HYPER["lr"], "betas": list(HYPER["betas"]), "eps": HYPER["eps"],
                 "weight_decay": HYPER["weight_decay"]}
    return load_config({"tier_manager": {"nvme_pool": {"paths": ["/unused"]}},
                        "train": {"optimizer": optimizer, **train}}).train


def test_clipping_matches_clip_grad_norm(daemon):
    torch.manual_seed(0)
    reference = TinyGPT(dim=64, layers=3)
    model = copy.deepcopy(reference)
    batches = _data(3, 6)
    expected = _plain_losses(reference, batches, clip=0.05)  # small: every step clips
    store = LayerStore("clip", device="cpu", device_budget=64 << 20, address=daemon.address, durable=False)
    try:
        engine = OffloadEngine(model, store, _train_config(
            gradient_clipping=0.05, params={"device": "cpu"}))
        got = [engine.train_step(x, y) for x, y in batches]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
        engine.close()
    finally:
        store.close()


def test_tier_overrides_place_each_block_and_training_still_matches(daemon):
    """Block 0 stays on the device, blocks 1-2 are kept in the CPU pool, the rest go out to
    NVMe first when the 16 MiB pool fills (their state is ~18 MiB)."""
    torch.manual_seed(0)
    reference = TinyGPT(dim=160, heads=4, layers=6)
    model = copy.deepcopy(reference)
    batches = _data(4, 4)
    expected = _plain_losses(reference, batches)
    train = _train_config(params={"device": "nvme", "max_in_cpu": 0},
                          tier_overrides={"blocks[0]": "gpu", "blocks[1-2]": "cpu"})
    assert block_tiers(train, "blocks", 6) == ["gpu", "cpu", "cpu", "nvme", "nvme", "nvme"]
    store = LayerStore("tiers", device="cpu", device_budget=64 << 20, address=daemon.address, durable=False)
    read_before = store.tiers.stats().nvme_bytes_read
    try:
        engine = OffloadEngine(model, store, train)
        assert engine.blocks.positions == [1, 2, 3, 4, 5]
        assert isinstance(model.blocks[0], type(reference.blocks[0]))  # a real module, trained on the device
        assert all(p.numel() for p in model.blocks[0].parameters())
        got = [engine.train_step(x, y) for x, y in batches]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
        stats = store.tiers.stats()
        assert stats.nvme_bytes_read > read_before and stats.cpu_used <= stats.cpu_capacity
        for layer in (0, 1):  # model blocks 1 and 2: placed on the CPU tier, never evicted
            for kind in ("params", "exp_avg", "exp_avg_sq"):
                assert store.client.describe(store.key(layer, kind)).in_cpu
        for layer in (2, 3, 4):  # the "nvme" blocks' optimizer state lives on NVMe (the
            for kind in ("exp_avg", "exp_avg_sq"):  # daemon's step streams it there and back)
                info = store.client.describe(store.key(layer, kind))
                assert info.on_nvme and not info.in_cpu
        engine.close()
    finally:
        store.close()


def test_a_bad_tier_names_the_key():
    with pytest.raises(ConfigError, match=r"tier_overrides\['blocks\[1\]'\]"):
        _train_config(tier_overrides={"blocks[1]": "disk"})


def test_a_model_built_on_the_meta_device_is_created_block_by_block_and_trains(daemon):
    """Blocks are materialised one at a time just before they are stored (a model larger
    than host memory is built this way); the persistent parts are created on the device."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = TinyGPT(dim=64, layers=4)
    store = LayerStore("meta", device="cpu", device_budget=64 << 20, address=daemon.address, durable=False)
    try:
        engine = OffloadEngine(model, store, _train_config(precision="bf16"))
        assert not any(p.is_meta for p in model.parameters())
        weights = store.read_layer(2)
        assert all(t.dtype == torch.bfloat16 and t.float().abs().sum() > 0 for n, t in weights.items()
                   if n.endswith("weight"))  # initialised, not left empty
        x, y = _data(5, 1)[0]
        losses = [engine.train_step(x, y) for _ in range(6)]
        assert losses[-1] < losses[0] - 0.1, losses
        engine.close()
    finally:
        store.close()


def test_hugging_face_llama_twenty_steps_with_state_on_nvme_match_plain_adamw(daemon):
    """A LLaMA built from its config, blocks' parameters and AdamW state placed on NVMe
    (max_in_cpu 0) through a 16 MiB CPU pool smaller than that state (~48 MiB): 20 steps'
    losses equal plain PyTorch AdamW on the same seed and data (fp32, rel. 1e-5)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=704,
                                      num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config)
    model = copy.deepcopy(reference)
    ref_opt = torch.optim.AdamW(reference.parameters(), fused=True, **HYPER)
    train = _train_config(params={"device": "nvme", "max_in_cpu": 0},
                          optimizer_state={"device": "nvme", "max_in_cpu": 0})
    store = LayerStore("llama20", device="cpu", device_budget=64 << 20, address=daemon.address,
                       durable=False)
    read_before = store.tiers.stats().nvme_bytes_read
    try:
        engine = OffloadEngine(model, store, train, blocks_attr="model.layers")
        assert engine.tiers == ["nvme"] * 4
        assert_hf_steps_match(reference, ref_opt, model, engine, steps=20, seq=32)
        stats = store.tiers.stats()
        assert stats.nvme_bytes_read > read_before and stats.cpu_used <= stats.cpu_capacity
        assert store.figures().device_peak <= store.figures().device_capacity
        engine.close()
    finally:
        store.close()


def _plain_accumulated_losses(model, batches, micro: int, clip: float = 0.0):
    """Plain PyTorch gradient accumulation: each batch's rows in `micro` equal parts, each
    part's mean loss / micro backpropagated, one AdamW step per batch."""
    opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        parts = []
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            loss = torch.nn.functional.cross_entropy(model(xm).flatten(0, 1), ym.flatten())
            (loss / micro).backward()
            parts.append(loss.detach())
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(torch.stack(parts).mean().item())
    return losses


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_gradient_accumulation_matches_plain_pytorch_accumulating_the_same_micro_batches(daemon, clip):
    """gradient_accumulation_steps 4: each batch of 8 rows is 4 micro-batches of 2, one
    optimizer step. Without clipping each block's daemon-side AdamW starts inside the last
    micro-batch's backward: a block stepped any earlier would use a quarter of its
    gradient and the losses would part at step 2. fp32, same tolerance as one batch.
    Equal micro-batches give the full batch's mean gradient up to rounding, so the device
    traffic shows that the batch really ran as 4 forward/backward passes."""
    torch.manual_seed(0)
    reference = TinyGPT(dim=64, layers=3)
    model = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(6)
    batches = [(torch.randint(0, 256, (8, 32), generator=g), torch.randint(0, 256, (8, 32), generator=g))
               for _ in range(5)]
    expected = _plain_accumulated_losses(reference, batches, micro=4, clip=clip)
    store = LayerStore("accum", device="cpu", device_budget=64 << 20, address=daemon.address, durable=False)
    try:
        engine = OffloadEngine(model, store, _train_config(
            gradient_accumulation_steps=4, gradient_clipping=clip, params={"device": "cpu"}))
        got = [engine.train_step(x, y) for x, y in batches]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
        # Every micro-batch brings every block to the device twice (forward, recompute).
        block_bytes = sum(layout.nbytes for layout in store.layouts)
        assert store.metrics.cpu_to_device_bytes == len(batches) * 4 * 2 * block_bytes
        for i, block in enumerate(reference.blocks):
            stored = engine.blocks.parameters_of(i)
            for name, p in block.named_parameters():
                torch.testing.assert_close(stored[name], p.detach(), rtol=1e-4, atol=1e-6)
        x, y = batches[0]
        with pytest.raises(InvalidArgumentError, match="a batch of 6 rows .* does not split into "
                                                       "train.gradient_accumulation_steps = 4"):
            engine.train_step(x[:6], y[:6])
        assert engine.block_optimizer.steps == len(batches)  # the refused batch counted nothing
        engine.close()
    finally:
        store.close()


def test_optimizer_state_device_places_the_blocks_optimizer_state(daemon):
    """Parameters kept in the 16 MiB CPU pool ("cpu": never evicted), optimizer state out
    of it between steps ("nvme", max_in_cpu 0). Five blocks' parameters (~6 MiB) and AdamW
    moments (~12 MiB) do not fit together, so the moments are the ones that leave."""
    torch.manual_seed(0)
    reference = TinyGPT(dim=160, heads=4, layers=5)
    model = copy.deepcopy(reference)
    batches = _data(8, 3)
    expected = _plain_losses(reference, batches)
    train = _train_config(params={"device": "cpu"}, optimizer_state={"device": "nvme", "max_in_cpu": 0})
    assert block_tiers(train, "blocks", 5) == ["cpu"] * 5
    assert state_tiers(train, "blocks", 5) == ["nvme"] * 5
    store = LayerStore("state-tier", device="cpu", device_budget=64 << 20, address=daemon.address,
                       durable=False)
    read_before = store.tiers.stats().nvme_bytes_read
    try:
        engine = OffloadEngine(model, store, train)
        got = [engine.train_step(x, y) for x, y in batches]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
        assert store.tiers.stats().nvme_bytes_read > read_before
        assert all(store.client.describe(store.key(i)).in_cpu for i in range(5))
        moments = [store.client.describe(store.key(i, kind)) for i in range(5)
                   for kind in ("exp_avg", "exp_avg_sq")]
        assert all(m.on_nvme for m in moments if not m.in_cpu)
        assert sum(not m.in_cpu for m in moments) > 0
        engine.close()
    finally:
        store.close()


def test_state_tiers_follow_overrides_then_the_optimizer_device_then_the_parameters():
    train = _train_config(params={"device": "nvme"}, optimizer_state={"device": "cpu"},
                          tier_overrides={"blocks[0]": "gpu", "blocks[1]": "nvme"})
    assert block_tiers(train, "blocks", 4) == ["gpu", "nvme", "auto", "auto"]
    assert state_tiers(train, "blocks", 4) == ["gpu", "nvme", "cpu", "cpu"]
    train = _train_config(params={"device": "nvme", "max_in_cpu": 0})  # optimizer_state: none
    assert state_tiers(train, "blocks", 2) == ["nvme", "nvme"]


def test_offloading_only_the_optimizer_state_keeps_the_masters_on_the_host(daemon, caplog):
    """DeepSpeed's ZeRO-Offload shape (offload_param none, offload_optimizer cpu): the
    blocks' master copy and optimizer state live on the host, their parameters come to the
    device for each step (and stay from forward to backward where the HBM budget allows),
    the tier manager steps them; it says so, and trains like plain PyTorch."""
    train = _train_config(params={"device": "none"}, optimizer_state={"device": "cpu"})
    with caplog.at_level(logging.INFO, logger="tierstack.worker.engine.offload_engine"):
        assert block_tiers(train, "blocks", 3) == ["cpu"] * 3
        assert state_tiers(train, "blocks", 3) == ["cpu"] * 3
    assert "optimizer state stays on the host (ZeRO-Offload)" in caplog.text
    # With the default params device ("auto"), only the state's tier is pinned.
    assert state_tiers(_train_config(optimizer_state={"device": "cpu"}), "blocks", 2) == ["cpu"] * 2
    torch.manual_seed(0)
    reference = TinyGPT(dim=64, layers=3)
    batches = _data(9, 3)
    expected = _plain_losses(copy.deepcopy(reference), batches)
    store = LayerStore("zero-offload", device="cpu", device_budget=64 << 20,
                       address=daemon.address, durable=False)
    try:
        engine = OffloadEngine(copy.deepcopy(reference), store, train)
        got = [engine.train_step(x, y) for x, y in batches]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
        assert engine.blocks.offloaded() == [0, 1, 2]
        engine.close()
    finally:
        store.close()


def test_a_tensor_larger_than_buffer_size_is_refused_by_block_tensor_and_setting(daemon):
    """DeepSpeed's offload_param.buffer_size: elements per staging buffer. TinyGPT(dim=64)'s
    largest tensors (fc.weight, out.weight) have 4 x 64 x 64 = 16384 elements."""
    def engine(job, **train):
        store = LayerStore(job, device="cpu", device_budget=64 << 20, address=daemon.address, durable=False)
        try:
            torch.manual_seed(0)
            engine = OffloadEngine(TinyGPT(dim=64, layers=2), store, _train_config(**train))
            x, y = _data(9, 1)[0]
            loss = engine.train_step(x, y)
            engine.close()
            return loss
        finally:
            store.close()

    store = LayerStore("small-buffers", device="cpu", device_budget=64 << 20, address=daemon.address,
                       durable=False)
    try:
        with pytest.raises(ConfigError, match=r"block blocks\.0: tensor 'fc\.weight' has 16,384 elements, "
                                              r"more than train\.params\.buffer_size \(16,383\); raise "
                                              r"it to at least 16384"):
            OffloadEngine(TinyGPT(dim=64, layers=2), store,
                                      _train_config(params={"device": "cpu", "buffer_size": 16383}))
        assert store.tiers.stats().tensors == 0  # refused before anything was stored
    finally:
        store.close()
    # The limit itself is allowed; with offload_param off (device none) nothing is staged
    # through its buffers, even for a block an override offloads.
    assert engine("exact-buffers", params={"device": "cpu", "buffer_size": 16384}) > 0
    assert engine("no-param-offload", params={"device": "none", "buffer_size": 1},
                  tier_overrides={"blocks[1]": "cpu"}) > 0


def test_with_no_buffer_size_stated_no_tensor_size_is_refused(daemon, monkeypatch):
    """DeepSpeed's default of 1e8 elements refused every hidden size past ~5,800 (a 6144-wide
    QKV has 113e6): not stated, tierstack sets no limit (it stages whole blocks within the
    device budget). The check must not run at all, whatever the tensors' sizes."""
    import tierstack.worker.engine.offload_engine as engine_module

    def refuse(*args):
        raise AssertionError(f"buffer size checked with no limit stated: {args[-1]}")

    monkeypatch.setattr(engine_module, "_check_buffer_size", refuse)
    store = LayerStore("default-buffers", device="cpu", device_budget=64 << 20, address=daemon.address,
                       durable=False)
    try:
        engine = OffloadEngine(TinyGPT(dim=64, layers=2), store,
                                           _train_config(params={"device": "cpu"}))
        x, y = _data(9, 1)[0]
        assert engine.train_step(x, y) > 0
        engine.close()
    finally:
        store.close()


def test_max_in_cpu_caps_the_parameter_elements_the_cpu_pool_keeps_between_uses(daemon):
    """DeepSpeed's offload_param.max_in_cpu with device nvme: the blocks, in order, keep
    their parameters cached in the CPU pool until their elements pass the cap; the rest
    leave it after each use (as all do with max_in_cpu 0). Blocks a module override places
    are not counted. Training still matches plain AdamW."""
    sizes = [100, 100, 100, 100]
    train = _train_config(params={"device": "nvme", "max_in_cpu": 250})
    assert block_tiers(train, "blocks", 4, sizes) == ["auto", "auto", "nvme", "nvme"]
    assert state_tiers(train, "blocks", 4, sizes) == ["auto", "auto", "nvme", "nvme"]  # with the params
    assert block_tiers(train, "blocks", 4) == ["auto"] * 4  # sizes unknown: the pool decides
    pinned = _train_config(params={"device": "nvme", "max_in_cpu": 250}, tier_overrides={"blocks[0]": "cpu"})
    assert block_tiers(pinned, "blocks", 4, sizes) == ["cpu", "auto", "auto", "nvme"]
    assert block_tiers(_train_config(params={"device": "nvme", "max_in_cpu": 0}), "blocks", 4, sizes) == ["nvme"] * 4

    torch.manual_seed(0)
    reference = TinyGPT(dim=64, heads=4, layers=4)
    model = copy.deepcopy(reference)
    batches = _data(3, 2)
    expected = _plain_losses(reference, batches)
    per_block = sum(p.numel() for p in reference.blocks[0].parameters())
    train = _train_config(params={"device": "nvme", "max_in_cpu": 2 * per_block})
    store = LayerStore("max-in-cpu", device="cpu", device_budget=64 << 20, address=daemon.address, durable=False)
    try:
        engine = OffloadEngine(model, store, train)
        assert engine.tiers == engine.state_tiers == ["auto", "auto", "nvme", "nvme"]
        got = [engine.train_step(x, y) for x, y in batches]
        engine.close()
    finally:
        store.close()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
