import json
import logging

import pytest

from tierstack.config import GiB, MiB, load_config, parse_size
from tierstack.errors import ConfigError


def test_defaults_load_and_validate():
    config = load_config()
    assert config.tier_manager.nvme_pool.aio.block_size == 1 * MiB
    assert config.tier_manager.cpu_pool.size == "auto" == config.tier_manager.nvme_pool.size


@pytest.mark.parametrize("text,expected", [
    ("4GiB", 4 * GiB), ("512MiB", 512 * MiB), ("1.5GB", 1_500_000_000), (4096, 4096), ("4096", 4096),
])
def test_sizes_are_read_with_units(text, expected):
    assert parse_size(text) == expected


def test_unknown_key_is_named_with_its_path():
    with pytest.raises(ConfigError, match=r"unknown config key tier_manager\.nvme_pool\.aio\.queue_dpth"):
        load_config({"tier_manager": {"nvme_pool": {"aio": {"queue_dpth": 8}}}})


@pytest.mark.parametrize("data,message", [
    ({"tier_manager": {"nvme_pool": {"aio": {"block_size": 1000}}}}, "block_size"),
    ({"tier_manager": {"cpu_pool": {"size": "lots"}}}, "cpu_pool.size"),
    ({"tier_manager": {"nvme_pool": {"paths": []}}}, "paths"),
    ({"tier_manager": {"nvme_pool": {"aio": {"thread_count": 0}}}}, "thread_count"),
    ({"tier_manager": {"cpu_pool": {"keep_empty_seconds": -1}}}, "keep_empty_seconds"),
    ({"tier_manager": {"nvme_pool": {"size": 1000}}}, "nvme_pool.size"),
    ({"tier_manager": {"shutdown_grace_seconds": -1}}, r"tier_manager\.shutdown_grace_seconds"),
    ({"scheduler": {"shutdown_grace_seconds": -5}}, r"scheduler\.shutdown_grace_seconds"),
])
def test_bad_values_name_the_setting(data, message):
    with pytest.raises(ConfigError, match=message):
        load_config(data)


def test_json_file_is_loaded(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"tier_manager": {"cpu_pool": {"size": "64MiB"}}}))
    assert load_config(path).tier_manager.cpu_pool.size == 64 * MiB
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path / "bad.json")


DEEPSPEED_NVME = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                              "weight_decay": 0.1}},
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                          "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 0},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                              "buffer_count": 4, "fast_init": False},
        "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
        "stage3_prefetch_bucket_size": 5e8, "stage3_param_persistence_threshold": 1e6,
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "aio": {"block_size": 1048576, "queue_depth": 32, "thread_count": 4, "single_submit": False,
            "overlap_events": True},
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
}


def test_a_deepspeed_zero_infinity_config_is_accepted_as_is(caplog):
    with caplog.at_level(logging.INFO, logger="tierstack.deepspeed_config"):
        config = load_config(DEEPSPEED_NVME)
    train, tm = config.train, config.tier_manager
    assert (train.micro_batch_size, train.gradient_accumulation_steps) == (8, 2)
    assert train.precision == "bf16" and train.gradient_clipping == 1.0
    assert train.params.device == "nvme" and train.params.max_in_cpu == 0
    assert (train.params.buffer_count, train.params.buffer_size) == (5, 100_000_000)
    assert train.optimizer_state.device == "nvme"
    # Keys whose job tierstack does itself are accepted and named once in the log.
    decided = caplog.text.split("decided by tierstack instead: ")[1]
    for key in ("offload_param.pin_memory", "offload_optimizer.pin_memory",
                "offload_optimizer.buffer_count", "offload_optimizer.fast_init", "overlap_comm"):
        assert f"zero_optimization.{key}" in decided, key
    assert train.optimizer.lr == 3e-4 and train.optimizer.betas == [0.9, 0.95]
    assert tm.nvme_pool.paths == ["/local_nvme"]
    # thread_count is honoured as written (DeepSpeed 0.19.8 ignored it).
    assert (tm.nvme_pool.aio.queue_depth, tm.nvme_pool.aio.thread_count) == (32, 4)


