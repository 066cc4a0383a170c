"""Offloaded blocks against plain PyTorch, same seed and data, with a real daemon."""

import copy

import pytest
import torch

from tierstack.worker.jobs.gpt import GPT, GPTConfig
from tierstack.worker.store.layer_store import LayerStore
from tierstack.worker.engine.block_views import is_parked
from tierstack.worker.engine.offloaded_blocks import OffloadedBlocks


@pytest.fixture
def daemon(shared_daemon):
    """One daemon for this module: every test uses only its own jobs (conftest.shared_daemon)."""
    return shared_daemon


def _train_config_of(optimizer=None, **train):
    """A TrainConfig with `optimizer` (an OptimizerConfig) and a prefetch depth of 2."""
    from tierstack.config import OptimizerConfig, ParamOffloadConfig, TrainConfig
    return TrainConfig(optimizer=optimizer or OptimizerConfig(),
                       params=ParamOffloadConfig(buffer_count=3), **train)


def TinyGPT(vocab=256, dim=64, heads=4, layers=6, seq=32) -> GPT:
    return GPT(GPTConfig(vocab_size=vocab, seq_len=seq, dim=dim, heads=heads, layers=layers))


def test_offloaded_forward_and_backward_match_plain_pytorch(daemon):
    torch.manual_seed(0)
    reference = TinyGPT()
    model = copy.deepcopy(reference)
    idx = torch.randint(0, 256, (4, 32))
    targets = torch.randint(0, 256, (4, 32))

    ref_loss = torch.nn.functional.cross_entropy(reference(idx).flatten(0, 1), targets.flatten())
    ref_loss.backward()

    layer_bytes = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    store = LayerStore("gpt", device="cpu", device_budget=4 * layer_bytes, address=daemon.address)
    try:
        blocks = OffloadedBlocks(model.blocks, store, prefetch_depth=2)
        # The blocks stay in the model, parked: every parameter there with its shape, none
        # with its bytes (they are in the tiers).
        assert all(is_parked(p) for p in model.blocks.parameters())
        assert [p.shape for p in model.blocks.parameters()] == [
            p.shape for p in reference.blocks.parameters()]
        loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
        assert torch.equal(loss, ref_loss)
        loss.backward()
        for i, ref_block in enumerate(reference.blocks):
            grads = blocks.gradients(i)
            for name, p in ref_block.named_parameters():
                torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7)
        for name in ("embed", "pos", "ln", "head"):
            for (n, p), (_, q) in zip(getattr(reference, name).named_parameters(),
                                      getattr(model, name).named_parameters()):
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7)
        assert store.figures().device_peak <= store.figures().device_capacity
        assert store.resident_layers() == []
    finally:
        store.close()


def test_twenty_steps_with_state_on_nvme_match_plain_adamw(daemon):
    """Per-step losses equal plain PyTorch AdamW (fp32, same seed and data), with the
    parameters and optimizer states of 6 blocks (~75 MB with grads and moments) going
    through a 16 MiB CPU pool to NVMe."""
    from tierstack.config import OptimizerConfig
    from tierstack.worker.engine.tiered_adamw import TieredAdamW
    torch.manual_seed(0)
    reference = TinyGPT(dim=256, heads=8, layers=6)
    model = copy.deepcopy(reference)
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), fused=True, **hyper)
    layer_bytes = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    store = LayerStore("train", device="cpu", device_budget=4 * layer_bytes, address=daemon.address,
                       durable=False)
    try:
        blocks = OffloadedBlocks(model.blocks, store)
        persistent = [p for p in model.parameters() if not is_parked(p)]  # not the blocks' own
        opt = torch.optim.AdamW(persistent, fused=True, **hyper)
        tiered = TieredAdamW(blocks, OptimizerConfig(lr=1e-3, betas=[0.9, 0.95], eps=1e-8,
                                                     weight_decay=0.1))
        data = torch.Generator().manual_seed(1)
        read_before = store.tiers.stats().nvme_bytes_read
        for step in range(20):
            idx = torch.randint(0, 256, (4, 32), generator=data)
            targets = torch.randint(0, 256, (4, 32), generator=data)
            ref_loss = torch.nn.functional.cross_entropy(reference(idx).flatten(0, 1), targets.flatten())
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
            loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
            opt.zero_grad()
            blocks.new_gradients()  # the blocks' zero_grad: this backward starts a new window
            loss.backward()
            opt.step()
            tiered.step()
            assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item()), step
        stats = store.tiers.stats()
        assert stats.nvme_bytes_read > read_before and stats.cpu_used <= stats.cpu_capacity
        for i, ref_block in enumerate(reference.blocks):  # the weights themselves agree too
            stored = blocks.parameters_of(i)
            for name, p in ref_block.named_parameters():
                torch.testing.assert_close(stored[name], p.detach(), rtol=1e-5, atol=1e-6)
    finally:
        store.close()


