"""One job, every door (worker/job.py): `tierstack.initialize`, the Hugging Face Trainer and a
script under `tierstack launch` each send their trace to a real scheduler, get a plan and
follow it, as `tierstack train` does; and a job its script never closes (DeepSpeed has no
close) leaves nothing behind, whether the script ends, drops the engine or dies of an
exception."""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tierstack
from tests.metrics.conftest import get, wait_for

ROOT = Path(__file__).resolve().parents[2]
VOCAB, DIM, LAYERS, ROWS, SEQ = 64, 32, 4, 4, 8
STEPS = 9
"""Enough for the plan keeper: one warm-up step, three traced, a plan, then steps under it."""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


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


def _config(nvme: Path) -> dict:
    return {"train_micro_batch_size_per_gpu": ROWS,
            "zero_optimization": {"stage": 3,
                                  "offload_param": {"device": "nvme", "nvme_path": str(nvme)},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


@pytest.fixture
def alone(tmp_path, monkeypatch):
    """No node tier manager or scheduler to find: the door starts the job's own, and the
    run index is the test's."""
    monkeypatch.setenv("TIERSTACK_TIER_MANAGER", f"unix:{tmp_path}/no-tier-manager.sock")
    monkeypatch.delenv("TIERSTACK_SCHEDULER", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path


def _runs(state: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in (state / "tierstack" / "runs").glob("*.json")]


def test_initialize_follows_the_plans_of_the_scheduler_started_with_its_services(alone):
    torch.manual_seed(0)
    engine, _, _, _ = tierstack.initialize(model=Net(), config=_config(alone / "nvme"),
                                           job="plans-initialize", total_steps=STEPS)
    try:
        g = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            ids = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
            loss = F.cross_entropy(engine(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            engine.backward(loss)
            engine.step()
        # The node's training view has the script's own loss of the last step, its tokens
        # and learning rate (the store reports once a second: wait for the last step).
        url = engine.core.store.reports.dashboard_url()
        (view,) = wait_for(lambda: [j for j in get(url, "/api/v1/node")["training"]
                                    if j["job"] == "plans-initialize" and j["step"] == STEPS],
                           what="the last step in the node's training view")
        assert view["loss"] == pytest.approx(loss.item(), rel=1e-6)
        assert view["total_steps"] == STEPS and view["tokens"] == STEPS * ROWS * SEQ
        assert view["learning_rate"] == pytest.approx(1e-3)
        job = engine._job
        assert job.services.started and job.services.scheduler  # started beside the tier manager
        plan = job.plan
        assert plan is not None and plan.version >= 1
        # The store took the plan's depths at a layer boundary: the version it applies.
        applied = engine.core.store.figures()
        assert applied.plan_version == plan.version
        assert applied.prefetch_depth == plan.nodes[job.services.node_id].prefetch_depth
        assert job.keeper.plans and job.keeper.plans[0].steps  # steps ran under the plan
    finally:
        engine.close()


def test_the_trainer_follows_the_schedulers_plans(alone):
    transformers = pytest.importorskip("transformers")
    from tierstack.worker.hf_trainer import Trainer, TrainingArguments

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM,
                                      num_hidden_layers=LAYERS, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(2)
    rows = [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(0, VOCAB, (ROWS * STEPS, SEQ), generator=g)]
    args = TrainingArguments(output_dir=str(alone / "out"), max_steps=STEPS,
                             per_device_train_batch_size=ROWS, learning_rate=1e-3,
                             report_to=[], save_strategy="no", logging_steps=1,
                             deepspeed=_config(alone / "nvme"), use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    try:
        job = trainer._engine._job
        assert job.plan is not None and job.plan.version >= 1
        assert trainer._engine.core.store.figures().plan_version == job.plan.version
    finally:
        trainer._engine.close()


LAUNCHED = """
import json, sys, torch, torch.nn.functional as F
import tierstack
from tests.metrics.conftest import get, wait_for
sys.path.insert(0, {tests!r})
from test_job import Net, _config, VOCAB, ROWS, SEQ, STEPS
torch.manual_seed(0)
engine, _, _, _ = tierstack.initialize(model=Net(), config=_config({nvme!r}))
g = torch.Generator().manual_seed(1)
for _ in range(STEPS):
    ids = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    engine.backward(F.cross_entropy(engine(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()))
    engine.step()
job = engine._job
print(json.dumps({{"scheduler": job.services.scheduler, "started": job.services.started,
                  "plan": job.plan.version if job.plan else 0,
                  "applied": engine.core.store.figures().plan_version}}))
"""


def test_a_script_under_launch_follows_the_launchers_scheduler(alone):
    script = alone / "train.py"
    script.write_text(LAUNCHED.format(tests=str(Path(__file__).parent), nvme=str(alone / "nvme")))
    run = subprocess.run([sys.executable, "-m", "tierstack.cli", "launch", "--nvme-path",
                          str(alone / "launch-nvme"), str(script)],
                         capture_output=True, text=True, timeout=600, cwd=alone,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-4000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    # The script used the launcher's services (it started none) and followed its scheduler.
    assert not seen["started"] and seen["scheduler"]
    assert seen["plan"] >= 1 and seen["applied"] == seen["plan"]
    assert not list((alone / "launch-nvme").glob("*"))


# ---- nothing left behind -----------------------------------------------------------------------


def _story_1(close: bool, raise_at: int | None = None) -> str:
    """The README's Story-1 block (as a user copies it), without its close() if asked, and
    raising at step `raise_at` if given; it prints where its job's NVMe pool is."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Story 1.*?```python\n(.*?)```", text, re.S).group(1)
    block = block.replace("range(10)", "range(4)")
    assert "config=config)\n" in block
    block = block.replace("config=config)\n", "config=config)\nprint('nvme:', *engine._job.services"
                                                ".nvme_directories, flush=True)\n", 1)
    if not close:
        assert "engine.close()" in block
        block = block.replace("engine.close()\n", "")
    if raise_at is not None:
        block = block.replace("    engine.step()\n",
                              f"    engine.step()\n    if step == {raise_at}:\n"
                              f"        raise RuntimeError('the script failed')\n")
    return block


def _leftovers(env: dict) -> str:
    doctor = subprocess.run([sys.executable, "-m", "tierstack.cli", "doctor", "--quick"],
                            capture_output=True, text=True, timeout=300, env=env)
    return next(line for line in doctor.stdout.splitlines() if "runs left behind" in line)


@pytest.mark.parametrize("ending", ["no close", "an exception"])
def test_a_script_that_never_closes_its_engine_leaves_nothing_behind(alone, ending):
    script = alone / "story1.py"
    script.write_text(_story_1(close=False, raise_at=2 if ending == "an exception" else None))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=600, cwd=alone, env=env)
    if ending == "an exception":
        assert run.returncode == 1 and "the script failed" in run.stderr, run.stderr[-3000:]
    else:
        assert run.returncode == 0, run.stderr[-3000:]
    assert "step 2:" in run.stdout
    (directory,) = re.search(r"^nvme: (.*)$", run.stdout, re.M).group(1).split()
    # Its NVMe directory, its run record (the run index) and its daemon all went.
    assert not Path(directory).exists()
    assert _runs(alone / "state") == []
    assert "no killed run left state behind" in _leftovers(env)


def test_an_engine_dropped_by_its_script_closes_its_job(alone):
    nvme = alone / "nvme"
    engine, optimizer, _, _ = tierstack.initialize(model=Net(), config=_config(nvme), job="dropped")
    ids = torch.randint(0, VOCAB, (ROWS, SEQ + 1))
    engine.backward(F.cross_entropy(engine(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()))
    engine.step()
    daemon = engine._job.services.tier_manager
    assert (nvme / "dropped").is_dir() and _runs(alone / "state")
    del engine, optimizer, ids
    gc.collect()
    assert not (nvme / "dropped").exists()
    assert _runs(alone / "state") == []
    socket_path = Path(daemon.removeprefix("unix:"))
    assert not socket_path.exists()  # the job's daemon stopped with it


def test_a_job_that_asks_to_keep_nothing_still_closes_once(alone):
    """close() then the engine's collection: the job closes once, and a second close is a
    no-op (not an error on a stopped daemon)."""
    engine, _, _, _ = tierstack.initialize(model=Net(), config=_config(alone / "nvme"), job="twice")
    engine.close()
    engine.close()
    del engine
    gc.collect()
    assert not (alone / "nvme" / "twice").exists()
