"""DeepSpeed JSON as is: a ZeRO-Offload cpu file and a ZeRO-Infinity nvme file, written as
DeepSpeed users write them, train a small model unmodified through
`OffloadEngine.from_config` against a real daemon started from the same file."""

from __future__ import annotations

import copy
import json
import logging
import os

import pytest
import torch

from tests.worker.test_offload import TinyGPT
from tierstack.config import load_config
from tierstack.errors import ConfigError
from tierstack.services.tier_manager.client import TierManagerClient
from tierstack.services.tier_manager.embedded import EmbeddedTierManager
from tierstack.worker.engine.offload_engine import OffloadEngine
from tierstack.worker.store.layer_store import LayerStore
from tierstack.worker.engine.tiered_adamw import MOMENTS

HYPER = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def _deepspeed(device: str, nvme_path: str) -> dict:
    offload = {"device": device, "pin_memory": True}
    if device == "nvme":
        offload["nvme_path"] = nvme_path
    return {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": HYPER},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {**offload, "buffer_count": 4, "buffer_size": 1e8,
                              **({"max_in_cpu": 0} if device == "nvme" else {})},
            "offload_optimizer": {**offload, "buffer_count": 4, "fast_init": False},
            "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
            "stage3_prefetch_bucket_size": 5e8, "stage3_param_persistence_threshold": 1e4,
            "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        },
        "aio": {"block_size": 262144, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                "overlap_events": True, "use_gds": False},
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
    }


def _plain_losses(model, batches):
    opt = torch.optim.AdamW(model.parameters(), fused=True, lr=HYPER["lr"], betas=tuple(HYPER["betas"]),
                            eps=HYPER["eps"], weight_decay=HYPER["weight_decay"])
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_a_deepspeed_json_trains_unmodified(tmp_path, device):
    path = tmp_path / f"ds_{device}.json"
    nvme_path = tmp_path / "local_nvme"
    path.write_text(json.dumps(_deepspeed(device, str(nvme_path))))
    config = load_config(path)  # the file as a DeepSpeed user wrote it
    torch.manual_seed(0)
    reference = TinyGPT(dim=64, layers=3)
    model = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 256, (4, 32), generator=g), torch.randint(0, 256, (4, 32), generator=g))
               for _ in range(4)]
    expected = _plain_losses(reference, batches)
    # The daemon from the same file: pools 'auto' (sized by the machine's budgets, grown to
    # need), the NVMe pool at the file's nvme_path (a cpu file names none: the default).
    tm = config.tier_manager
    if device == "cpu":
        tm.nvme_pool.paths = [str(tmp_path / "spill")]
    tm.metrics.http_listen = ""
    with EmbeddedTierManager(tm) as daemon:
        store = LayerStore("ds", device="cpu", address=daemon.address, durable=False,
                           device_budget=config.train.device_budget_bytes(1 << 20))
        try:
            engine = OffloadEngine(model, store, config.train)
            got = [engine.train_step(x, y) for x, y in batches]
            engine.close()
            stats = TierManagerClient(daemon.address).stats()
        finally:
            store.close()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
    if device == "nvme":  # nvme_path honoured: the blocks went through the file's directory
        assert stats.nvme_bytes_written > 0
        assert os.path.exists(nvme_path / "tierstack-nvme.data")
    else:  # the state stays in the CPU pool: NVMe holds only the layouts (written durably)
        assert stats.evictions == 0 and stats.nvme_bytes_read == 0 and stats.cpu_used > 0
        # the layouts only: a few KiB each (a data block and its self-describing header)
        assert stats.nvme_used * 10 < stats.cpu_used, stats


# ---- the translation alone: scheduler, fp16, "auto", and errors in the user's keys -------

def _ds(**sections) -> dict:
    """A small DeepSpeed cpu-offload file with `sections` added or replaced."""
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": dict(HYPER)},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                  "offload_optimizer": {"device": "cpu"}},
            "aio": {"block_size": 1048576, "queue_depth": 8},
            **sections}


