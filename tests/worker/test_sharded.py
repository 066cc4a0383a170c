"""Partitioned (ZeRO-3 style) training: 2 ranks against one, against plain PyTorch.

Ranks are real processes joined by a gloo process group, each with its own tier-manager
daemon (standing for its node), started by the plain multiprocessing launcher.
"""

from __future__ import annotations

import pytest
import torch

from tierstack.config import MiB, OptimizerConfig, ParamOffloadConfig, TrainConfig
from tierstack.errors import InvalidArgumentError
from tierstack.worker.jobs.gpt import GPT, GPTConfig
from tierstack.worker.jobs.partitioned_job import (PartitionedSpec, global_batches, launch_partitioned,
                                              small_embedded_node)
from tierstack.worker.store.flat_layout import ELEMENT_ALIGNMENT, FlatLayout

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def test_flat_layout_cuts_a_layer_into_equal_shards():
    tensors = {"w": torch.zeros(3, 100), "b": torch.zeros(100), "mask": torch.zeros(7)}
    layout = FlatLayout.of(tensors, trainable={"w", "b"}, world=3)
    assert layout.numel == 3 * layout.shard_numel and layout.shard_numel % ELEMENT_ALIGNMENT == 0
    assert layout.numel >= 320 + 128 + 64
    covered = []
    for rank in range(3):
        lo, _ = layout.shard_range(rank)
        covered += [(lo + a, lo + b) for a, b in layout.trainable_segments(rank)]
    flat = torch.zeros(layout.numel)
    for a, b in covered:
        flat[a:b] += 1
    views = layout.views(flat)
    assert torch.equal(views["w"], torch.ones(3, 100)) and torch.equal(views["b"], torch.ones(100))
    assert torch.equal(views["mask"], torch.zeros(7))  # a buffer is never updated
    assert flat.sum() == 400  # each trainable element in exactly one shard, padding in none


def test_flat_layout_refuses_mixed_dtypes_by_name():
    tensors = {"w": torch.zeros(4), "scale": torch.zeros(4, dtype=torch.bfloat16)}
    try:
        FlatLayout.of(tensors, {"w"}, 2, "layer 3")
    except InvalidArgumentError as e:
        assert "layer 3" in str(e) and "bfloat16" in str(e)
    else:
        raise AssertionError("mixed dtypes accepted")


def _plain_reference(spec: PartitionedSpec, hyper: dict = HYPER, clip: float = 0.0):
    """Plain PyTorch: the whole global batch on one model, fused AdamW (the gradient's
    norm clipped to `clip` by clip_grad_norm_ when given)."""
    torch.manual_seed(spec.seed)
    model = GPT(spec.gpt)
    opt = torch.optim.AdamW(model.parameters(), fused=True, **hyper)
    batches, losses = global_batches(spec), []
    for _ in range(spec.steps):
        x, y = next(batches)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return model, losses


