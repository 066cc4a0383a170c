"""`tierstack zero-to-fp32` and tierstack.utils.zero_to_fp32: a checkpoint tierstack trained and
saved, consolidated offline (no tier manager, no model code), loads with Hugging Face's
from_pretrained and with load_state_dict, and the loaded model computes what the engine
computed. Tiny transformers models built from their configs (no downloads)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

import tierstack  # noqa: E402
from tests.worker.test_hf_trainer import RUN, _Tokens  # noqa: E402
from tierstack.utils import zero_to_fp32  # noqa: E402
from tierstack.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: E402
from tierstack.worker.api import hf_trainer  # noqa: E402

VOCAB, SEQ = 97, 12


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierstack.cli", "zero-to-fp32", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def test_a_trainer_checkpoint_of_gpt2_loads_with_from_pretrained_and_load_state_dict(tmp_path, monkeypatch):
    """GPT-2 (its head tied to its embedding) through tierstack's Trainer, with the tier
    manager it starts itself; the checkpoint it saves (checkpoint-3/global_step3 + latest)
    consolidated by the command, in shards with their index, loads with from_pretrained;
    the Python API's state dict (the tied head under both names) with a strict
    load_state_dict: both give the engine's logits exactly."""
    monkeypatch.delenv("TIERSTACK_TIER_MANAGER", raising=False)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    trainer = hf_trainer.Trainer(model=model, args=hf_trainer.TrainingArguments(
        output_dir=str(tmp_path / "run"), **{**RUN, "max_steps": 3, "save_strategy": "steps",
                                             "save_steps": 3}), train_dataset=_Tokens(24, 1))
    try:
        trainer.train()
        model.eval()
        with torch.no_grad():
            expected = model(_ids(5)).logits
    finally:
        trainer.end()
    checkpoint = tmp_path / "run" / "checkpoint-3"
    done = _cli(checkpoint, tmp_path / "fp32", "--max-shard-size", "40KB")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{checkpoint / 'global_step3'} -> {tmp_path / 'fp32'}: pytorch_model-00001-of-" in done.stdout
    files = sorted(os.listdir(tmp_path / "fp32"))
    assert "pytorch_model.bin.index.json" in files and "config.json" in files
    assert len([f for f in files if f.startswith("pytorch_model-")]) > 2
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "fp32")).eval()
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint)
    assert state["lm_head.weight"] is state["transformer.wte.weight"]
    again = transformers.GPT2LMHeadModel(config).eval()
    again.load_state_dict(state)  # strict: every key of the model
    with torch.no_grad():
        assert torch.equal(loaded(_ids(5)).logits, expected)
        assert torch.equal(again(_ids(5)).logits, expected)


def test_bf16_training_consolidates_to_its_fp32_masters(shared_daemon, tmp_path, monkeypatch):
    """LLaMA in bf16 through tierstack.initialize: the consolidated weights are the fp32
    masters (finer than bf16), which rounded to bf16 compute the engine's logits exactly;
    --tag picks a tag, a directory with tags but no `latest` is refused in one line naming
    them, and a write that fails leaves no file behind."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    engine, _, _, _ = tierstack.initialize(
        model=model, tier_manager=shared_daemon.address,
        config={"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                "zero_optimization": {"stage": 3},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    try:
        for step in range(2):
            ids = _ids(step)
            engine.backward(engine(ids, labels=ids).loss)
            engine.step()
            engine.save_checkpoint(tmp_path / "ckpt")  # global_step1, global_step2
        engine.eval()
        with torch.no_grad():
            expected = engine(_ids(5)).logits
    finally:
        engine.close()

    done = _cli(tmp_path / "ckpt", tmp_path / "fp32", "--safetensors")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(os.listdir(tmp_path / "fp32")) == ["config.json", "model.safetensors"]
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "fp32"), dtype=torch.float32)
    weights = loaded.state_dict()
    assert all(w.dtype == torch.float32 for w in weights.values())
    finer = [n for n, w in weights.items() if not torch.equal(w, w.bfloat16().float())]
    assert "model.layers.1.mlp.up_proj.weight" in finer and "model.embed_tokens.weight" in finer
    with torch.no_grad():
        assert torch.equal(loaded.to(torch.bfloat16).eval()(_ids(5)).logits, expected)

    first = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt", tag="global_step1")
    assert not torch.equal(first["model.layers.1.mlp.up_proj.weight"],
                           weights["model.layers.1.mlp.up_proj.weight"])
    (tmp_path / "ckpt" / "latest").unlink()
    refused = _cli(tmp_path / "ckpt", tmp_path / "none")
    assert refused.returncode == 2 and refused.stdout == "" and "Traceback" not in refused.stderr
    assert refused.stderr.splitlines() == [
        f"tierstack: {tmp_path / 'ckpt'} has no 'latest' file and holds no checkpoint itself; give a "
        f"tag (tags there: global_step1, global_step2)"]
    assert not (tmp_path / "none").exists()

    written = []

    def fails_on_the_second(tensors, path, metadata=None):
        if written:
            raise OSError("disk full")
        written.append(path)
        Path(path).write_bytes(b"a shard")

    monkeypatch.setattr(zero_to_fp32, "save_file", fails_on_the_second)
    with pytest.raises(OSError, match="disk full"):
        zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
            tmp_path / "ckpt", tmp_path / "partial", max_shard_size="40KB", safe_serialization=True,
            tag="global_step2")
    assert written and os.listdir(tmp_path / "partial") == []