def test_a_deepspeed_scheduler_section_is_train_lr_schedule():
    from tierstack.lr_schedules import WarmupDecayLR, build_schedule
    params = {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10,
              "total_num_steps": 1e3, "warmup_type": "linear"}
    schedule = load_config(_ds(scheduler={"type": "WarmupDecayLR", "params": params})).train.lr_schedule
    assert (schedule.type, schedule.params) == ("WarmupDecayLR", params)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=HYPER["lr"])
    built = build_schedule(opt, schedule)
    assert isinstance(built, WarmupDecayLR) and built.total_num_steps == 1000
    # DeepSpeed's WarmupLR with no params at all: its defaults.
    assert load_config(_ds(scheduler={"type": "WarmupLR"})).train.lr_schedule.params == {}


def test_fp16_enabled_gives_a_config_with_deepspeeds_loss_scaling():
    config = load_config(_ds(fp16={"enabled": True}))
    fp16 = config.train.fp16
    assert config.train.precision == "fp16"
    assert (fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window) == (0.0, 16, 1000)
    assert (fp16.hysteresis, fp16.consecutive_hysteresis, fp16.min_loss_scale) == (2, False, 1.0)
    written = {"enabled": True, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 12,
               "loss_scale_window": 500, "hysteresis": 4, "consecutive_hysteresis": True,
               "min_loss_scale": 0.25, "fp16_master_weights_and_grads": False}
    fp16 = load_config(_ds(fp16=written)).train.fp16
    assert (fp16.initial_scale_power, fp16.loss_scale_window, fp16.hysteresis) == (12, 500, 4)
    assert fp16.consecutive_hysteresis is True and fp16.min_loss_scale == 0.25
    static = load_config(_ds(fp16={"enabled": True, "loss_scale": 128})).train.fp16
    assert static.loss_scale == 128.0
    # A disabled section still loads (the Hugging Face stock file carries one): fp32.
    assert load_config(_ds(fp16={"enabled": False, "loss_scale": 0})).train.precision == "fp32"


@pytest.mark.parametrize("key,where", [
    ("bf16.enabled", lambda d: d.update(bf16={"enabled": "auto"})),
    ("fp16.enabled", lambda d: d.update(fp16={"enabled": "auto", "loss_scale": 0})),
    ("optimizer.params.lr", lambda d: d["optimizer"]["params"].update(lr="auto")),
    ("scheduler.params.warmup_num_steps",
     lambda d: d.update(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}})),
    ("zero_optimization.reduce_bucket_size",
     lambda d: d["zero_optimization"].update(reduce_bucket_size="auto")),
    ("gradient_clipping", lambda d: d.update(gradient_clipping="auto")),
])
def test_auto_anywhere_is_refused_in_one_line_naming_the_key(key, where):
    data = _ds()
    where(data)
    with pytest.raises(ConfigError, match=rf'^{key}: "auto" is the Hugging Face Trainer\'s '
                                          rf'placeholder.*tierstack.hf_deepspeed.fill_auto.*'
                                          rf'write a value$') as err:
        load_config(data)
    assert "\n" not in str(err.value)


def test_auto_in_tierstacks_own_sections_of_a_deepspeed_file_is_theirs():
    config = load_config(_ds(budgets={"hbm": "auto", "host": "auto"},
                             tier_manager={"cpu_pool": {"size": "auto"}}))
    assert config.budgets.hbm == "auto" and config.tier_manager.cpu_pool.size == "auto"


