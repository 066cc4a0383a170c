"""Checkpoint and resume of a partitioned job: 2 gloo ranks, each with its own
tier-manager daemon, saving through worker/engine/checkpoint.py (rank 0 writes). The export of a
partitioned Hugging Face model: tests/worker/test_sharded.py's LLaMA test."""

from __future__ import annotations

import json
import os

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
    assert sorted(os.listdir(tmp_path / "whole")) == ["global_step4", "latest"]  # step 2's replaced
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"
    saved = json.loads((tmp_path / "ckpt" / "global_step2" / "checkpoint.json").read_text())["files"]
    assert {"block-00000.safetensors", "block-00001.safetensors", "persistent.safetensors",
            "engine.pt"} <= set(saved)
    with safe_open(str(tmp_path / "ckpt" / "global_step2" / "block-00000.safetensors"), "pt") as f:
        assert {"qkv.weight.master", "qkv.weight.exp_avg", "qkv.weight.exp_avg_sq"} <= set(f.keys())

    rest = launch_partitioned(_spec(checkpoint_dir=checkpoint, resume=True), 2)
    losses = [s.loss for s in whole[0].steps]
    for r in rest:
        assert [s.loss for s in r.steps] == losses[2:]
    _assert_same_state(rest[0].state, whole[0].state)

    with pytest.raises(Exception, match="seed"):
        launch_partitioned(_spec(checkpoint_dir=str(tmp_path / "whole"), resume=True, seed=6, steps=5), 1)