def test_two_ranks_match_one_rank_and_plain_pytorch_and_each_reads_half():
    """Same seed, same global batch of 4: 2 ranks x 2 rows vs 1 rank x 4 rows vs plain AdamW.

    Tolerance: fp32 throughout; the partitioned run's gradient is the mean of two
    half-batch means (a reduce-scatter) where the reference takes one mean over four
    rows, so per-step gradients differ by summation order only (~1e-7 relative; measured
    weight differences after 6 steps <= 2.2e-6). Weights are compared at rtol 1e-4 / atol
    1e-5 and losses at 1e-5 relative: lr is 1e-3, so a real error -- a missing or doubled
    shard, a rank's slice dropped, an unaveraged gradient -- moves weights by ~1e-3. Adam
    divides by sqrt(v) + eps, which amplifies rounding differences where the gradient is
    zero in exact arithmetic (the key bias, below). One rank equals plain PyTorch exactly.
    """
    spec = PartitionedSpec(gpt=GPTConfig(vocab_size=256, seq_len=32, dim=64, heads=4, layers=4),
                           steps=6, global_batch=4, seed=3, data="random",
                           optimizer=OptimizerConfig(lr=1e-3, betas=[0.9, 0.95], eps=1e-8,
                                                     weight_decay=0.1),
                           device_budget_layers=3, device="cpu",
                           embedded=small_embedded_node(size_mib=1), collect_state=True)
    reference, ref_losses = _plain_reference(spec)
    one = launch_partitioned(spec, 1)
    two = launch_partitioned(spec, 2)

    exact = one[0].state
    for i, ref_block in enumerate(reference.blocks):  # one rank: the same arithmetic, bit for bit
        for name, p in ref_block.named_parameters():
            assert torch.equal(exact["blocks"][i][name], p.detach()), (i, name)
    assert [s.loss for s in one[0].steps] == ref_losses

    for results in (one, two):
        losses = [s.loss for s in results[0].steps]
        for step, (loss, ref) in enumerate(zip(losses, ref_losses)):
            assert abs(loss - ref) <= 1e-5 * abs(ref), (len(results), step, loss, ref)
        for r in results:  # every rank reports the same global loss
            assert [s.loss for s in r.steps] == losses
        state = results[0].state
        dim = spec.gpt.dim
        for i, ref_block in enumerate(reference.blocks):
            for name, p in ref_block.named_parameters():
                got, want = state["blocks"][i][name], p.detach()
                if name == "qkv.bias":
                    # The key bias's true gradient is exactly zero (softmax ignores a shift
                    # common to a row's scores), so any implementation updates it from
                    # rounding noise (~1e-10) divided by sqrt(v) + eps (1e-8): up to 1e-2 lr
                    # a step. Compared at 0.1 lr; the query and value biases as the rest.
                    key = slice(dim, 2 * dim)
                    torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-4)
                    got, want = torch.cat([got[:dim], got[2 * dim:]]), torch.cat([want[:dim], want[2 * dim:]])
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        for name, p in reference.named_parameters():
            if not name.startswith("blocks."):
                torch.testing.assert_close(state["persistent"][name], p.detach(), rtol=1e-4, atol=1e-5)

    # Bandwidth-centric: each of 2 ranks reads half of what one rank reads from its CPU
    # pool, and at most about half from NVMe (a 1 MiB CPU pool per rank: state streams
    # through NVMe; each rank's pool caches a larger share of its half, so often less).
    def per_step(results, field):
        return [sum(getattr(s, field) for s in r.steps[1:]) / (len(r.steps) - 1) for r in results]

    (cpu_one,), cpu_two = per_step(one, "cpu_pool_read"), per_step(two, "cpu_pool_read")
    (nvme_one,), nvme_two = per_step(one, "nvme_read"), per_step(two, "nvme_read")
    assert nvme_one > 0 and cpu_one > 0
    for cpu, nvme in zip(cpu_two, nvme_two):
        assert 0.4 * cpu_one <= cpu <= 0.6 * cpu_one, (cpu, cpu_one)
        assert 0 < nvme <= 0.6 * nvme_one, (nvme, nvme_one)
    assert one[0].steps[-1].gathered == 0 and all(r.steps[-1].gathered > 0 for r in two)


