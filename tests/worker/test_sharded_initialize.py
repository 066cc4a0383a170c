"""tierstack.initialize with several ranks: the partitioned engine under the single-GPU
surface. Real processes joined by gloo (the project's launcher, torchrun's variables), one
real tier-manager daemon for the node; against one rank and plain PyTorch on the same seed
and data."""

from __future__ import annotations

import copy
import os
import shutil
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tierstack
from tierstack.worker.node.distributed import launch_local

VOCAB, DIM, LAYERS, SEQ = 53, 32, 3, 8
ROWS = 4  # a micro-batch of the global batch: every rank's micro-batches together
ACCUMULATION, STEPS, CLIP = 2, 4, 0.05
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-3)  # eps 1e-3: AdamW's update follows clipping


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _groups(model):
    """Weight decay on matrices only: two param groups, as most scripts give."""
    return [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}]


def _schedule(step: int) -> float:
    return (step + 1) / 2 if step < 2 else 0.5 ** (step - 1)


def _micro_batches(count: int):
    g = torch.Generator().manual_seed(11)
    return [(torch.randint(0, VOCAB, (ROWS, SEQ), generator=g),
             torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)) for _ in range(count)]


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


CONFIG = {"gradient_accumulation_steps": ACCUMULATION, "gradient_clipping": CLIP,
          "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                "offload_optimizer": {"device": "cpu"}},
          "optimizer": {"type": "AdamW", "params": {"lr": HYPER["lr"], "betas": list(HYPER["betas"]),
                                                     "eps": HYPER["eps"]}}}


