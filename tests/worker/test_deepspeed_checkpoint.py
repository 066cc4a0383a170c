"""A DeepSpeed ZeRO-3 checkpoint written by DeepSpeed itself goes on training in tierstack
(worker/engine/deepspeed_checkpoint.py, through engine.load_checkpoint).

DeepSpeed runs for real, on its CPU accelerator over gloo, in processes of its own
(tests/worker/scripts/deepspeed_zero3.py): the same model (embedding, blocks with a buffer,
a head tied to the embedding, odd sizes so that partitions are padded), seed, data, torch
AdamW in two param groups, a warm-up schedule and gradient clipping at 1.0. DeepSpeed
trains 3 steps and saves; then (a) DeepSpeed resumes into a freshly built model and trains
3 more steps, (b) tierstack.initialize's engine loads DeepSpeed's checkpoint and trains the
same 3 steps. One rank: (b)'s losses equal (a)'s exactly. Both sides run torch's fused CPU
AdamW on the same fp32 values (DeepSpeed over its flat partitions, tierstack's tier managers
and device over each block's), clip by the same norm and follow the same schedule.
Two ranks: the weights put together from both ranks' partitions equal DeepSpeed's own
consolidation exactly, and the losses those of DeepSpeed's two ranks to 1e-5 (each of its
ranks averages half a batch's gradients: another summation order than one rank's)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tierstack
from tierstack.errors import InvalidArgumentError
from tierstack.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from tierstack.worker.node.distributed import free_port

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed (the test extra installs it: pip install -e '.[test]')",
                allow_module_level=True)

SCRIPT = Path(__file__).parent / "scripts" / "deepspeed_zero3.py"
_spec = importlib.util.spec_from_file_location("deepspeed_zero3", SCRIPT)
ds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ds)  # the model, data and optimizer of both sides (no DeepSpeed import)

SAVE_AFTER, THEN = 3, 3


def _deepspeed(directory: Path, world: int) -> list[dict]:
    """DeepSpeed's side, one process per rank: each rank's losses before the checkpoint
    ("first") and after resuming from it ("resumed")."""
    port, procs = free_port(), []
    try:
        for rank in range(world):
            log = open(directory.parent / f"deepspeed-{world}-{rank}.log", "w")
            procs.append((log, subprocess.Popen(
                [sys.executable, str(SCRIPT), str(directory), "--save-after", str(SAVE_AFTER),
                 "--then", str(THEN), "--out", str(directory.parent / f"result-{world}-{rank}.json")],
                stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_PORT": str(port)})))
        for log, proc in procs:
            code = proc.wait(timeout=600)
            log.close()
            assert code == 0, Path(log.name).read_text()[-3000:]
    finally:
        for log, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return [json.loads((directory.parent / f"result-{world}-{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> tuple[Path, dict]:
    """A checkpoint DeepSpeed wrote after 3 steps on one rank, and DeepSpeed's losses."""
    directory = tmp_path_factory.mktemp("deepspeed") / "ckpt"
    return directory, _deepspeed(directory, 1)[0]


def _initialize(model, tier_manager=None, **config):
    engine, _, _, _ = tierstack.initialize(
        model=model, optimizer=ds.optimizer(model), config={**ds.CONFIG, **config},
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, ds.warmup),
        tier_manager=tier_manager)
    return engine


def _weights(engine, directory: Path) -> dict[str, torch.Tensor]:
    """The engine's weights as DeepSpeed's save_16bit_model writes them."""
    engine.save_16bit_model(directory, "model.safetensors")
    return load_file(directory / "model.safetensors")


def test_deepspeeds_checkpoint_goes_on_in_tierstack_exactly_as_in_deepspeed(one_rank, tmp_path):
    directory, deepspeed = one_rank
    imported_before = "deepspeed" in sys.modules
    engine = _initialize(ds.model(seed=2))  # other weights: every value from the checkpoint
    try:
        path, client = engine.load_checkpoint(directory)  # the tag `latest` names
        assert path == str(directory / "global_step3") and client["note"] == "from deepspeed"
        assert (engine.global_steps, engine.global_samples, engine.micro_steps) == (3, 3 * ds.ROWS, 3)
        assert engine.get_lr() == [ds.LR] * 2  # the warm-up's 4th step, restored with the schedule
        theirs = torch.load(directory / "deepspeed_fp32.pt")  # DeepSpeed's own zero_to_fp32
        mine = _weights(engine, tmp_path / "weights")
        assert set(mine) == set(theirs) - {"head.weight"}  # the tied head is the embedding
        for name, tensor in mine.items():
            assert torch.equal(tensor, theirs[name]), name
        losses = ds.train(engine, ds.batches(SAVE_AFTER + THEN)[SAVE_AFTER:])
    finally:
        engine.close()
    print(f"DeepSpeed resumed: {deepspeed['resumed']}\ntierstack resumed: {losses}")
    assert losses == deepspeed["resumed"]  # bit for bit
    assert imported_before or "deepspeed" not in sys.modules  # the load never imports DeepSpeed


