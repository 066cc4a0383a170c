"""tierstack.initialize with a DeepSpeed-style loop of the caller's own, against plain PyTorch
on the same seed and data: a real tier manager, real offloaded blocks."""

import copy
import json
import os
import time
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tierstack
from tierstack.errors import ConfigError, InvalidArgumentError, TierManagerUnavailableError
from tierstack.worker.store.layer_store import LayerStore

VOCAB, DIM, LAYERS, ROWS, SEQ = 61, 32, 4, 4, 9


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, mask=None):
        h = self.drop(self.down(F.gelu(self.up(self.norm(x)))))
        if mask is not None:  # padding positions add nothing
            h = h * mask.unsqueeze(-1)
        return x + h


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids, mask=None):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def _groups(model):
    """No weight decay on norms and biases, as most scripts do."""
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _my_loss(logits, targets, mask):
    """A loss of the script's own: label smoothing, padding masked out."""
    per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none",
                                label_smoothing=0.1)
    return (per_token * mask.flatten()).sum() / mask.sum()


def _batches(seed, count):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        targets = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        lengths = torch.randint(3, SEQ + 1, (ROWS,), generator=g)
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).float()
        out.append((ids, targets, mask))
    return out


ACCUMULATION = 2
CONFIG = {
    "train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": ACCUMULATION,
    "gradient_clipping": 0.5,
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                          "offload_optimizer": {"device": "cpu"}},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                               "weight_decay": 0.1}},
}


def _warmup_decay(step: int, warmup: int = 3, total: int = 8) -> float:
    """The schedule's factor at optimizer step `step` (0 first), written out here."""
    return (step + 1) / warmup if step < warmup else max(0.0, (total - step) / (total - warmup))


def _plain_pytorch(model, batches, steps):
    """The same training in plain PyTorch: per micro-batch losses, and eval losses after
    each optimizer step."""
    optimizer = torch.optim.AdamW(_groups(model), lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_decay)
    losses, evals = [], []
    for step in range(steps):
        for ids, targets, mask in batches[step * ACCUMULATION:(step + 1) * ACCUMULATION]:
            loss = _my_loss(model(ids, mask), targets, mask)
            (loss / ACCUMULATION).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        evals.append(_evaluate(model, batches[-1]))
    return losses, evals


def _evaluate(model, batch):
    ids, targets, mask = batch
    model.eval()
    with torch.no_grad():
        loss = _my_loss(model(ids, mask), targets, mask).item()
    model.train()
    return loss


def _tierstack(model, batches, steps, address, engine=None, start=0, save=None):
    """The same loop through tierstack.initialize, as a DeepSpeed script writes it."""
    if engine is None:
        engine, optimizer, _, _ = tierstack.initialize(
            model=model, model_parameters=_groups(model), config=CONFIG, tier_manager=address,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _warmup_decay))
    losses, evals = [], []
    for step in range(start, steps):
        for ids, targets, mask in batches[step * ACCUMULATION:(step + 1) * ACCUMULATION]:
            loss = _my_loss(engine(ids, mask), targets, mask)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        evals.append(_evaluate(engine, batches[-1]))
        if save is not None and step + 1 == save[1]:
            engine.save_checkpoint(save[0], client_state={"step": step + 1,
                                                          "rng": torch.get_rng_state()})
    return engine, losses, evals