def test_two_ranks_clip_the_global_gradient_as_clip_grad_norm_does():
    """gradient_clipping: the norm is the global batch's gradient's (the blocks' shards
    squared and summed over the ranks, the persistent gradients whole), as plain PyTorch's
    clip_grad_norm_ on one model. The norm here is ~1, so 0.05 clips every step; eps 1e-3
    is above the clipped gradients' per-element sizes, so AdamW's update follows their
    scale (with eps 1e-8 Adam nearly cancels a uniform scale and an unclipped run would
    pass too, checked below). Tolerances as in the test above: summation order only."""
    hyper = {**HYPER, "eps": 1e-3}
    spec = PartitionedSpec(gpt=GPTConfig(vocab_size=256, seq_len=32, dim=64, heads=4, layers=2),
                           steps=3, global_batch=4, seed=3, data="random", gradient_clipping=0.05,
                           optimizer=OptimizerConfig(**hyper), device="cpu", cpu_threads=1,
                           embedded=small_embedded_node(size_mib=1), collect_state=True)
    reference, ref_losses = _plain_reference(spec, hyper, clip=spec.gradient_clipping)
    unclipped, _ = _plain_reference(spec, hyper)
    two = launch_partitioned(spec, 2)
    for step, (a, b) in enumerate(zip([s.loss for s in two[0].steps], ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b)
    state = two[0].state
    for i, (ref_block, free_block) in enumerate(zip(reference.blocks, unclipped.blocks)):
        for (name, p), q in zip(ref_block.named_parameters(), free_block.parameters()):
            torch.testing.assert_close(state["blocks"][i][name], p.detach(), rtol=1e-4, atol=1e-5)
            moved = (state["blocks"][i][name] - q.detach()).abs().max().item()
            assert moved > 1e-4, (i, name, moved)  # clipping changed what was trained
    for name, p in reference.named_parameters():
        if not name.startswith("blocks."):
            torch.testing.assert_close(state["persistent"][name], p.detach(), rtol=1e-4, atol=1e-5)


def test_ranks_run_under_torchrun_without_ray(tmp_path):
    """The GPU machine has no Ray: torchrun's environment alone starts the same ranks."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    spec = {"steps": 2, "gpt": {"dim": 32, "heads": 2, "layers": 2, "seq_len": 16},
            "global_batch": 4, "data": "random", "device": "cpu", "cpu_threads": 1,
            "embedded": small_embedded_node(size_mib=1)}
    spec["embedded"]["nvme_pool"]["paths"] = [str(tmp_path / "nvme")]
    # torchrun's agent keeps its per-run log directories (torchelastic_*) in TMPDIR: a short
    # one of the test's own (the ranks' daemons put their unix sockets there too, and a
    # socket's path may not exceed 107 characters).
    with tempfile.TemporaryDirectory(prefix="tsrun-") as tmp:
        out = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "-m", "tierstack.worker.jobs.partitioned_job", "--spec", json.dumps(spec)],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "PYTHONWARNINGS": "ignore", "TMPDIR": tmp})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    ranks = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert ranks[0]["losses"] == ranks[1]["losses"] and all(r["gathered"] > 0 for r in ranks)


def _failing_rank(env, message: str) -> None:
    if env.rank == 1:
        raise ValueError(message)


def test_a_rank_that_raises_fails_the_local_launch_with_its_error_and_leaves_no_file(
        tmp_path, monkeypatch):
    """launch_local (tierstack train --ranks without Ray) raises the failing rank's own
    error; the traceback file torch's spawn keeps for it in the temp directory is gone."""
    import tempfile

    from tierstack.worker.node.distributed import launch_local

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(Exception, match="rank one gave up: no data"):
        launch_local(_failing_rank, 2, "rank one gave up: no data")
    assert not list(tmp_path.iterdir())


def _llama_rank(env, out_dir: str, steps: int) -> None:
    """One rank of a Hugging Face LLaMA trained partitioned, its own daemon (spawned)."""
    import tempfile

    import transformers

    from tierstack.services.tier_manager.embedded import EmbeddedTierManager
    from tierstack.config import load_config
    from tierstack.worker.engine.checkpoint import export_safetensors
    from tierstack.worker.node.distributed import init_process_group
    from tierstack.worker.jobs.partitioned_job import rank_slice
    from tierstack.worker.engine.sharded_engine import ShardedEngine
    from tierstack.worker.store.sharded_store import ShardedLayerStore

    torch.set_num_threads(1)
    init_process_group(env, torch.device("cpu"))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config())
    tm = load_config({"tier_manager": small_embedded_node(size_mib=1)}).tier_manager
    nvme = tempfile.TemporaryDirectory(prefix=f"llama-rank{env.rank}-")  # removed when the rank ends
    tm.nvme_pool.paths = [nvme.name]
    tm.manifest_path = ""
    with EmbeddedTierManager(tm) as daemon:
        store = ShardedLayerStore("llama", device="cpu", device_budget=64 << 20,
                                  address=daemon.address, durable=False)
        engine = ShardedEngine(model, store, TrainConfig(
            optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.01), params=ParamOffloadConfig(buffer_count=3)),
            blocks_attr="model.layers")
        data, losses = torch.Generator().manual_seed(2), []
        for _ in range(steps):
            ids = rank_slice(torch.randint(0, 256, (4, 24), generator=data), env.rank, env.world_size)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            engine.zero_grad()
            loss.backward()
            engine.step()
            losses.append(store.collectives.all_reduce_mean(loss.item()))
        export_safetensors(engine, f"{out_dir}/export")  # every rank: blocks are gathered
        store.close()
    torch.distributed.destroy_process_group()
    if env.rank == 0:
        torch.save(losses, f"{out_dir}/losses.pt")


