"""Partitioned activation checkpoints (train.activations.partition): 2 data-parallel ranks,
each with its own tier-manager daemon, the second's pool (CPU for policy "cpu", NVMe for
"nvme") three times the first's.

Each rank's stashed block inputs are spread over both daemons in proportion to those
pools, so the small node holds half of what it held with each rank's inputs at home;
training is bit for bit what it is without partitioning (only where the bytes wait
changes), and nothing is left with either daemon after a step. Real processes joined by
gloo, as in test_sharded.py."""

from __future__ import annotations

import pytest
import torch

from tierstack.config import ActivationConfig, MiB, OptimizerConfig, ParamOffloadConfig, TrainConfig
from tierstack.errors import ConfigError, KeyNotFoundError
from tierstack.worker.jobs.gpt import GPTConfig
from tierstack.worker.jobs.partitioned_job import small_embedded_node
from tierstack.worker.engine.partitioned_stash import shares

GPT = GPTConfig(vocab_size=256, seq_len=32, dim=64, heads=4, layers=4)
ROWS, STEPS = 4, 3  # global batch: 2 rows per rank
# Rank 0's and rank 1's pools in MiB, (CPU, NVMe), per policy: the policy's pool differs.
POOLS_MIB = {"cpu": ((2, 256), (6, 256)), "nvme": ((2, 256), (2, 768))}


def test_shares_cut_every_byte_once_in_proportion():
    assert shares(16384, [2 * MiB, 6 * MiB]) == [4096, 12288]
    assert shares(10, [1, 1, 1]) == [3, 3, 4] and sum(shares(7, [5, 0, 2])) == 7
    assert shares(5, [0, 0]) == [2, 3]  # no room anywhere: equal pieces


def test_partition_with_inputs_kept_on_the_device_is_refused_by_name():
    for policy in ("recompute", "keep"):
        with pytest.raises(ConfigError, match=rf"train.activations.partition .*policy '{policy}'"):
            ActivationConfig(policy=policy, partition=True).validate("train.activations")
    ActivationConfig(policy="nvme", partition=True).validate("train.activations")


def _rank(env, out_dir: str, policy: str) -> None:
    """Train the same GPT twice on this rank, inputs to the tier manager by `policy`,
    without and with partitioning; record losses, the peak bytes of inputs its daemon
    held, what was left."""
    import tempfile

    from tierstack.config import load_config
    from tierstack.services.tier_manager.embedded import EmbeddedTierManager
    from tierstack.worker.node.distributed import init_process_group
    from tierstack.worker.engine.offload_engine import materialize
    from tierstack.worker.jobs.gpt import build_gpt
    from tierstack.worker.jobs.partitioned_job import PartitionedSpec, global_batches, rank_slice
    from tierstack.worker.engine.sharded_engine import ShardedEngine
    from tierstack.worker.store.sharded_store import ShardedLayerStore

    torch.set_num_threads(1)
    init_process_group(env, torch.device("cpu"))
    cpu_mib, nvme_mib = POOLS_MIB[policy][env.rank]
    tm = load_config({"tier_manager": small_embedded_node(size_mib=cpu_mib)}).tier_manager
    tm.nvme_pool.size = nvme_mib * MiB
    nvme = tempfile.TemporaryDirectory(prefix=f"partact-rank{env.rank}-")  # removed when the rank ends
    tm.nvme_pool.paths = [nvme.name]
    tm.manifest_path = ""
    out = {}
    with EmbeddedTierManager(tm) as daemon:
        for partition in (False, True):
            torch.manual_seed(0)
            model = build_gpt(GPT, "cpu")
            store = ShardedLayerStore(f"partact-{partition}", device="cpu", device_budget=64 << 20,
                                      address=daemon.address, durable=False)
            train = TrainConfig(optimizer=OptimizerConfig(lr=1e-3),
                                params=ParamOffloadConfig(buffer_count=3),
                                activations=ActivationConfig(policy, partition))
            engine = ShardedEngine(model, store, train, initialize=materialize)
            stash = engine.blocks.stash
            spec = PartitionedSpec(gpt=GPT, global_batch=ROWS, seed=1, data="random")
            batches = global_batches(spec)
            losses, left = [], []
            for _ in range(STEPS):
                x, y = next(batches)
                losses.append(engine.train_step(rank_slice(x, env.rank, env.world_size),
                                                rank_slice(y, env.rank, env.world_size)))
                left.append(stash.bytes_held)
            for n in range(stash._count):
                for i in range(GPT.layers):
                    try:
                        store.client.describe(store.key(i, f"activation.{n}"))
                        left.append(store.key(i, f"activation.{n}"))
                    except KeyNotFoundError:
                        pass
            out[partition] = {"losses": losses, "peak": stash.peak_bytes_held, "left": left,
                              "live": stash.live(), "stash": type(stash).__name__,
                              "capacity": getattr(store.tiers.node(), f"{policy}_capacity")}
            engine.close()
            store.close()
    torch.distributed.destroy_process_group()
    torch.save(out, f"{out_dir}/rank{env.rank}.pt")


@pytest.mark.parametrize("policy", ["cpu", "nvme"])
def test_two_ranks_spread_their_inputs_by_pool_and_train_bit_for_bit_alike(tmp_path, policy):
    from tierstack.worker.node.distributed import launch_local
    launch_local(_rank, 2, str(tmp_path), policy)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    input_bytes = (ROWS // 2) * GPT.seq_len * GPT.dim * 4  # one block's fp32 input per rank
    for r in ranks:
        off, on = r[False], r[True]
        assert (off["stash"], on["stash"]) == ("ActivationStash", "PartitionedActivationStash")
        assert on["losses"] == off["losses"]  # the same arithmetic: bit for bit
        assert off["losses"][-1] != off["losses"][0]  # and the weights moved
        assert off["peak"] == GPT.layers * input_bytes  # every block's input at home
        for run in (off, on):  # released as each block's backward ended, on both daemons
            assert run["left"] == [0] * STEPS and run["live"] == []
    assert ranks[0][True]["losses"] == ranks[1][True]["losses"]  # the global batch's mean
    small, large = ranks[0][True]["capacity"], ranks[1][True]["capacity"]
    assert large == 3 * small
    # The small node holds a quarter of each rank's inputs (half of its own before), the
    # large one three quarters; no byte is lost or doubled.
    assert ranks[0][True]["peak"] == ranks[0][False]["peak"] // 2
    assert ranks[1][True]["peak"] == 3 * ranks[1][False]["peak"] // 2


def test_a_spec_turns_it_on():
    """PartitionedSpec (what `tierstack train --ranks` and torchrun run) passes the policy and
    partition to the ranks' engines: with equal daemons, half of each block's input goes to
    the other rank at its forward and comes back before its backward."""
    from tierstack.worker.jobs.partitioned_job import PartitionedSpec, launch_partitioned
    spec = PartitionedSpec(gpt=GPT, steps=2, global_batch=ROWS, seed=1, data="random", device="cpu",
                           cpu_threads=1, embedded=small_embedded_node(size_mib=2),
                           activation_policy="cpu", partition_activations=True)
    input_bytes = (ROWS // 2) * GPT.seq_len * GPT.dim * 4
    for rank in launch_partitioned(spec, 2):
        assert [s.exchanged for s in rank.steps] == [GPT.layers * input_bytes] * spec.steps
