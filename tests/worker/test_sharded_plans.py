"""Every rank of a partitioned job follows the scheduler's plans, switching at the same
layer: a plan reaches rank 0 (its PlanFollower, a real scheduler), and every rank takes
it at the next step boundary. 2 gloo ranks, each with its own tier-manager daemon."""

from __future__ import annotations

import time

import torch

from tierstack.config import OptimizerConfig, ParamOffloadConfig, SchedulerConfig, TrainConfig
from tierstack.services.scheduler.client import SchedulerClient
from tierstack.services.scheduler.embedded import EmbeddedScheduler
from tierstack.services.scheduler.model import Bandwidths
from tierstack.services.scheduler.synthetic import GB, node
from tierstack.worker.node.distributed import launch_local

STEPS = 5


def _following_rank(env, scheduler: str, out_dir: str) -> None:
    import tempfile

    from tierstack.config import load_config
    from tierstack.services.tier_manager.embedded import EmbeddedTierManager
    from tierstack.worker.node.distributed import init_process_group
    from tierstack.worker.jobs.gpt import GPTConfig, build_gpt
    from tierstack.worker.jobs.partitioned_job import rank_slice, small_embedded_node
    from tierstack.worker.plans.follower import PlanFollower
    from tierstack.worker.engine.sharded_engine import ShardedEngine
    from tierstack.worker.store.sharded_store import ShardedLayerStore

    torch.set_num_threads(1)
    init_process_group(env, torch.device("cpu"))
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=128, seq_len=16, dim=32, heads=2, layers=4)
    model = build_gpt(config, torch.device("cpu"))
    tm = load_config({"tier_manager": small_embedded_node(size_mib=1)}).tier_manager
    nvme = tempfile.TemporaryDirectory(prefix=f"plans-rank{env.rank}-")  # removed when the rank ends
    tm.nvme_pool.paths = [nvme.name]
    tm.manifest_path = ""
    data = torch.Generator().manual_seed(1)
    with EmbeddedTierManager(tm) as daemon:
        store = ShardedLayerStore("plans", device="cpu", device_budget=64 << 20,
                                  address=daemon.address, durable=False)
        engine = ShardedEngine(model, store, TrainConfig(optimizer=OptimizerConfig(lr=1e-3),
                                                         params=ParamOffloadConfig(buffer_count=2)))
        # Rank 0 alone talks to the scheduler; the others learn its plans at step boundaries.
        follower = PlanFollower(store, scheduler, node_id="node-0") if env.rank == 0 else None
        versions, losses = [], []
        for step in range(STEPS):
            x = torch.randint(0, 128, (4, 16), generator=data)
            losses.append(engine.train_step(rank_slice(x, env.rank, 2), rank_slice(x.roll(1, 1), env.rank, 2)))
            versions.append(store.depths.plan_version)
            if follower is not None and step == 0:
                follower.report_trace(optimizer_seconds=engine.block_optimizer.block_seconds)
            if follower is not None and step == 2:  # the disk slowed down: a re-plan, pushed
                client = SchedulerClient(scheduler)
                slow = Bandwidths(disk_read=0.01 * GB, disk_write=0.01 * GB)
                client.report_bandwidth("node-0", slow)
                time.sleep(0.2)  # drifting for longer than replan_after_seconds
                client.report_bandwidth("node-0", slow)
                deadline = time.monotonic() + 20
                while follower.plan.version < 2 and time.monotonic() < deadline:
                    time.sleep(0.05)
        if follower is not None:
            follower.close()
        engine.close()
        store.close()
    torch.distributed.destroy_process_group()
    torch.save({"switches": store.depths.switches, "versions": versions, "losses": losses},
               f"{out_dir}/rank{env.rank}.pt")


def test_every_rank_switches_to_rank_0s_plans_at_the_same_layer(tmp_path):
    with EmbeddedScheduler(SchedulerConfig(replan_after_seconds=0.1)) as scheduler:
        SchedulerClient(scheduler.address).register_node(node("node-0"))
        launch_local(_following_rank, 2, scheduler.address, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0] == ranks[1]  # the same switches at the same ensure_layer, the same losses
    # Only rank 0 was given plans; rank 1 took the same ones before the same ensure_layer.
    # Plan v1 came back to the trace sent after the first step, v2 was pushed after the
    # third: each is taken at the end of the next step (the one then under way), so from
    # the third and fifth steps' first layers; a step ensures 4 blocks forward, 4 backward.
    assert [(boundary, version) for boundary, version, _ in ranks[0]["switches"]] == [(16, 1), (32, 2)]
    assert ranks[0]["versions"] == [0, 1, 1, 2, 2]