def test_a_deepspeed_style_loop_trains_as_plain_pytorch(shared_daemon):
    """Own loss (label smoothing, padding masks), param groups, accumulation, clipping, a
    warm-up/decay schedule on the returned optimizer, dropout, and eval passes between
    steps: the same losses as plain PyTorch to 1e-5."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    batches = _batches(1, 6 * ACCUMULATION + 1)
    torch.manual_seed(7)
    expected, expected_evals = _plain_pytorch(reference, batches, 6)
    torch.manual_seed(7)
    engine, losses, evals = _tierstack(model, batches, 6, shared_daemon.address)
    try:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(evals), torch.tensor(expected_evals), rtol=1e-5, atol=0)
        assert engine.global_steps == 6 and engine.micro_steps == 12
        assert engine.get_lr() == pytest.approx([3e-3 * _warmup_decay(6)] * 2)
        assert engine.get_global_grad_norm() > 0
    finally:
        engine.close()


def test_a_checkpoint_saved_mid_run_resumes_bit_for_bit(shared_daemon, tmp_path):
    """Save at step 3 of 6, then a new engine loads it and trains on: the same losses, bit
    for bit, as the run that went on (schedule, moments, masters, counters all restored)."""
    batches = _batches(2, 6 * ACCUMULATION + 1)
    torch.manual_seed(0)
    model = Net()
    torch.manual_seed(3)
    engine, losses, _ = _tierstack(model, batches, 6, shared_daemon.address,
                                   save=(tmp_path / "ckpt", 3))
    engine.close()
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step3"
    torch.manual_seed(1)  # other weights: the checkpoint must bring every value back
    other = Net()
    fresh, _, _, _ = tierstack.initialize(
        model=other, model_parameters=_groups(other), config=CONFIG,
        tier_manager=shared_daemon.address,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _warmup_decay))
    try:
        path, client = fresh.load_checkpoint(tmp_path / "ckpt")
        assert path == str(tmp_path / "ckpt" / "global_step3") and client["step"] == 3
        assert fresh.global_steps == 3 and fresh.micro_steps == 6
        assert fresh.get_lr() == pytest.approx([3e-3 * _warmup_decay(3)] * 2)
        torch.set_rng_state(client["rng"])
        _, resumed, _ = _tierstack(None, batches, 6, None, engine=fresh, start=3)
        assert resumed == losses[3 * ACCUMULATION:]
    finally:
        fresh.close()


def test_the_callers_torch_adamw_is_followed_and_other_optimizers_are_refused(shared_daemon):
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW([{"params": model.blocks.parameters(), "lr": 1e-2},
                                   {"params": [*model.embed.parameters(), *model.norm.parameters(),
                                               *model.head.parameters()], "lr": 2e-3}],
                                  weight_decay=0.05)
    config = {k: v for k, v in CONFIG.items() if k not in ("optimizer", "gradient_clipping")}
    config["gradient_accumulation_steps"] = 1
    engine, returned, loader, schedule = tierstack.initialize(
        model=model, optimizer=optimizer, config=config, tier_manager=shared_daemon.address)
    try:
        assert loader is None and schedule is None
        assert [g["lr"] for g in returned.param_groups] == [1e-2, 2e-3]
        ref_opt = torch.optim.AdamW([{"params": reference.blocks.parameters(), "lr": 1e-2},
                                     {"params": [*reference.embed.parameters(),
                                                 *reference.norm.parameters(),
                                                 *reference.head.parameters()], "lr": 2e-3}],
                                    weight_decay=0.05)
        for i, (ids, targets, mask) in enumerate(_batches(3, 3)):
            torch.manual_seed(i)  # the same dropout on both sides
            loss = _my_loss(engine(ids, mask), targets, mask)
            engine.backward(loss)
            engine.step()
            torch.manual_seed(i)
            ref_loss = _my_loss(reference(ids, mask), targets, mask)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    finally:
        engine.close()
    with pytest.raises(ConfigError, match="SGD"):
        tierstack.initialize(model=Net(), optimizer=torch.optim.SGD(Net().parameters(), lr=0.1),
                             config=config, tier_manager=shared_daemon.address)
    with pytest.raises(ConfigError, match="L2"):
        tierstack.initialize(model=Net(), optimizer=torch.optim.Adam(Net().parameters(),
                                                                     weight_decay=0.1),
                             config=config, tier_manager=shared_daemon.address)
    with pytest.raises(ConfigError, match="both in the config"):
        tierstack.initialize(model=Net(), optimizer=torch.optim.AdamW(Net().parameters()),
                             config=CONFIG, tier_manager=shared_daemon.address)


def test_a_scheduler_made_on_the_callers_optimizer_before_initialize_moves_the_engines_lr(
        shared_daemon):
    """lr_scheduler= a torch scheduler built on the caller's own AdamW (as scripts make them
    before deepspeed.initialize): the engine steps at the lrs it sets, as plain PyTorch."""
    torch.manual_seed(0)
    model = Net().eval()  # no dropout on either side
    reference = copy.deepcopy(model)
    halving = lambda step: 0.5 ** step  # noqa: E731
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, halving)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_schedule = torch.optim.lr_scheduler.LambdaLR(ref_opt, halving)
    config = {k: v for k, v in CONFIG.items() if k not in ("optimizer", "gradient_clipping")}
    config["gradient_accumulation_steps"] = 1
    engine, _, _, _ = tierstack.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule,
                                           config=config, tier_manager=shared_daemon.address)
    try:
        engine.eval()
        for ids, targets, mask in _batches(8, 4):
            loss = _my_loss(engine(ids, mask), targets, mask)
            engine.backward(loss)
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                engine.step()  # the engine stepped in the optimizer's place: torch's warning is wrong
            assert not [w for w in said if "lr_scheduler.step()" in str(w.message)], said[0].message
            ref_loss = _my_loss(reference(ids, mask), targets, mask)
            ref_loss.backward()
            ref_opt.step()
            ref_schedule.step()
            ref_opt.zero_grad()
            assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
        assert engine.get_lr() == [1e-2 * 0.5 ** 4]
    finally:
        engine.close()


def test_an_argparse_script_without_clipping_reads_every_steps_norm_and_its_batch_keys(
        shared_daemon, tmp_path):
    """A DeepSpeedExamples-style script: add_config_arguments, --deepspeed_config, a JSON
    giving train_batch_size and the micro batch (accumulation derived, as DeepSpeed does),
    no clipping. Every step's get_global_grad_norm is torch's total norm of that step, the
    losses are plain PyTorch's, and the engine says where it stands as DeepSpeed's does."""
    import argparse

    config = {k: v for k, v in CONFIG.items() if k not in ("gradient_clipping", "gradient_accumulation_steps")}
    config["train_batch_size"] = ROWS * ACCUMULATION
    (tmp_path / "ds.json").write_text(json.dumps(config))
    parser = tierstack.add_config_arguments(argparse.ArgumentParser())
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(tmp_path / "ds.json")])
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    batches = _batches(3, 3 * ACCUMULATION)
    optimizer = torch.optim.AdamW(_groups(reference), lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    torch.manual_seed(7)
    want_losses, want_norms = [], []
    for step in range(3):
        for ids, targets, mask in batches[step * ACCUMULATION:(step + 1) * ACCUMULATION]:
            loss = _my_loss(reference(ids, mask), targets, mask)
            (loss / ACCUMULATION).backward()
            want_losses.append(loss.item())
        want_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf")).item())
        optimizer.step()
        optimizer.zero_grad()
    torch.manual_seed(7)
    engine, _, _, _ = tierstack.initialize(args=args, model=model, model_parameters=_groups(model),
                                           tier_manager=shared_daemon.address)
    try:
        assert engine.get_global_grad_norm() is None  # no step yet
        assert (engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu(),
                engine.train_batch_size()) == (ACCUMULATION, ROWS, ROWS * ACCUMULATION)
        assert (engine.global_rank, engine.world_size, engine.dp_world_size, engine.local_rank) == (0, 1, 1, 0)
        losses, norms = [], []
        for step in range(3):
            for ids, targets, mask in batches[step * ACCUMULATION:(step + 1) * ACCUMULATION]:
                loss = _my_loss(engine(ids, mask), targets, mask)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            norms.append(engine.get_global_grad_norm())
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(want_norms), rtol=1e-5, atol=0)
        assert engine.global_steps == 3 and engine.global_samples == 3 * ROWS * ACCUMULATION
    finally:
        engine.close()


def test_save_16bit_model_with_a_file_name_writes_the_whole_state_dict_there(shared_daemon, tmp_path):
    """DeepSpeed's save_16bit_model(dir, 'pytorch_model.bin'): one torch.save'd state dict
    a plain model loads (strict), the trained weights; '.safetensors' likewise; no name:
    the sharded export. A name with a path in it is refused and writes nothing."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    engine, _, _, _ = tierstack.initialize(model=Net(), config=CONFIG, tier_manager=shared_daemon.address)
    try:
        for ids, targets, mask in _batches(5, 2 * ACCUMULATION):
            engine.backward(_my_loss(engine(ids, mask), targets, mask))
            engine.step()
        ids, _, mask = _batches(6, 1)[0]
        engine.eval()
        with torch.no_grad():
            want = engine(ids, mask)
        assert engine.save_16bit_model(tmp_path / "bin", "pytorch_model.bin")
        assert engine.save_16bit_model(tmp_path / "st", "model.safetensors")
        engine.save_16bit_model(tmp_path / "shards")
        with pytest.raises(InvalidArgumentError, match="plain file name"):
            engine.save_16bit_model(tmp_path / "bad", "../escape.bin")
    finally:
        engine.close()
    assert not (tmp_path / "bad").exists() and not (tmp_path / "escape.bin").exists()
    assert sorted(p.name for p in (tmp_path / "bin").iterdir()) == ["pytorch_model.bin"]
    assert (tmp_path / "shards" / "model.safetensors.index.json").exists()
    for state in (torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True),
                  load_file(tmp_path / "st" / "model.safetensors")):
        plain = Net()
        plain.load_state_dict(state, strict=True)
        plain.eval()
        with torch.no_grad():
            torch.testing.assert_close(plain(ids, mask), want, rtol=1e-5, atol=1e-6)