@pytest.mark.parametrize("change,message", [
    # Errors raised while validating the translated config, in the user's keys:
    (lambda d: d["zero_optimization"]["offload_param"].update(buffer_count=0),
     r"^zero_optimization.offload_param.buffer_count must be at least 1, got 0$"),
    (lambda d: d["optimizer"]["params"].update(betas=[0.9]),
     r"^optimizer.params.betas must be two numbers in \[0, 1\)"),
    (lambda d: d["optimizer"]["params"].update(lr=-1),
     r"^optimizer.params: lr and eps must be positive"),
    (lambda d: d["aio"].update(block_size=1000), r"^aio.block_size: 1000 is not a positive multiple"),
    (lambda d: d["aio"].update(intra_op_parallelism=0),
     r"^aio.intra_op_parallelism: 0 must be between 1 and 1024$"),
    (lambda d: d.update(train_micro_batch_size_per_gpu=0),
     r"^train_micro_batch_size_per_gpu must be at least 1, got 0$"),
    (lambda d: d.update(gradient_accumulation_steps=0), r"^gradient_accumulation_steps must be at least 1"),
    (lambda d: d.update(gradient_clipping=-1.0), r"^gradient_clipping must be >= 0$"),
    (lambda d: d.update(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 0}}),
     r"^scheduler.params.warmup_num_steps: expected an integer >= 1, got 0$"),
    (lambda d: d.update(scheduler={"type": "WarmupDecayLR", "params": {"warmup_max_l": 1}}),
     r"^unknown config key scheduler.params.warmup_max_l of WarmupDecayLR; did you mean "
     r"scheduler.params.warmup_max_lr\?$"),
    (lambda d: d.update(scheduler={"type": "WarmupDecayLR"}),
     r"^scheduler.params.total_num_steps: WarmupDecayLR needs it"),
    (lambda d: d.update(scheduler={"type": "WarmupLr"}),
     r"^scheduler.type: 'WarmupLr' is not a learning-rate schedule.*did you mean WarmupLR\?\)$"),
    (lambda d: d.update(fp16={"enabled": True, "hysteresis": 0}), r"^fp16.hysteresis must be at least 1"),
    (lambda d: d.update(fp16={"enabled": True, "initial_scale_power": 16.5}),
     r"^fp16.initial_scale_power: expected an integer, got 16.5$"),
    (lambda d: d.update(tier_overrides={"model.layers": "tape"}), r"^tier_overrides"),
    # ... and the translation's own:
    (lambda d: d.update(fp16={"enabled": True, "auto_cast": True}), r"^fp16.auto_cast: casting"),
    (lambda d: d.update(fp16={"enabled": True, "fp16_master_weights_and_grads": True}),
     r"^fp16.fp16_master_weights_and_grads: tierstack keeps fp32 master weights"),
    (lambda d: d.update(fp16={"enabled": True, "loss_scal": 0}),
     r"^unknown DeepSpeed key fp16.loss_scal; did you mean fp16.loss_scale\?$"),
    (lambda d: d.update(bf16={"enabled": "yes"}), r"^bf16.enabled: expected true or false, got 'yes'$"),
    (lambda d: d.update(scheduler={"type": "OneCycle", "param": {}}),
     r"^unknown DeepSpeed key scheduler.param; did you mean scheduler.params\?$"),
    (lambda d: d.update(scheduler={"params": {}}), r"^scheduler.type is missing"),
    (lambda d: d.update(checkpoint={"use_node_local_storage": True}),
     r"^checkpoint.use_node_local_storage: rank 0 writes one checkpoint"),
])
def test_every_error_names_the_deepspeed_key_the_user_wrote(change, message):
    data = _ds()
    change(data)
    with pytest.raises(ConfigError, match=message) as err:
        load_config(data)
    assert "train." not in str(err.value) and "tier_manager." not in str(err.value)


def test_features_left_off_are_accepted():
    config = load_config(_ds(checkpoint={"use_node_local_storage": False},
                             fp16={"enabled": False, "auto_cast": False},
                             flops_profiler={"enabled": False, "profile_step": 1},
                             tensorboard={"enabled": False}))
    assert config.train.precision == "fp32"


def test_the_monitor_keys_are_train_monitor_and_their_errors_name_the_users_key():
    config = load_config(_ds(steps_per_print=25, wall_clock_breakdown=True,
                             tensorboard={"enabled": True, "output_path": "logs/", "job_name": "j"},
                             csv_monitor={"enabled": True},
                             wandb={"enabled": False, "group": None, "team": None, "project": "p"}))
    monitor = config.train.monitor
    assert (monitor.steps_per_print, monitor.wall_clock_breakdown) == (25, True)
    assert (monitor.tensorboard.enabled, monitor.tensorboard.output_path, monitor.tensorboard.job_name) \
        == (True, "logs/", "j")
    assert monitor.csv_monitor.enabled and monitor.csv_monitor.job_name == "DeepSpeedJobName"
    assert (monitor.wandb.group, monitor.wandb.team, monitor.wandb.project) == ("", "", "p")
    assert load_config(_ds(steps_per_print=None)).train.monitor.steps_per_print == 0
    with pytest.raises(ConfigError, match=r"^unknown DeepSpeed key tensorboard.outpt_path; did you "
                                          r"mean tensorboard.output_path\?$"):
        load_config(_ds(tensorboard={"enabled": True, "outpt_path": "x"}))
    with pytest.raises(ConfigError, match=r"^steps_per_print must be 0 \(no step lines\)"):
        load_config(_ds(steps_per_print=-1))
    with pytest.raises(ConfigError, match=r"^wall_clock_breakdown: expected true or false"):
        load_config(_ds(wall_clock_breakdown="yes"))