def _hf_matches_plain(daemon, model_factory, blocks_attr, job):
    """Three AdamW steps of a Hugging Face model: offloaded vs plain, fp32, same data."""
    from tierstack.config import OptimizerConfig
    from tierstack.worker.engine.offload_engine import OffloadEngine
    torch.manual_seed(0)
    reference = model_factory()
    model = copy.deepcopy(reference)
    ref_opt = torch.optim.AdamW(reference.parameters(), fused=True, lr=1e-3, weight_decay=0.01)
    store = LayerStore(job, device="cpu", device_budget=64 << 20, address=daemon.address, durable=False)
    try:
        engine = OffloadEngine(model, store, _train_config_of(OptimizerConfig(lr=1e-3, weight_decay=0.01)),
                               blocks_attr=blocks_attr)
        assert_hf_steps_match(reference, ref_opt, model, engine, steps=3, seq=24)
    finally:
        store.close()


def assert_hf_steps_match(reference, ref_opt, model, engine, steps: int, seq: int) -> None:
    """`steps` steps of a Hugging Face causal LM, plain vs offloaded on the same random
    batches: per-step losses equal within 1e-5 relative."""
    data = torch.Generator().manual_seed(2)
    for step in range(steps):
        ids = torch.randint(0, 256, (2, seq), generator=data)
        ref_loss = reference(input_ids=ids, labels=ids, use_cache=False).loss
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        engine.zero_grad()
        loss.backward()
        engine.step()
        assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item()), step


def test_hugging_face_llama_from_config_matches_plain_pytorch(daemon):
    transformers = __import__("pytest").importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    _hf_matches_plain(daemon, lambda: transformers.LlamaForCausalLM(config), "model.layers", "llama")


def test_hugging_face_gpt2_from_config_matches_plain_pytorch(daemon):
    transformers = __import__("pytest").importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=4, n_head=4, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    _hf_matches_plain(daemon, lambda: transformers.GPT2LMHeadModel(config), "transformer.h", "gpt2")


def _steps(engine, data_seed, count):
    data = torch.Generator().manual_seed(data_seed)
    losses = []
    for _ in range(count):
        idx = torch.randint(0, 256, (4, 32), generator=data)
        targets = torch.randint(0, 256, (4, 32), generator=data)
        losses.append(engine.train_step(idx, targets))
    return losses


def test_resume_after_step_10_reproduces_steps_11_to_20(daemon, tmp_path):
    from tierstack.config import OptimizerConfig
    from tierstack.worker.engine.checkpoint import load_checkpoint, save_checkpoint
    from tierstack.worker.engine.offload_engine import OffloadEngine
    torch.manual_seed(0)
    store = LayerStore("run-a", device="cpu", device_budget=64 << 20, address=daemon.address, durable=False)
    try:
        engine = OffloadEngine(TinyGPT(dim=128, heads=4, layers=4), store, _train_config_of())
        _steps(engine, 1, 10)
        save_checkpoint(engine, tmp_path / "ckpt")
        expected = _steps(engine, 2, 10)
    finally:
        store.close()
    torch.manual_seed(123)  # a differently initialised model: everything must come from the checkpoint
    store = LayerStore("run-b", device="cpu", device_budget=64 << 20, address=daemon.address, durable=False)
    try:
        engine = OffloadEngine(TinyGPT(dim=128, heads=4, layers=4), store, _train_config_of())
        load_checkpoint(engine, tmp_path / "ckpt")
        assert _steps(engine, 2, 10) == expected  # bit for bit
    finally:
        store.close()