def test_bad_calls_are_refused_in_one_line(shared_daemon, tmp_path):
    torch.manual_seed(0)
    with pytest.raises(ConfigError, match="torch.nn.Module"):
        tierstack.initialize(model="not a model", config=CONFIG)
    with pytest.raises(ConfigError, match="does not exist"):
        tierstack.initialize(model=Net(), config=str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="blocks_attr 'embed'"):
        tierstack.initialize(model=Net(), config=CONFIG, blocks_attr="embed",
                             tier_manager=shared_daemon.address)
    engine, _, _, _ = tierstack.initialize(model=Net(), config=CONFIG,
                                           tier_manager=shared_daemon.address)
    try:
        ids, targets, mask = _batches(4, 1)[0]
        out = engine(ids, mask)
        with pytest.raises(InvalidArgumentError, match="scalar loss"):
            engine.backward(out)
        engine.backward(_my_loss(out, targets, mask))
        for tag in ("../escape", "a/b", "", ".hidden"):
            with pytest.raises(InvalidArgumentError, match="plain name"):
                engine.save_checkpoint(tmp_path / "c", tag=tag)
        assert not (tmp_path / "escape").exists()
        assert engine.load_checkpoint(tmp_path / "nothing-here") == (None, None)
        with pytest.raises(InvalidArgumentError, match="no checkpoint 'nope'"):
            engine.load_checkpoint(tmp_path, tag="nope")
    finally:
        engine.close()