def test_two_ranks_partitions_are_put_together_and_train_on(shared_daemon, tmp_path):
    directory = tmp_path / "ckpt"
    ranks = _deepspeed(directory, 2)
    assert sorted(p.name for p in (directory / "global_step3").iterdir()) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    engine = _initialize(ds.model(seed=2), shared_daemon.address)
    try:
        engine.load_checkpoint(directory)
        theirs = torch.load(directory / "deepspeed_fp32.pt")
        for name, tensor in _weights(engine, tmp_path / "weights").items():
            assert torch.equal(tensor, theirs[name]), name
        losses = ds.train(engine, ds.batches(SAVE_AFTER + THEN)[SAVE_AFTER:])
    finally:
        engine.close()
    # Each DeepSpeed rank's loss is the mean over its half of the rows: their mean is the batch's.
    expected = [(a + b) / 2 for a, b in zip(ranks[0]["resumed"], ranks[1]["resumed"])]
    print(f"DeepSpeed (2 ranks) resumed: {expected}\ntierstack (1 rank) resumed: {losses}")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)


def test_a_bf16_engine_keeps_the_fp32_partitions_as_its_masters_and_refuses_other_models(
        one_rank, shared_daemon, tmp_path):
    """Into a bf16 engine the fp32 partitions come as the masters (the weights are them
    rounded): a tierstack checkpoint saved next consolidates to DeepSpeed's own fp32
    parameters exactly. A checkpoint the engine cannot take is refused in one line naming why,
    before anything changes."""
    directory, _ = one_rank
    engine = _initialize(ds.model(seed=2), shared_daemon.address, bf16={"enabled": True})
    try:
        engine.load_checkpoint(directory)
        theirs = torch.load(directory / "deepspeed_fp32.pt")
        for name, tensor in _weights(engine, tmp_path / "bf16").items():
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, theirs[name].bfloat16()), name
        engine.save_checkpoint(tmp_path / "tierstack")
        consolidated = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "tierstack")
        assert consolidated.keys() == theirs.keys()
        for name, tensor in theirs.items():  # a buffer has no master: bf16 in a bf16 model
            expected = tensor.bfloat16().float() if name.endswith(".gate") else tensor
            assert torch.equal(consolidated[name], expected), name

        before = _weights(engine, tmp_path / "before")
        stage2 = tmp_path / "stage2"
        stage2.mkdir()
        shutil.copy(directory / "global_step3" / "zero_pp_rank_0_mp_rank_00_model_states.pt",
                    stage2 / "mp_rank_00_model_states.pt")
        with pytest.raises(InvalidArgumentError, match=r"ZeRO stage 1/2 checkpoint .*reads ZeRO-3 checkpoints"):
            engine.load_checkpoint(stage2)
        unfinished = tmp_path / "unfinished"
        shutil.copytree(directory / "global_step3", unfinished)
        next(unfinished.glob("*_optim_states.pt")).unlink()
        with pytest.raises(InvalidArgumentError, match=r"optimizer states of ranks \[\]: a checkpoint one "
                                                       r"or more ranks did not finish saving"):
            engine.load_checkpoint(unfinished)
        assert all(torch.equal(before[k], v) for k, v in _weights(engine, tmp_path / "after").items())
    finally:
        engine.close()

    wider = _initialize(ds.model(seed=2, dim=ds.DIM + 1), shared_daemon.address)
    try:
        with pytest.raises(InvalidArgumentError, match=rf"has parameter 'embed.weight' of shape "
                                                       rf"\[{ds.VOCAB}, {ds.DIM}\], the model "
                                                       rf"\[{ds.VOCAB}, {ds.DIM + 1}\]; load it into"):
            wider.load_checkpoint(directory)
    finally:
        wider.close()
    net = ds.model(seed=2)
    one_group, _, _, _ = tierstack.initialize(model=net, model_parameters=net.parameters(), config=ds.CONFIG,
                                              tier_manager=shared_daemon.address)
    try:
        with pytest.raises(InvalidArgumentError, match="has 2 param groups, the engine 1; give initialize"):
            one_group.load_checkpoint(directory)
    finally:
        one_group.close()