def test_only_translated_keys_are_renamed_in_a_message():
    from tierstack.deepspeed_config import translate
    translation = translate(_ds(zero_optimization={
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/a"},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/b"}}))
    assert translation.in_user_keys("train.params.device x; budgets.host y; e.g. 1.5 GiB") == \
        "zero_optimization.offload_param.device x; budgets.host y; e.g. 1.5 GiB"
    assert translation.in_user_keys("tier_manager.nvme_pool.paths: z") == (
        "zero_optimization.offload_param.nvme_path and "
        "zero_optimization.offload_optimizer.nvme_path: z")


def test_optimizer_state_a_deepspeed_json_puts_on_nvme_is_on_nvme_and_out_of_the_cpu_pool(tmp_path):
    """offload_optimizer.device "nvme" is a pin, as in DeepSpeed: after every step each
    block's moments are on NVMe and not in the CPU pool, which holds the parameters the
    file keeps there (offload_param.device "cpu") and no more than a few blocks' state in
    flight, whatever room the machine's budget gives it."""
    ds = _deepspeed("cpu", "")
    ds["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}
    config = load_config(ds)
    assert config.train.optimizer_state.tier() == "nvme"
    torch.manual_seed(0)
    model = TinyGPT(dim=128, layers=4)
    block_params = sum(p.numel() for p in model.blocks[0].parameters()) * 4  # fp32
    tm = config.tier_manager
    tm.metrics.http_listen = ""
    with EmbeddedTierManager(tm) as daemon:
        client = TierManagerClient(daemon.address)
        store = LayerStore("ds-pin", device="cpu", address=daemon.address, durable=False,
                           device_budget=config.train.device_budget_bytes(1 << 20))
        try:
            engine = OffloadEngine(model, store, config.train)
            g = torch.Generator().manual_seed(2)
            used = []
            for _ in range(3):
                engine.train_step(torch.randint(0, 256, (4, 32), generator=g),
                                  torch.randint(0, 256, (4, 32), generator=g))
                engine.wait_for_optimizer()
                used.append(client.stats().cpu_used)
            moments = [client.describe(store.key(i, kind)) for i in range(4) for kind in MOMENTS]
            params = [client.describe(store.key(i)) for i in range(4)]
            stats = client.stats()
            engine.close()
        finally:
            store.close()
    assert all(m.on_nvme and not m.in_cpu for m in moments), moments
    assert all(p.in_cpu for p in params), params  # the file keeps the parameters in the pool
    state_on_nvme = sum(m.nbytes for m in moments)
    assert stats.nvme_used >= state_on_nvme
    # Between steps the pool holds the four blocks' parameters and their layouts; the
    # moments (twice the parameters) would have tripled it.
    assert max(used) < 4 * block_params + state_on_nvme / 4, (used, block_params)


# ---- ZeRO stages 0, 1 and 2: what each asks of the placement ---------------------------

ZERO2_OFFLOAD = {  # DeepSpeed's ZeRO-Offload, as its tutorials and Hugging Face write it
    "train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": HYPER},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                          "contiguous_gradients": True, "round_robin_gradients": True},
}
STAGE_0 = {  # no zero_optimization section: DeepSpeed's stage 0 (plain data parallelism)
    "train_batch_size": 4, "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": HYPER},
}


def _stage(stage: int, **sections) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": dict(HYPER)},
            "zero_optimization": {"stage": stage, **sections}}