def _plain_pytorch():
    """The same training on one model: each micro-batch whole, the mean loss / ACCUMULATION,
    clip_grad_norm_, AdamW, the schedule. Per-micro-step losses, per-step norms, weights."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(_groups(model), **HYPER)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule)
    batches, losses, norms = _micro_batches(STEPS * ACCUMULATION), [], []
    for step in range(STEPS):
        for ids, targets in batches[step * ACCUMULATION:(step + 1) * ACCUMULATION]:
            loss = _loss(model(ids), targets)
            (loss / ACCUMULATION).backward()
            losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _engine(address: str, config: dict = CONFIG):
    torch.manual_seed(0)  # every rank builds the same model
    model = Net()
    engine, _, _, _ = tierstack.initialize(
        model=model, model_parameters=_groups(model), config=config, tier_manager=address,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _schedule))
    return engine


def _train(engine, rank: int, world: int, start: int, stop: int):
    """Steps start..stop-1, this rank's rows of each micro-batch; the global losses (the
    mean over the ranks, reduced here as a script would to log them) and the norms."""
    import torch.distributed as dist

    batches = _micro_batches(STEPS * ACCUMULATION)
    per = ROWS // world
    losses, norms = [], []
    for step in range(start, stop):
        for ids, targets in batches[step * ACCUMULATION:(step + 1) * ACCUMULATION]:
            loss = _loss(engine(ids[rank * per:(rank + 1) * per]), targets[rank * per:(rank + 1) * per])
            engine.backward(loss)
            engine.step()
            value = loss.detach().double().reshape(1)
            if world > 1:
                dist.all_reduce(value)
            losses.append(value.item() / world)
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def _weights(engine) -> dict[str, torch.Tensor]:
    """Every weight, the blocks' gathered from the ranks' shards (a collective)."""
    core = engine.core
    core.wait_for_optimizer()  # one rank: the last step's updates run behind, not waited for
    out = {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()
           if not n.startswith("blocks.")}
    for i in range(LAYERS):
        for name, t in core.store.read_layer(i).items():
            out[f"blocks.{i}.{name}"] = t.clone()
    return out


def _rank_run(env, address: str, out_dir: str) -> None:
    engine = _engine(address)
    try:
        losses, norms = _train(engine, env.rank, env.world_size, 0, STEPS)
        result = {"losses": losses, "norms": norms, "weights": _weights(engine),
                  "lr": engine.get_lr(), "steps": engine.global_steps,
                  "sharded": type(engine.core.store).__name__}
    finally:
        engine.close()
    torch.save(result, os.path.join(out_dir, f"rank{env.rank}.pt"))


def _launch(fn, world: int, *args) -> list[dict]:
    out_dir = tempfile.mkdtemp(prefix="ts-init-ranks-")
    try:
        launch_local(fn, world, *args, out_dir)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                for r in range(world)]
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def test_two_ranks_under_initialize_train_as_one_rank_and_plain_pytorch(shared_daemon):
    """Accumulation (2 micro-steps), clipping by the global norm (0.05: every step
    clipped), a warm-up/decay schedule, two param groups: 2 ranks x 2 rows == 1 rank x 4 rows
    == plain PyTorch. fp32; the partitioned gradient is the mean of the ranks' means (a
    reduce-scatter), so only summation order differs: losses and norms to 1e-5 relative,
    weights at rtol 1e-4 / atol 1e-5 (lr 3e-3: a dropped shard or an unaveraged gradient
    moves weights by ~1e-3)."""
    losses, norms, weights = _plain_pytorch()
    assert min(norms) > CLIP  # clipping did something on every step
    one = _launch(_rank_run, 1, shared_daemon.address)
    two = _launch(_rank_run, 2, shared_daemon.address)
    assert one[0]["sharded"] == "LayerStore" and two[0]["sharded"] == "ShardedLayerStore"
    for results in (one, two):
        for r in results:
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), rtol=1e-5, atol=0)
            torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(norms), rtol=1e-5, atol=0)
            assert r["steps"] == STEPS and r["lr"] == pytest.approx([HYPER["lr"] * _schedule(STEPS)] * 2)
            for name, want in weights.items():
                torch.testing.assert_close(r["weights"][name], want, rtol=1e-4, atol=1e-5,
                                           msg=lambda m, name=name, w=len(results): f"{w} rank(s), {name}: {m}")
    for name in weights:  # the ranks hold one model
        assert torch.equal(two[0]["weights"][name], two[1]["weights"][name]), name


def _rank_checkpoint(env, address: str, directory: str, out_dir: str) -> None:
    """Steps 1-2, save; steps 3-4 (the run that went on); then a fresh engine (other
    weights) loads `latest` and trains steps 3-4 again."""
    engine = _engine(address)
    try:
        _train(engine, env.rank, env.world_size, 0, 2)
        engine.save_checkpoint(directory, client_state={"rank": env.rank})
        went_on, _ = _train(engine, env.rank, env.world_size, 2, STEPS)
        whole = _weights(engine)
    finally:
        engine.close()
    torch.manual_seed(5)
    fresh = _engine(address)
    try:
        path, client = fresh.load_checkpoint(directory)
        resumed, _ = _train(fresh, env.rank, env.world_size, 2, STEPS)
        result = {"went_on": went_on, "resumed": resumed, "whole": whole, "again": _weights(fresh),
                  "path": path, "client": client, "lr": fresh.get_lr()}
    finally:
        fresh.close()
    torch.save(result, os.path.join(out_dir, f"rank{env.rank}.pt"))


def test_two_ranks_resume_from_an_engine_checkpoint_bit_for_bit(shared_daemon, tmp_path):
    """save_checkpoint by both ranks (rank 0 writes, `latest` too), load_checkpoint by a
    fresh pair of engines: the same losses and weights as the run that went on, exactly
    (shards, moments, the schedule, the counters)."""
    results = _launch(_rank_checkpoint, 2, shared_daemon.address, str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"
    assert not list((tmp_path / "ckpt").glob(".*"))  # nothing staged left
    for r in results:
        assert r["path"] == str(tmp_path / "ckpt" / "global_step2") and r["client"] == {"rank": 0}
        assert r["resumed"] == r["went_on"]
        for name, want in r["whole"].items():
            assert torch.equal(r["again"][name], want), name
        assert r["lr"] == pytest.approx([HYPER["lr"] * _schedule(STEPS)] * 2)


def test_a_rank_that_dies_fails_the_other_in_one_line_within_seconds_and_leaves_nothing(tmp_path):
    """Two ranks of a DeepSpeed-style script (tests/worker/scripts/ds_style_train.py) under
    torchrun's variables, one node's daemon; rank 1 is SIGKILLed at its third step. Rank 0
    ends within seconds, its error one line naming the partitioned job's failure, and the
    node holds nothing of the job once the daemon's grace period has passed."""
    import subprocess
    import sys
    import time

    from tierstack.config import load_config
    from tierstack.services.tier_manager.client import TierManagerClient
    from tierstack.services.tier_manager.embedded import EmbeddedTierManager
    from tierstack.worker.node.distributed import free_port
    from tierstack.worker.jobs.partitioned_job import small_embedded_node

    node = small_embedded_node(size_mib=4)
    node["nvme_pool"]["paths"] = [str(tmp_path / "nvme")]
    node["manifest_path"] = str(tmp_path / "manifest.sqlite")
    node["jobs"] = {"grace_seconds": 0.5}
    script = os.path.join(os.path.dirname(__file__), "scripts", "ds_style_train.py")
    with EmbeddedTierManager(load_config({"tier_manager": node}).tier_manager) as daemon:
        port = free_port()
        ranks = []
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "TIERSTACK_TIER_MANAGER": daemon.address, "TIERSTACK_JOB": "dies",
                   "TIERSTACK_PEER_TIMEOUT": "2", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
            ranks.append(subprocess.Popen([sys.executable, script, "--steps", "50", "--die-at", "2"],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
        try:
            died_out, _ = ranks[1].communicate(timeout=120)
            # Not bound by the clock: what this guards against is a rank 0 that hangs on
            # its dead peer, which never ends; the timeout only stops waiting for one (the
            # watch's 2 s and the failed collective end it within seconds).
            out, err = ranks[0].communicate(timeout=120)
        finally:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert ranks[1].returncode == -9 and "rank 1 dies at step 2" in died_out
        assert ranks[0].returncode not in (0, None), out + err
        last = err.strip().splitlines()[-1].removeprefix("[rank0]: ")  # torch's excepthook's prefix
        assert last.startswith("tierstack.errors.RankFailedError: "), err[-3000:]
        assert "rank 0 of 2" in last or "rank 1 of 2" in last, last
        assert "step 49" not in out
        client = TierManagerClient(daemon.address)
        try:
            deadline = time.monotonic() + 60  # grace 0.5 s; a job left stays
            while left := [j for j in client.jobs() if j.job.startswith("dies")]:
                assert time.monotonic() < deadline, f"state left on the node: {left}"
                time.sleep(0.1)
        finally:
            client.close()


def _rank_placed(env, address: str, out_dir: str) -> None:
    """A partitioned engine with an HBM budget: rank 0's is ample, rank 1's none to speak of
    (placing on its own, rank 1 would keep no block on the device and gather blocks rank 0
    never gathers: their collectives would diverge). Blocks 0 and 1 may be placed on the
    device, block 2 streams."""
    from tierstack.budgets import Budgets
    from tierstack.config import OptimizerConfig, TrainConfig
    from tierstack.worker.node.distributed import init_process_group
    from tierstack.worker.engine.offload_engine import OffloadEngine
    from tierstack.worker.store.layer_store import LayerStore
    from tierstack.worker.engine.sharded_engine import ShardedEngine
    from tierstack.worker.store.sharded_store import ShardedLayerStore

    sharded = env.world_size > 1
    if sharded:
        init_process_group(env)
    hbm = 1 << 30 if env.rank == 0 else 4096
    train = TrainConfig(optimizer=OptimizerConfig(lr=3e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.0))
    torch.manual_seed(0)
    model = Net()
    store = (ShardedLayerStore if sharded else LayerStore)(f"placed-{env.world_size}", device="cpu",
                                                           address=address, durable=False)
    try:
        engine = (ShardedEngine if sharded else OffloadEngine)(
            model, store, train, Budgets(hbm=hbm, host=8 << 30, nvme=8 << 30),
            tiers=["auto", "auto", "cpu"])
        per = ROWS // env.world_size
        losses = [engine.train_step(ids[env.rank * per:(env.rank + 1) * per],
                                    targets[env.rank * per:(env.rank + 1) * per])
                  for ids, targets in _micro_batches(3)]
        result = {"losses": losses, "resident": sorted(engine.placement.resident),
                  "hbm": engine.budgets.hbm}
        engine.close()
    finally:
        store.close()
        if sharded:
            import torch.distributed as dist
            dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{env.rank}.pt"))


def test_rank_zero_places_for_every_rank(shared_daemon):
    """Both ranks keep rank 0's choice of blocks on the device (its budgets, its probe) and
    train as one rank with that placement and as plain PyTorch (losses to 1e-5)."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.0)
    expected = []
    for ids, targets in _micro_batches(3):
        loss = _loss(model(ids), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    one = _launch(_rank_placed, 1, shared_daemon.address)
    two = _launch(_rank_placed, 2, shared_daemon.address)
    assert one[0]["resident"] == [0, 1]
    for r in two:
        assert r["resident"] == [0, 1] and r["hbm"] == 1 << 30
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(expected), rtol=1e-5, atol=0)


def test_a_rank_that_never_leaves_its_process_group_has_left_it_before_the_interpreter_ends():
    """initialize keeps the group joined for the process's life; left to finalization,
    gloo's threads can abort the rank after its work is done (SIGABRT, "terminate called
    without an active exception"). A handler registered before the join runs after
    tierstack's own at exit (atexit is last in, first out) and sees the group gone."""
    import subprocess
    import sys

    from tierstack.worker.node.distributed import free_port

    script = (
        "import atexit, torch, torch.distributed as dist\n"
        "from tierstack.worker.node.distributed import RankEnv, init_process_group\n"
        "atexit.register(lambda: print('joined at exit:', dist.is_initialized(), flush=True))\n"
        f"env = RankEnv(0, 1, 0, '127.0.0.1', {free_port()})\n"
        "init_process_group(env, torch.device('cpu'))\n"
        "t = torch.ones(3); dist.all_reduce(t); print('sum', t.sum().item(), flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["sum 3.0", "joined at exit: False"], done.stdout + done.stderr
