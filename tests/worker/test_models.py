"""Models built on the meta device and created one block at a time (the CLI's and the
jobs' way): the built-in GPT, and Hugging Face models from a config or local weights."""

from __future__ import annotations

import json

import pytest
import torch

from tierstack.config import load_config
from tierstack.errors import ConfigError
from tierstack.module_tiers import ModuleTiers
from tierstack.worker.engine.offload_engine import OffloadEngine, materialize
from tierstack.worker.jobs.gpt import GPT, GPTConfig, build_gpt
from tierstack.worker.store.layer_store import LayerStore

NVME = load_config({"train": {"params": {"device": "nvme"}, "optimizer_state": {"device": "nvme"}}}).train


@pytest.fixture
def daemon(shared_daemon):
    """One daemon for this module: every test uses only its own jobs (conftest.shared_daemon)."""
    return shared_daemon


def test_build_gpt_creates_on_the_cpu_the_weights_an_eager_gpt_has():
    config = GPTConfig(dim=32, heads=2, layers=3, seq_len=16)
    torch.manual_seed(3)
    eager = GPT(config)
    torch.manual_seed(3)
    lazy = build_gpt(config, "cpu")
    assert all(p.is_meta for p in lazy.blocks.parameters()) and not lazy.embed.weight.is_meta
    for block in lazy.blocks:  # what the engine does: each block just before it is stored ...
        materialize(block, "cpu")
    materialize(lazy, "cpu")  # ... then the rest, leaving what exists alone
    assert eager.state_dict().keys() == lazy.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(eager.state_dict().values(), lazy.state_dict().values()))


def test_a_tier_override_that_names_no_module_lists_the_modules_there_are(daemon):
    with torch.device("meta"):
        model = GPT(GPTConfig(dim=32, heads=2, layers=3, seq_len=16))
    names = [n for n, _ in model.named_modules()]
    ModuleTiers({"blocks[0-1]": "gpu", "blocks[2].fc": "cpu"}).check_matches(names)
    train = load_config({"train": {"tier_overrides": {"encoder.layer[0-2]": "gpu"}}}).train
    with LayerStore("no-match", device="cpu", address=daemon.address, durable=False) as store:
        with pytest.raises(ConfigError) as e:
            OffloadEngine(model, store, train)
    assert str(e.value) == (
        "train.tier_overrides['encoder.layer[0-2]'] names no module of this model; its modules "
        "are: embed, pos, blocks, blocks[0-2], blocks[0-2].ln1, blocks[0-2].qkv, blocks[0-2].proj, "
        "blocks[0-2].ln2, blocks[0-2].fc, blocks[0-2].out, ln, head")
    with pytest.raises(ConfigError, match=r"blocks\[5-\]'\] names no module"):
        ModuleTiers({"blocks[5-]": "gpu"}).check_matches(names)


LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256}


def _loss(model, ids) -> float:
    logits = model(ids, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).item()


def test_hugging_face_weights_are_loaded_block_by_block_exactly(daemon, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tierstack.worker.jobs import hf_model

    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    eager.save_pretrained(tmp_path / "llama")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = _loss(eager, ids)
    hf = hf_model.build(tmp_path / "llama")  # auto: the directory has weights
    assert hf.source == "weights" and hf.blocks_attr == "model.layers"
    assert all(p.is_meta for p in hf.model.parameters())
    with LayerStore("hf-weights", device="cpu", device_budget=64 << 20, address=daemon.address,
                    durable=False) as store:
        engine = OffloadEngine(hf.model, store, NVME, blocks_attr=hf.blocks_attr, initialize=hf.initialize)
        try:
            loss = engine.train_step(ids, ids)  # the loss of the weights before the step
        finally:
            engine.close()
    assert loss == expected


def test_hugging_face_models_from_a_config_train_with_ties_and_rotary_tables(daemon, tmp_path):
    """GPT-2 (its head tied to the token embedding) and LLaMA (RMSNorm, rotary tables, none
    of which reset_parameters would create) initialised by Hugging Face's own init."""
    transformers = pytest.importorskip("transformers")
    from tierstack.worker.jobs import hf_model

    configs = {"gpt2": transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256,
                                               n_positions=64, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0),
               "llama": transformers.LlamaConfig(**LLAMA)}
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    for name, config in configs.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config.to_dict()))
        hf = hf_model.build(path)
        assert hf.source == "config"
        with LayerStore(f"hf-{name}", device="cpu", device_budget=64 << 20, address=daemon.address,
                        durable=False) as store:
            engine = OffloadEngine(hf.model, store, NVME, blocks_attr=hf.blocks_attr,
                                   initialize=hf.initialize)
            try:
                losses = [engine.train_step(ids, ids) for _ in range(3)]
            finally:
                engine.close()
        assert not any(p.is_meta for p in hf.model.parameters())
        # Freshly initialised: about ln(256) = 5.55, falling (garbage would be nan or huge).
        assert 5.0 < losses[0] < 6.0 and losses[-1] < losses[0], (name, losses)
        if name == "gpt2":
            assert hf.model.lm_head.weight is hf.model.transformer.wte.weight


def test_a_transformers_4_rotary_table_is_computed_when_its_block_is_created():
    """transformers 4.x computes a rotary embedding's inv_freq only in __init__ (on the meta
    device: nothing) and its _init_weights leaves it alone; the engine's init computes it."""
    transformers = pytest.importorskip("transformers")
    from tierstack.worker.jobs import hf_model

    class Rotary4x(torch.nn.Module):  # transformers 4.x's LlamaRotaryEmbedding, in short
        def __init__(self, config, device=None):
            super().__init__()
            self.config = config
            self.rope_init_fn = lambda config, device: (
                1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float, device=device) / 16), 1.0)
            inv_freq, self.attention_scaling = self.rope_init_fn(config, device)
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            self.original_inv_freq = self.inv_freq

    hf = hf_model.from_config(transformers.LlamaConfig(**LLAMA))
    with torch.device("meta"):
        hf.model.model.rotary_emb = Rotary4x(hf.model.config)
    hf.initialize(hf.model, torch.device("cpu"))
    want = 1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16)
    rotary = hf.model.model.rotary_emb
    assert torch.equal(rotary.inv_freq, want) and rotary.original_inv_freq is rotary.inv_freq


def test_a_config_that_is_not_a_transformers_config_is_refused_by_name(tmp_path):
    pytest.importorskip("transformers")
    from tierstack.worker.jobs import hf_model

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ConfigError, match=r'the config has no "model_type"'):
        hf_model.build(path)
    with pytest.raises(ConfigError, match="--hf-init weights needs a model directory"):
        path.write_text(json.dumps({"model_type": "llama", **LLAMA}))
        hf_model.build(path, "weights")