@pytest.mark.parametrize("change,message", [
    (lambda d: d["zero_optimization"].update(stage=4),
     "zero_optimization.stage: expected 0, 1, 2 or 3, got 4"),
    (lambda d: d["zero_optimization"].update(stage="2"),
     r"zero_optimization.stage: expected 0, 1, 2 or 3, got '2' \(str\); write 2 without quotes"),
    (lambda d: d.update(fp16={"enabled": True}), "bf16.enabled and fp16.enabled"),
    (lambda d: d["zero_optimization"]["offload_param"].pop("nvme_path"),
     "offload_param.device is 'nvme' but zero_optimization.offload_param.nvme_path is missing"),
    (lambda d: d.update(train_batch_size=17), "train_batch_size 17"),
    (lambda d: d["zero_optimization"].update(stage3_magic=1), "unknown DeepSpeed key zero_optimization.stage3_magic"),
    (lambda d: d["aio"].update(use_gds=True), "aio.use_gds"),
    (lambda d: d.update(scheduler={"type": "LRRangeTest"}), "scheduler.type LRRangeTest"),
    (lambda d: d["optimizer"]["params"].update(amsgrad=True), "optimizer.params.amsgrad true is not supported"),
    (lambda d: d["optimizer"]["params"].update(maximize=True), "optimizer.params.maximize true is not supported"),
    (lambda d: d["zero_optimization"]["offload_param"].update(device="tape"), "zero_optimization.offload_param.device: 'tape'"),
])
def test_bad_or_contradictory_deepspeed_keys_are_named(change, message):
    import copy
    data = copy.deepcopy(DEEPSPEED_NVME)
    change(data)
    with pytest.raises(ConfigError, match=message):
        load_config(data)


def test_deepspeed_partition_activations_is_train_activations_partition():
    import copy
    data = copy.deepcopy(DEEPSPEED_NVME)
    data["activation_checkpointing"] = {"partition_activations": True, "cpu_checkpointing": True}
    activations = load_config(data).train.activations
    assert (activations.policy, activations.partition) == ("cpu", True)
    data["activation_checkpointing"] = {"partition_activations": "yes"}
    with pytest.raises(ConfigError, match="^activation_checkpointing.partition_activations: "
                                          "expected true or false"):
        load_config(data)
    assert load_config(DEEPSPEED_NVME).train.activations.partition is False
    with pytest.raises(ConfigError, match=r"^train.activations.partition .*policy 'recompute'"):
        load_config({"train": {"activations": {"policy": "recompute", "partition": True}}})


def test_amsgrad_and_maximize_false_are_plain_adamw():
    import copy
    data = copy.deepcopy(DEEPSPEED_NVME)
    data["optimizer"]["params"].update(amsgrad=False, maximize=False)
    assert load_config(data).train.optimizer == load_config(DEEPSPEED_NVME).train.optimizer


def test_module_tier_overrides_resolve_by_specificity():
    from tierstack.module_tiers import ModuleTiers
    tiers = ModuleTiers({"model.layers[0-2]": "cpu", "model.layers[3-]": "nvme",
                         "model.layers[5].mlp": "gpu", "model.embed_tokens": "gpu",
                         "*.norm": "gpu"})
    assert tiers.tier_for("model.layers.0") == "cpu"
    assert tiers.tier_for("model.layers.2.self_attn.q_proj") == "cpu"
    assert tiers.tier_for("model.layers.3") == "nvme"
    assert tiers.tier_for("model.layers.41.mlp") == "nvme"
    assert tiers.tier_for("model.layers.5.mlp.up_proj") == "gpu"  # deeper pattern wins
    assert tiers.tier_for("model.embed_tokens") == "gpu"
    assert tiers.tier_for("model.norm") == "gpu"
    assert tiers.tier_for("lm_head") is None


@pytest.mark.parametrize("overrides,message", [
    ({"model.layers[2-1]": "cpu"}, "is empty"),
    ({"model.layers[x]": "cpu"}, "cannot read module pattern"),
    ({"model.layers": "tape"}, "tier 'tape'"),
])
def test_bad_overrides_name_the_pattern(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"train": {"tier_overrides": overrides}})


def test_equally_specific_overrides_that_disagree_are_an_error():
    from tierstack.module_tiers import ModuleTiers
    tiers = ModuleTiers({"model.layers[0-4]": "cpu", "model.layers[3-]": "nvme"})
    assert tiers.tier_for("model.layers.1") == "cpu"
    with pytest.raises(ConfigError, match="both apply to module 'model.layers.3'"):
        tiers.tier_for("model.layers.3")