def test_a_checkpoint_is_replaced_whole_or_not_at_all_and_verified_on_load(daemon, tmp_path, monkeypatch):
    """A save that dies after its first block file leaves the previous checkpoint whole (it
    once left a mix of steps that loaded silently); a damaged file is refused on load."""
    import pytest
    from tierstack.config import OptimizerConfig
    from tierstack.errors import DataCorruptionError
    from tierstack.worker.engine import checkpoint
    from tierstack.worker.engine.offload_engine import OffloadEngine
    store = LayerStore("ckpt", device="cpu", device_budget=64 << 20, address=daemon.address, durable=False)
    try:
        saved = tmp_path / "checkpoints" / "ckpt"
        engine = OffloadEngine(TinyGPT(dim=32, heads=2, layers=3), store, _train_config_of())
        _steps(engine, 1, 1)
        checkpoint.save_checkpoint(engine, saved, extra={"step": 1})
        _steps(engine, 2, 1)
        real_save, calls = checkpoint.save_file, []

        def dies_after_the_first(*args, **kwargs):
            calls.append(1)
            if len(calls) > 1:
                raise OSError("killed")  # the process dying mid-save
            real_save(*args, **kwargs)

        monkeypatch.setattr(checkpoint, "save_file", dies_after_the_first)
        with pytest.raises(OSError, match="killed"):
            checkpoint.save_checkpoint(engine, saved, extra={"step": 2})
        monkeypatch.undo()
        assert checkpoint.load_checkpoint(engine, saved) == {"step": 1}
        checkpoint.save_checkpoint(engine, saved, extra={"step": 2})  # replaces it
        assert [p.name for p in saved.parent.iterdir()] == ["ckpt"]  # nothing left aside
        assert checkpoint.load_checkpoint(engine, saved) == {"step": 2}
        block = saved / "block-00001.safetensors"
        data = bytearray(block.read_bytes())
        data[-1] ^= 0xFF
        block.write_bytes(bytes(data))
        with pytest.raises(DataCorruptionError, match="block-00001"):
            checkpoint.load_checkpoint(engine, saved)
    finally:
        store.close()


def test_export_loads_with_hugging_face_from_pretrained(daemon, tmp_path):
    transformers = __import__("pytest").importorskip("transformers")
    from tierstack.config import OptimizerConfig
    from tierstack.worker.engine.checkpoint import export_safetensors
    from tierstack.worker.engine.offload_engine import OffloadEngine
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    store = LayerStore("export", device="cpu", device_budget=64 << 20, address=daemon.address, durable=False)
    try:
        engine = OffloadEngine(model, store, _train_config_of(OptimizerConfig(lr=1e-2)), blocks_attr="model.layers")
        ids = torch.randint(0, 256, (2, 16))
        for _ in range(2):  # move the weights away from their initial values
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            engine.zero_grad()
            loss.backward()
            engine.step()
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
        export_safetensors(engine, tmp_path / "hf")
        loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids, use_cache=False).logits, logits)
    finally:
        store.close()


def test_bf16_with_fp32_masters_matches_the_same_recipe_in_plain_pytorch(daemon):
    """bf16 compute, fp32 AdamW masters: offloaded vs that recipe written out in PyTorch.

    Tolerance 1e-3 relative, an eighth of bf16's epsilon (7.8e-3): the recomputed block's
    autograd.grad may add bf16 gradient contributions in another order than one whole-model
    backward, which moves the loss by ~1e-5 relative per step (seen: 2e-5 at step 1).
    """
    from tierstack.config import OptimizerConfig
    from tierstack.worker.engine.offload_engine import OffloadEngine
    torch.manual_seed(0)
    reference = TinyGPT(dim=128, heads=4, layers=4)
    model = copy.deepcopy(reference)
    masters = [p.detach().float().clone().requires_grad_() for p in reference.parameters()]
    reference.to(torch.bfloat16)
    ref_opt = torch.optim.AdamW(masters, fused=True, lr=1e-3, weight_decay=0.01)
    store = LayerStore("bf16", device="cpu", device_budget=64 << 20, address=daemon.address, durable=False)
    try:
        engine = OffloadEngine(model, store, _train_config_of(OptimizerConfig(lr=1e-3, weight_decay=0.01),
                                                             precision="bf16"))
        assert store.layouts[0].slots[0].dtype == "bfloat16"  # half the bytes move
        data = torch.Generator().manual_seed(3)
        for step in range(10):
            idx = torch.randint(0, 256, (4, 32), generator=data)
            targets = torch.randint(0, 256, (4, 32), generator=data)
            ref_loss = torch.nn.functional.cross_entropy(reference(idx).flatten(0, 1).float(), targets.flatten())
            for p in reference.parameters():
                p.grad = None
            ref_loss.backward()
            for p, m in zip(reference.parameters(), masters):
                m.grad = p.grad.float()
            ref_opt.step()
            with torch.no_grad():
                for p, m in zip(reference.parameters(), masters):
                    p.copy_(m)
            loss = engine.train_step(idx, targets)
            assert abs(loss - ref_loss.item()) <= 1e-3 * abs(ref_loss.item()), step
        saved = store.read_layer(0, "master")  # the masters stay fp32
        assert saved["qkv.weight.master"].dtype == torch.float32
    finally:
        store.close()