def test_an_address_where_nothing_answers_fails_within_two_seconds(tmp_path):
    """Checked within 2 s, not the store's reconnect_timeout (60 s, for restarts): bound by
    that wait, a quarter of it, not by the clock, so that a loaded machine passes."""
    for call in (lambda: tierstack.initialize(model=Net(), config=CONFIG,
                                              tier_manager=f"unix:{tmp_path}/none.sock"),
                 lambda: LayerStore("j", address=f"unix:{tmp_path}/none.sock"),
                 lambda: LayerStore("j", address="127.0.0.1:9")):
        start = time.monotonic()
        with pytest.raises((ConfigError, TierManagerUnavailableError)) as info:
            call()
        assert time.monotonic() - start < 60.0 / 4
        text = str(info.value)
        assert "\n" not in text and ("none.sock" in text or "127.0.0.1:9" in text)


def test_with_no_daemon_one_is_started_in_a_directory_named_by_the_job_under_nvme_path(
        tmp_path, monkeypatch):
    """The config's nvme_path is where the job's NVMe pool lives (a directory named after
    the job, recorded in the run index while it runs); closing removes both."""
    monkeypatch.setenv("TIERSTACK_TIER_MANAGER", f"unix:{tmp_path}/nobody-here.sock")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    nvme = tmp_path / "my-nvme"
    config = json.loads(json.dumps(CONFIG))
    for section in ("offload_param", "offload_optimizer"):
        config["zero_optimization"][section] = {"device": "nvme", "nvme_path": str(nvme)}
    engine, _, _, _ = tierstack.initialize(model=Net(), config=config, job="my-job")
    try:
        assert (nvme / "my-job").is_dir()
        assert any(nvme.joinpath("my-job").iterdir())  # the pool's files are there
        index = list((tmp_path / "state" / "tierstack" / "runs").glob("*.json"))
        assert [json.loads(p.read_text())["directories"] for p in index] == [[str(nvme / "my-job")]]
        for ids, targets, mask in _batches(5, 2):
            engine.backward(_my_loss(engine(ids, mask), targets, mask))
            engine.step()
        assert engine.core.store.tiers.stats().nvme_bytes_written > 0
    finally:
        engine.close()
    assert not nvme.exists()  # made for the run, removed with it
    assert not list((tmp_path / "state" / "tierstack" / "runs").glob("*.json"))
    assert os.environ["TIERSTACK_TIER_MANAGER"].endswith("nobody-here.sock")