def _llama_config():
    import transformers
    return transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=3, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=64)


def test_hugging_face_llama_trains_partitioned_like_plain_pytorch(tmp_path):
    """A model the engine was not written around: LLaMA from config, blocks at model.layers;
    its export (worker/engine/checkpoint.py, rank 0 writing) loads with from_pretrained."""
    transformers = __import__("pytest").importorskip("transformers")
    from tierstack.worker.node.distributed import launch_local
    steps = 3
    launch_local(_llama_rank, 2, str(tmp_path), steps)
    losses = torch.load(tmp_path / "losses.pt")
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(_llama_config())
    opt = torch.optim.AdamW(reference.parameters(), fused=True, lr=1e-3, weight_decay=0.01)
    data = torch.Generator().manual_seed(2)
    for step in range(steps):
        ids = torch.randint(0, 256, (4, 24), generator=data)
        loss = reference(input_ids=ids, labels=ids, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert abs(losses[step] - loss.item()) <= 1e-5 * loss.item(), (step, losses[step], loss.item())
    # The partitioned run's export is what from_pretrained loads: every weight, the trained
    # values (to summation order, as above).
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "export",
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    want = dict(reference.named_parameters())
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p.detach(), want[name].detach(), rtol=1e-4, atol=1e-5)


def test_bf16_blocks_with_fp32_masters_partition_too():
    """bf16 blocks, fp32 masters and moments sharded by the same element offsets.

    The ranks' bf16 gradients are summed in another order than one rank's (bf16 has 8
    significant bits), so losses agree to 1e-3 relative rather than fp32's 1e-5.
    """
    spec = PartitionedSpec(gpt=GPTConfig(vocab_size=256, seq_len=32, dim=64, heads=4, layers=2),
                           steps=4, global_batch=4, seed=3, data="random", precision="bf16",
                           optimizer=OptimizerConfig(lr=1e-3), device="cpu", cpu_threads=1,
                           embedded=small_embedded_node(size_mib=1), collect_state=True)
    one, two = launch_partitioned(spec, 1), launch_partitioned(spec, 2)
    for a, b in zip(one[0].steps, two[0].steps):
        assert abs(a.loss - b.loss) <= 1e-3 * a.loss, (a.loss, b.loss)
    assert one[0].steps[-1].loss != one[0].steps[0].loss  # the weights did move
    for block in two[0].state["blocks"]:
        assert all(t.dtype == torch.bfloat16 for t in block.values())


def test_partitioned_jobs_take_clipping_and_refuse_accumulation_by_name():
    """`tierstack train --ranks N` checks its config before Ray starts: clipping is done
    by the partitioned engine (the test above), accumulation is refused with the fix."""
    from tierstack.config import load_config
    from tierstack.errors import ConfigError
    from tierstack.worker.jobs.ray_train_job import check_train_config

    check_train_config(load_config({"train": {"gradient_clipping": 1.0}}).train)
    with pytest.raises(ConfigError, match="gradient_accumulation_steps is 2: partitioned training"):
        check_train_config(load_config({"train": {"gradient_accumulation_steps": 2}}).train)