def test_tierstack_own_train_section():
    config = load_config({"train": {"precision": "fp32", "device_budget": "2GiB",
                                    "params": {"device": "cpu"},
                                    "tier_overrides": {"model.layers[3-]": "nvme"}}})
    assert config.train.device_budget == 2 << 30 and config.train.params.device == "cpu"
    with pytest.raises(ConfigError, match="unknown config key train.precison"):
        load_config({"train": {"precison": "fp32"}})


def test_config_dict_round_trips_through_the_loader():
    from tierstack.config import config_dict
    config = load_config(DEEPSPEED_NVME)
    assert load_config(config_dict(config)) == config


@pytest.mark.parametrize("section,key", [
    ("params", "pin_memory"), ("optimizer_state", "pin_memory"),
    ("optimizer_state", "buffer_count"), ("optimizer_state", "buffer_size"),
])
def test_settings_tierstack_has_no_use_for_are_not_in_its_own_format(section, key):
    """The CPU pool is always page-locked and the daemon's AdamW pipelines two blocks: a
    field for either would be parsed and never read. (DeepSpeed files may still carry them.)"""
    with pytest.raises(ConfigError, match=rf"unknown config key train\.{section}\.{key}"):
        load_config({"train": {section: {key: 1}}})


def test_offload_optimizer_keys_deepspeed_does_not_have_are_unknown():
    import copy
    data = copy.deepcopy(DEEPSPEED_NVME)
    data["zero_optimization"]["offload_optimizer"]["max_in_cpu"] = 0  # offload_param's key
    with pytest.raises(ConfigError,
                       match="unknown DeepSpeed key zero_optimization.offload_optimizer.max_in_cpu"):
        load_config(data)


@pytest.mark.parametrize("device,max_in_cpu,tier", [
    ("none", 0, "gpu"), ("cpu", 0, "cpu"), ("nvme", 0, "nvme"), ("nvme", 1, "auto"),
])
def test_an_offload_device_names_a_tier(device, max_in_cpu, tier):
    train = load_config({"train": {"params": {"device": device, "max_in_cpu": max_in_cpu},
                                   "optimizer_state": {"device": device, "max_in_cpu": max_in_cpu}}}).train
    assert train.params.tier() == tier and train.optimizer_state.tier() == tier


def test_the_device_budget_defaults_to_three_layers_and_is_bytes_when_given():
    assert load_config().train.device_budget_bytes(layer_bytes=1000) == 3000
    assert load_config({"train": {"device_budget": "5MiB"}}).train.device_budget_bytes(1000) == 5 * MiB


def test_a_deepspeed_train_batch_size_without_a_micro_batch_gives_the_micro_batch():
    data = {"zero_optimization": {"stage": 3}, "train_batch_size": 12, "gradient_accumulation_steps": 3}
    train = load_config(data).train
    assert (train.micro_batch_size, train.gradient_accumulation_steps) == (4, 3)


