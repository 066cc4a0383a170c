"""Checkpoint, resume and export of a partitioned job: 2 gloo ranks, each with its own
tier-manager daemon, saving through worker/checkpoint.py (rank 0 writes)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from tierstack.config import OptimizerConfig
from tierstack.worker.jobs.gpt import GPTConfig
from tierstack.worker.jobs.partitioned_job import (PartitionedSpec, launch_partitioned,
                                                   small_embedded_node)


def _spec(**changes) -> PartitionedSpec:
    spec = PartitionedSpec(gpt=GPTConfig(vocab_size=256, seq_len=16, dim=32, heads=2, layers=2),
                           steps=4, global_batch=4, seed=5, data="random",
                           optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.1),
                           precision="bf16", device="cpu", cpu_threads=1, embedded=small_embedded_node(size_mib=1),
                           collect_state=True)
    for k, v in changes.items():
        setattr(spec, k, v)
    return spec


def _assert_same_state(a: dict, b: dict) -> None:
    for block_a, block_b in zip(a["blocks"], b["blocks"], strict=True):
        assert block_a.keys() == block_b.keys()
        for name in block_a:
            assert torch.equal(block_a[name], block_b[name]), name
    for name in a["persistent"]:
        assert torch.equal(a["persistent"][name], b["persistent"][name]), name


def test_two_ranks_resumed_from_a_checkpoint_continue_bit_for_bit(tmp_path):
    """2 steps, a checkpoint, a fresh pair of ranks and daemons resumed from it for steps
    3-4 == 4 steps in one go (which saved after step 2 and replaced that at the end): the
    same losses and weights, exactly. bf16 blocks, so the fp32 masters and the moments are
    in the checkpoint too, gathered from both ranks' shards. Another run's checkpoint is
    refused by what differs."""
    whole = launch_partitioned(_spec(checkpoint_dir=str(tmp_path / "whole"), checkpoint_every=2), 2)
    assert not list(tmp_path.glob(".*.writing"))  # rank 0 wrote it, alone, into place
    checkpoint = str(tmp_path / "ckpt")
    launch_partitioned(_spec(steps=2, checkpoint_dir=checkpoint), 2)
    saved = json.loads((tmp_path / "ckpt" / "checkpoint.json").read_text())["files"]
    assert {"block-00000.safetensors", "block-00001.safetensors", "engine.pt"} <= set(saved)
    with safe_open(str(tmp_path / "ckpt" / "block-00000.safetensors"), "pt") as f:
        assert {"qkv.weight.master", "qkv.weight.exp_avg", "qkv.weight.exp_avg_sq"} <= set(f.keys())

    rest = launch_partitioned(_spec(checkpoint_dir=checkpoint, resume=True), 2)
    losses = [s.loss for s in whole[0].steps]
    for r in rest:
        assert [s.loss for s in r.steps] == losses[2:]
    _assert_same_state(rest[0].state, whole[0].state)

    with pytest.raises(Exception, match="seed"):
        launch_partitioned(_spec(checkpoint_dir=str(tmp_path / "whole"), resume=True, seed=6, steps=5), 1)


def _llama_config():
    import transformers
    return transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=64)


def _llama_rank(env, out_dir: str, steps: int) -> None:
    """One rank of a partitioned Hugging Face LLaMA, its own daemon; exports at the end."""
    import tempfile

    import transformers

    from tierstack.config import load_config
    from tierstack.services.tier_manager.embedded import EmbeddedTierManager
    from tierstack.worker.checkpoint import export_safetensors
    from tierstack.worker.distributed import init_process_group
    from tierstack.worker.jobs.partitioned_job import rank_slice
    from tierstack.worker.sharded_engine import ShardedEngine
    from tierstack.worker.sharded_store import ShardedLayerStore

    torch.set_num_threads(1)
    init_process_group(env, torch.device("cpu"))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config())
    tm = load_config({"tier_manager": small_embedded_node(size_mib=1)}).tier_manager
    tm.nvme_pool.paths = [tempfile.mkdtemp(prefix=f"llama-export-rank{env.rank}-")]
    tm.manifest_path = ""
    with EmbeddedTierManager(tm) as daemon:
        store = ShardedLayerStore("llama", device="cpu", device_budget=64 << 20,
                                  address=daemon.address, durable=False)
        engine = ShardedEngine(model, store, OptimizerConfig(lr=1e-3, weight_decay=0.01),
                               blocks_attr="model.layers")
        data = torch.Generator().manual_seed(2)
        for _ in range(steps):
            ids = rank_slice(torch.randint(0, 256, (4, 24), generator=data), env.rank, env.world_size)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            engine.zero_grad()
            loss.backward()
            engine.step()
        export_safetensors(engine, f"{out_dir}/export")
        store.close()
    torch.distributed.destroy_process_group()


def test_a_partitioned_llama_exports_what_from_pretrained_loads(tmp_path):
    """Both ranks export (each block gathered); the files are what plain PyTorch trained."""
    transformers = pytest.importorskip("transformers")
    from tierstack.worker.distributed import launch_local
    steps = 2
    launch_local(_llama_rank, 2, str(tmp_path), steps)
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "export",
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info

    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(_llama_config())
    opt = torch.optim.AdamW(reference.parameters(), fused=True, lr=1e-3, weight_decay=0.01)
    data = torch.Generator().manual_seed(2)
    for _ in range(steps):
        ids = torch.randint(0, 256, (4, 24), generator=data)
        loss = reference(input_ids=ids, labels=ids, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    want = dict(reference.named_parameters())
    for name, p in loaded.named_parameters():  # summation order only (test_sharded.py)
        torch.testing.assert_close(p.detach(), want[name].detach(), rtol=1e-4, atol=1e-5)