@pytest.mark.parametrize("section", ["offload_param", "offload_optimizer"])
def test_a_directory_that_cannot_be_made_is_named_by_the_deepspeed_key_in_one_exception(
        tmp_path, monkeypatch, section):
    """initialize's error names the JSON's own key (each nvme_path by its section, where the
    two name different directories), not tier_manager.nvme_pool.paths, and is one exception:
    nothing chained behind it."""
    monkeypatch.setenv("TIERSTACK_TIER_MANAGER", f"unix:{tmp_path}/nobody-here.sock")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    (tmp_path / "a-file").write_text("")
    config = json.loads(json.dumps(CONFIG))
    for name, path in (("offload_param", tmp_path / "nvme"), ("offload_optimizer", tmp_path / "nvme2")):
        where = tmp_path / "a-file" if name == section else path
        config["zero_optimization"][name] = {"device": "nvme", "nvme_path": str(where)}
    with pytest.raises(ConfigError) as info:
        tierstack.initialize(model=Net(), config=config, job="bad-dir")
    assert str(info.value) == (f"zero_optimization.{section}.nvme_path {tmp_path / 'a-file'} is a "
                               f"file, not a directory; give a directory (on an NVMe drive for "
                               f"speed), created if missing")
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert not (tmp_path / "nvme").exists() and not (tmp_path / "nvme2").exists()


def test_an_engine_error_names_the_deepspeed_key(shared_daemon):
    """Refused while the engine registers its blocks (offload_param.buffer_size, DeepSpeed's
    staging buffer): the message names the JSON's keys."""
    config = json.loads(json.dumps(CONFIG))
    config["zero_optimization"]["offload_param"]["buffer_size"] = 100
    with pytest.raises(ConfigError) as info:
        tierstack.initialize(model=Net(), config=config, tier_manager=shared_daemon.address)
    assert str(info.value) == (
        "block blocks.0: tensor 'up.weight' has 2,048 elements, more than "
        "zero_optimization.offload_param.buffer_size (100); raise it to at least 2048, or keep "
        "the block on the device with tier_overrides")


FP16_CONFIG = {
    "train_micro_batch_size_per_gpu": ROWS,
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                          "offload_optimizer": {"device": "cpu"}},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 10, "hysteresis": 1,
             "loss_scale_window": 2},
}


def _fp16_reference_step(model, masters, optimizer, batch, scale):
    """Plain PyTorch mixed precision, written out: fp16 forward and backward of the scaled
    loss, fp32 masters stepped with the unscaled gradients, the model rounded from them."""
    ids, targets, mask = batch
    loss = _my_loss(model(ids, mask.half()).float(), targets, mask)
    (loss * scale).backward()
    for p, m in zip(model.parameters(), masters):
        m.grad = p.grad.float() / scale
        p.grad = None
    optimizer.step()
    with torch.no_grad():
        for p, m in zip(model.parameters(), masters):
            p.copy_(m)
    return loss.item()