def assert_block_grads_match(blocks, reference):
    for i, block in enumerate(reference.blocks):
        grads = blocks.gradients(i)
        for name, p in block.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7)


def _engine_pair(daemon, job, factory, **engine_kwargs):
    from tierstack.config import OptimizerConfig
    from tierstack.worker.engine.offload_engine import OffloadEngine
    torch.manual_seed(0)
    reference = factory()
    model = copy.deepcopy(reference)
    store = LayerStore(job, device="cpu", device_budget=64 << 20, address=daemon.address, durable=False)
    return reference, model, store, OffloadEngine(model, store, _train_config_of(**engine_kwargs))


def test_gradients_accumulate_over_micro_batches_and_repeated_blocks(daemon):
    reference, model, store, engine = _engine_pair(daemon, "accum", lambda: TinyGPT(dim=64, layers=3))
    try:
        batches = [torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
        engine.zero_grad()
        for idx in batches:  # two micro-batches, one window
            reference_loss = torch.nn.functional.cross_entropy(reference(idx).flatten(0, 1), idx.flatten())
            reference_loss.backward()
            torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        assert_block_grads_match(engine.blocks, reference)
    finally:
        store.close()


def test_frozen_embedding_still_trains_the_blocks_and_dropout_is_replayed(daemon):
    def factory():
        m = TinyGPT(dim=64, layers=2)
        m.embed.weight.requires_grad_(False)
        m.pos.weight.requires_grad_(False)
        for b in m.blocks:  # dropout inside the blocks: the recompute must draw the same mask
            b.fc = torch.nn.Sequential(b.fc, torch.nn.Dropout(0.3))
        return m
    reference, model, store, engine = _engine_pair(daemon, "frozen", factory)
    try:
        idx = torch.randint(0, 256, (2, 32))
        torch.manual_seed(7)
        torch.nn.functional.cross_entropy(reference(idx).flatten(0, 1), idx.flatten()).backward()
        engine.zero_grad()
        torch.manual_seed(7)
        torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        assert_block_grads_match(engine.blocks, reference)
    finally:
        store.close()


def test_a_step_without_gradients_is_refused_and_counts_nothing(daemon):
    _, _, store, engine = _engine_pair(daemon, "nograd", lambda: TinyGPT(dim=64, layers=2))
    try:
        engine.zero_grad()
        import pytest
        from tierstack.errors import InvalidArgumentError
        with pytest.raises(InvalidArgumentError, match="no gradients since the last zero_grad"):
            engine.block_optimizer.step()
        assert engine.block_optimizer.steps == 0
    finally:
        store.close()


def test_unsupported_blocks_are_refused_by_name(daemon):
    import pytest
    from tierstack.errors import InvalidArgumentError
    store = LayerStore("refuse", device="cpu", device_budget=64 << 20, address=daemon.address)
    try:
        tied = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        tied[1].weight = tied[0].weight
        with pytest.raises(InvalidArgumentError, match="tied inside a block"):
            OffloadedBlocks(torch.nn.ModuleList([tied]), store)
        with pytest.raises(InvalidArgumentError, match="running statistics"):
            OffloadedBlocks(torch.nn.ModuleList([torch.nn.BatchNorm1d(4)]), store)
    finally:
        store.close()


def test_a_budget_of_two_layers_is_enough_whatever_the_prefetch_depth(daemon):
    torch.manual_seed(0)
    model = TinyGPT(dim=64, layers=4)
    from tierstack.worker.store.layer_store import layer_tensors
    from tierstack.worker.store.layout import LayerLayout
    layer = LayerLayout.of(layer_tensors(model.blocks[0])).nbytes
    store = LayerStore("tight", device="cpu", device_budget=2 * layer, address=daemon.address)
    try:
        OffloadedBlocks(model.blocks, store, prefetch_depth=3)  # parks the blocks' parameters
        idx = torch.randint(0, 256, (2, 32))
        torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        assert store.figures().device_peak <= 2 * layer and store.resident_layers() == []
    finally:
        store.close()