@pytest.mark.parametrize("world,given,want", [
    (1, {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}, (2, 4)),  # accumulation derived
    (1, {"train_batch_size": 8}, (8, 1)),
    (2, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, (2, 4)),  # per rank, as DeepSpeed
    (2, {"train_batch_size": 16, "gradient_accumulation_steps": 2}, (4, 2)),
    (2, {"train_batch_size": 8}, (4, 1)),
    (2, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, (4, 2)),
])
def test_deepspeeds_batch_keys_give_the_third_from_any_two_over_the_ranks(monkeypatch, world, given, want):
    """train_batch_size = micro x accumulation x WORLD_SIZE, solved for what is missing."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    train = load_config({"zero_optimization": {"stage": 3}, **given}).train
    assert (train.micro_batch_size, train.gradient_accumulation_steps) == want


@pytest.mark.parametrize("world,given,message", [
    (1, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     r"^train_batch_size 16 is not .*\(4 x 2 = 8\); give two of the three"),
    (2, {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     r"^train_batch_size 8 is not .* x 2 ranks \(4 x 2 x 2 = 16\)"),
    (1, {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 4},
     r"^train_batch_size 6 is not a multiple of train_micro_batch_size_per_gpu 4; make it one"),
    (4, {"train_batch_size": 2}, r"^train_batch_size 2 is not a multiple of gradient_accumulation_steps 1 x 4 ranks"),
])
def test_deepspeeds_batch_keys_that_disagree_are_refused_in_one_line(monkeypatch, world, given, message):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError, match=message):
        load_config({"zero_optimization": {"stage": 3}, **given})


def test_a_zero_offload_deepspeed_config_loads():
    """Optimizer state offloaded, parameters not (ZeRO-Offload): loads as is; the engine
    says what it does with it (tests/worker/test_engine_tiers.py)."""
    train = load_config({"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "cpu", "pin_memory": True, "buffer_count": 4}}}).train
    # No offload_param: no constraint on the parameters (the budgets place them); the
    # optimizer state is pinned to the host, so no block moves to the device for good.
    assert (train.params.device, train.optimizer_state.device) == ("auto", "cpu")


def test_buffer_size_limits_only_when_stated():
    """Not stated (either format): 0, no limit; stated: kept; negative: refused."""
    assert load_config({}).train.params.buffer_size == 0
    ds = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    assert load_config(ds).train.params.buffer_size == 0
    ds["zero_optimization"]["offload_param"]["buffer_size"] = 5e7
    assert load_config(ds).train.params.buffer_size == 50_000_000
    with pytest.raises(ConfigError, match=r"buffer_size must be 0 \(no limit\) or positive, got -1"):
        load_config({"train": {"params": {"buffer_size": -1}}})


@pytest.mark.parametrize("change,message", [
    (lambda d: d["zero_optimization"].update(stage="3"),
     r"^zero_optimization.stage: expected 0, 1, 2 or 3, got '3' \(str\); write 3 without quotes$"),
    (lambda d: d["zero_optimization"].update(offload_param="nvme"),
     r"^zero_optimization.offload_param: expected an object such as \{\"device\": \"nvme\""),
    (lambda d: d.update(train_batch_size="auto"),
     r'^train_batch_size: "auto" is the Hugging Face Trainer\'s placeholder.* write a value$'),
    (lambda d: d["zero_optimization"].update(offlaod_param={}),
     r"^unknown DeepSpeed key zero_optimization.offlaod_param; did you mean zero_optimization.offload_param\?$"),
    (lambda d: d["aio"].update(queue_dept=8), r"did you mean aio.queue_depth\?$"),
    (lambda d: d["aio"].update(use_gds=True), r"^aio.use_gds: GPUDirect Storage is not supported .* set it to false"),
])
def test_bad_deepspeed_input_is_one_line_naming_the_key_and_the_fix(change, message):
    import copy
    data = copy.deepcopy(DEEPSPEED_NVME)
    change(data)
    with pytest.raises(ConfigError, match=message) as err:
        load_config(data)
    assert "\n" not in str(err.value) and "stage is 3" not in str(err.value)


def test_an_unknown_key_suggests_the_nearest_known_one():
    with pytest.raises(ConfigError, match=r"unknown config key tier_manager.cpu_pol; did you mean "
                                          r"tier_manager.cpu_pool\?"):
        load_config({"tier_manager": {"cpu_pol": {}}})
    with pytest.raises(ConfigError, match="known keys here: "):  # nothing close: the list
        load_config({"tier_manager": {"zzz": 1}})


def test_a_deepspeed_file_may_say_use_gds_false_and_carry_tierstack_budgets():
    import copy
    data = copy.deepcopy(DEEPSPEED_NVME)
    data["aio"]["use_gds"] = False
    data["budgets"] = {"host": "5GiB", "nvme": "200GiB"}
    data["device_budget"] = "3GiB"
    config = load_config(data)
    assert config.budgets.host == 5 * GiB and config.train.device_budget == 3 * GiB
    assert config.tier_manager.nvme_pool.size == 200 * GiB  # the NVMe budget caps the pool
    assert config.tier_manager.cpu_pool.size == 4 * GiB  # host less HOST_OVERHEAD
    assert config.tier_manager.nvme_pool.paths == ["/local_nvme"]  # nvme_path honoured


def test_fp16_loss_scaling_and_a_schedule_in_tierstacks_own_format():
    config = load_config({"train": {
        "precision": "fp16",
        "fp16": {"loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 50,
                 "hysteresis": 3, "consecutive_hysteresis": True, "min_loss_scale": 0.5},
        "lr_schedule": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}})
    fp16 = config.train.fp16
    assert (fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window) == (0.0, 12, 50)
    assert (fp16.hysteresis, fp16.consecutive_hysteresis, fp16.min_loss_scale) == (3, True, 0.5)
    assert config.train.precision == "fp16"
    assert config.train.lr_schedule.params == {"warmup_num_steps": 10}
    assert load_config().train.lr_schedule.type == "none"  # no schedule unless asked
    from tierstack.config import config_dict
    assert load_config(config_dict(config)) == config


@pytest.mark.parametrize("fp16,message", [
    ({"loss_scale": -1}, r"^train.fp16.loss_scale must be 0 \(dynamic\) or a positive static scale"),
    ({"initial_scale_power": 65}, r"^train.fp16.initial_scale_power must be between 0 and 64"),
    ({"initial_scale_power": 16.5}, r"^train.fp16.initial_scale_power: expected an integer"),
    ({"loss_scale_window": 0}, r"^train.fp16.loss_scale_window must be at least 1, got 0"),
    ({"hysteresis": 0}, r"^train.fp16.hysteresis must be at least 1, got 0"),
    ({"min_loss_scale": 0}, r"^train.fp16.min_loss_scale must be positive"),
    ({"min_loss_scale": 1024, "initial_scale_power": 8},
     r"^train.fp16.min_loss_scale 1024.0 is above the initial scale 2\*\*8"),
    ({"consecutive_hysteresis": 1}, r"^train.fp16.consecutive_hysteresis: expected true or false"),
    ({"los_scale": 0}, r"^unknown config key train.fp16.los_scale; did you mean train.fp16.loss_scale\?"),
])
def test_bad_loss_scaling_is_refused_naming_the_key(fp16, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"train": {"precision": "fp16", "fp16": fp16}})


@pytest.mark.parametrize("data", [
    {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
    {"bf16": {"enabled": True}},
])
def test_a_deepspeed_config_without_zero_optimization_is_deepspeeds_stage_0(data):
    """DeepSpeed's own reading: no zero_optimization section is stage 0; tierstack places
    the state by its budgets (train.params.device 'auto')."""
    config = load_config(data)
    assert config.train.params.device == "auto" and config.train.optimizer_state.device == "none"


@pytest.mark.parametrize("data", [
    {"train_batch_size": 8, "train": {"micro_batch_size": 8}},
    {"zero_optimization": {"stage": 3}, "security": {"token_file": "/x"}},
])
def test_a_config_in_both_formats_at_once_is_refused_in_one_line(data):
    with pytest.raises(ConfigError, match=r"^(train|security) is a section of tierstack's own config "
                                          r"format, and (train_batch_size|zero_optimization) a "
                                          r"DeepSpeed key: write the file in one format") as err:
        load_config(data)
    assert "\n" not in str(err.value)


def test_deepspeeds_bias_correction_true_is_adamw_and_false_is_refused_by_name():
    def adam(**params):
        return {"zero_optimization": {"stage": 3},
                "optimizer": {"type": "Adam", "params": {"lr": 2e-3, "adam_w_mode": True, **params}}}
    assert load_config(adam(bias_correction=True)).train.optimizer.lr == 2e-3
    with pytest.raises(ConfigError, match=r"^optimizer.params.bias_correction false is not supported"):
        load_config(adam(bias_correction=False))


def test_the_ranks_a_caller_names_count_in_train_batch_size_over_world_size(monkeypatch):
    """`tierstack train --ranks 2` loads the config before its ranks exist."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    data = {"zero_optimization": {"stage": 3}, "train_batch_size": 16, "train_micro_batch_size_per_gpu": 8}
    assert load_config(data).train.gradient_accumulation_steps == 2
    assert load_config(data, world_size=2).train.gradient_accumulation_steps == 1


@pytest.mark.parametrize("params,decay", [
    ({"lr": 1e-3}, 0.0),                      # DeepSpeed's CPUAdam / FusedAdam: no decay by default
    ({"lr": 1e-3, "torch_adam": True}, 0.01),  # torch.optim.AdamW's default
    ({"lr": 1e-3, "weight_decay": 0.2}, 0.2),
])
def test_a_deepspeed_optimizer_without_weight_decay_decays_as_deepspeeds_would(params, decay):
    data = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": params}}
    assert load_config(data).train.optimizer.weight_decay == decay