def test_fp16_trains_with_dynamic_loss_scaling_and_an_overflow_skips_its_step(shared_daemon):
    """fp16 as DeepSpeed runs it: the loss is scaled (2^10 here), gradients unscaled into fp32
    masters; a step whose gradients overflow changes no weight, lowers the scale and does
    not step the schedule; clean steps raise it again after loss_scale_window."""
    torch.manual_seed(0)
    model = Net().eval()  # no dropout: the two sides draw no random numbers
    reference = copy.deepcopy(model).half()
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.0)
    engine, _, _, schedule = tierstack.initialize(model=model, config=FP16_CONFIG,
                                                  tier_manager=shared_daemon.address)
    try:
        assert engine.fp16_enabled() and engine.loss_scale() == 1024.0
        engine.eval()  # no dropout (the engine trains all the same)
        batches = _batches(6, 5)
        scales = []
        for batch in batches[:3]:
            ids, targets, mask = batch
            expected = _fp16_reference_step(reference, masters, ref_opt, batch, engine.loss_scale())
            loss = _my_loss(engine(ids, mask.half()).float(), targets, mask)
            engine.backward(loss)
            engine.step()
            assert loss.item() == pytest.approx(expected, rel=2e-3)
            assert engine.was_step_applied()
            scales.append(engine.loss_scale())
        # DeepSpeed's rule: raised once loss_scale_window (2) iterations after the last
        # overflow (none: iteration -1) were clean, i.e. after the third.
        assert scales == [1024.0, 1024.0, 2048.0]
        engine.core.wait_for_optimizer()  # the last step's updates run behind it
        before = {k: v.clone() for k, v in engine.core.store.read_layer(0).items()}
        ids, targets, mask = batches[3]
        loss = _my_loss(engine(ids, mask.half()).float(), targets, mask)
        engine.backward(loss * float("inf"))  # the gradients overflow
        engine.step()
        assert not engine.was_step_applied() and engine.skipped_steps == 1
        assert engine.loss_scale() == 1024.0 and engine.global_steps == 4
        engine.core.wait_for_optimizer()
        after = engine.core.store.read_layer(0)
        assert all(torch.equal(before[k], after[k]) for k in before)  # no weight moved
        ids, targets, mask = batches[4]  # and training goes on
        expected = _fp16_reference_step(reference, masters, ref_opt, batches[4], 1024.0)
        loss = _my_loss(engine(ids, mask.half()).float(), targets, mask)
        engine.backward(loss)
        engine.step()
        assert engine.was_step_applied() and loss.item() == pytest.approx(expected, rel=2e-3)
    finally:
        engine.close()


def test_the_configs_warmup_decay_schedule_moves_the_lr_of_every_group_as_deepspeed_does(
        shared_daemon):
    """A DeepSpeed JSON's `scheduler` section: WarmupDecayLR with DeepSpeed's parameter
    names, stepped by engine.step() after each optimizer step; the losses are plain
    PyTorch's with the same schedule on a torch AdamW."""
    from tierstack.lr_schedules import WarmupDecayLR

    params = {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 3,
              "total_num_steps": 8, "warmup_type": "linear"}
    config = {**CONFIG, "scheduler": {"type": "WarmupDecayLR", "params": params}}
    torch.manual_seed(0)
    model = Net().eval()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(_groups(reference), lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    ref_schedule = WarmupDecayLR(ref_opt, **params)
    engine, optimizer, _, schedule = tierstack.initialize(
        model=model, model_parameters=_groups(model), config=config,
        tier_manager=shared_daemon.address)
    try:
        engine.eval()  # no dropout on either side
        assert isinstance(schedule, WarmupDecayLR) and engine.lr_scheduler is schedule
        lrs, ref_lrs = [], []
        batches = _batches(7, 5 * ACCUMULATION)
        for step in range(5):
            for ids, targets, mask in batches[step * ACCUMULATION:(step + 1) * ACCUMULATION]:
                loss = _my_loss(engine(ids, mask), targets, mask)
                engine.backward(loss)
                engine.step()
                ref_loss = _my_loss(reference(ids, mask), targets, mask)
                (ref_loss / ACCUMULATION).backward()
                assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
            ref_opt.step()
            ref_schedule.step()
            ref_opt.zero_grad()
            lrs.append(engine.get_lr())
            ref_lrs.append([g["lr"] for g in ref_opt.param_groups])
        assert lrs == ref_lrs and lrs[0] != lrs[2]  # the lr moved, alike on both sides
    finally:
        engine.close()