@pytest.mark.parametrize("data,params,state,warning", [
    (ZERO2_OFFLOAD, "none", "cpu", None),
    (_stage(1, offload_optimizer={"device": "nvme", "nvme_path": "/x"}), "none", "nvme", None),
    (_stage(2), "auto", "none", "zero_optimization.stage 2 without offload: DeepSpeed keeps the "
                                "parameters, gradients and optimizer state on the GPU; tierstack "
                                "places them by its HBM budget"),
    (STAGE_0, "auto", "none", "zero_optimization.stage 0 without offload: DeepSpeed (no ZeRO) "
                              "keeps every parameter, gradient and optimizer state on each GPU"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, "none", "cpu",
     "zero_optimization.stage 0 with zero_optimization.offload_optimizer: DeepSpeed offloads the "
     "optimizer state at stages 1-3 only"),
    (_stage(2, offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"}), "cpu", "cpu",
     "zero_optimization.stage 2: DeepSpeed offloads parameters at stage 3 only and ignores "
     "zero_optimization.offload_param; tierstack offloads them as the section asks"),
    (_stage(3), "auto", "none", None),
])
def test_each_zero_stage_is_a_placement_and_a_difference_from_deepspeed_is_said_once(
        data, params, state, warning, caplog, monkeypatch):
    from tierstack import deepspeed_config
    monkeypatch.setattr(deepspeed_config, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="tierstack.deepspeed_config"):
        for _ in range(2):  # a Trainer run reads its JSON more than once: one warning
            train = load_config(data).train
    assert (train.params.device, train.optimizer_state.device) == (params, state)
    said = [r.getMessage() for r in caplog.records]
    if warning is None:
        assert said == []
    else:
        assert len(said) == 1 and said[0].startswith(warning), said


def test_several_ranks_below_stage_3_are_partitioned_and_it_is_said(caplog, monkeypatch):
    from tierstack import deepspeed_config
    monkeypatch.setattr(deepspeed_config, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="tierstack.deepspeed_config"):
        load_config(dict(ZERO2_OFFLOAD, train_batch_size=8), world_size=2)
    assert [r.getMessage() for r in caplog.records] == [
        "zero_optimization.stage 2 with 2 ranks: DeepSpeed keeps a whole copy of the parameters "
        "on every rank; tierstack partitions every offloaded block's state over the ranks, as at "
        "stage 3"]


@pytest.mark.parametrize("name", ["zero2_offload_optimizer", "stage0"])
def test_a_zero2_offload_json_and_a_stage0_json_train_as_plain_pytorch(shared_daemon, tmp_path, name):
    """Through tierstack.initialize, as a DeepSpeed script runs them: the same losses as plain
    PyTorch's AdamW on the same seed. ZeRO-Offload keeps every block's optimizer state (its
    moments) in the tier manager's CPU pool, stepped there; stage 0 leaves the blocks to the
    placement ('auto')."""
    import tierstack

    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(ZERO2_OFFLOAD if name == "zero2_offload_optimizer" else STAGE_0))
    torch.manual_seed(0)
    reference = TinyGPT(dim=64, layers=3)
    model = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 256, (4, 32), generator=g), torch.randint(0, 256, (4, 32), generator=g))
               for _ in range(4)]
    expected = _plain_losses(reference, batches)
    engine, _, _, _ = tierstack.initialize(model=model, model_parameters=model.parameters(),
                                           config=str(path), tier_manager=shared_daemon.address)
    client = TierManagerClient(shared_daemon.address)
    try:
        got = []
        for x, y in batches:
            loss = torch.nn.functional.cross_entropy(engine(x).flatten(0, 1), y.flatten())
            engine.backward(loss)
            engine.step()
            got.append(loss.item())
        core = engine.core
        core.wait_for_optimizer()
        if name == "zero2_offload_optimizer":
            assert core.tiers == core.state_tiers == ["cpu"] * 3
            moments = [client.describe(core.store.key(i, kind)) for i in range(3) for kind in MOMENTS]
            assert all(m.in_cpu for m in moments), moments
        else:
            assert core.tiers == ["auto"] * 3
    finally:
        client.close()
        engine.close()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
