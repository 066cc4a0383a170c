"""The Hugging Face Trainer's DeepSpeed JSON with "auto" values, filled from HF's own
TrainingArguments as the Trainer fills it (transformers/integrations/deepspeed.py), and
then read by tierstack as written. The expected values are worked out here from
TrainingArguments' fields, not taken from the code under test."""

from __future__ import annotations

import copy
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tierstack.config import load_config
from tierstack.errors import ConfigError
from tierstack.hf_deepspeed import fill_auto

# HF's docs' ZeRO-3 example with CPU offload of parameters and optimizer, as users copy it.
STOCK_ZERO3_OFFLOAD = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                             "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def _training_arguments(tmp_path, **kwargs):
    # TrainingArguments asks accelerate for its device; the Trainer cannot run without it.
    pytest.importorskip("accelerate", reason="transformers' TrainingArguments needs accelerate")
    from transformers import TrainingArguments
    return TrainingArguments(output_dir=str(tmp_path), report_to=[], **kwargs)


def _tiny_llama(hidden: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=4, vocab_size=128))


def test_the_stock_zero3_offload_json_is_filled_as_the_trainer_fills_it(tmp_path):
    args = _training_arguments(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                               learning_rate=3e-4, adam_beta1=0.8, adam_beta2=0.95,
                               adam_epsilon=1e-6, weight_decay=0.1, max_grad_norm=0.5,
                               warmup_steps=0.1)
    stock = copy.deepcopy(STOCK_ZERO3_OFFLOAD)
    filled = fill_auto(stock, args, model=_tiny_llama(64), num_training_steps=50)
    assert stock == STOCK_ZERO3_OFFLOAD  # the caller's dict is left as it was
    assert filled["train_micro_batch_size_per_gpu"] == 4
    assert filled["gradient_accumulation_steps"] == 2
    assert filled["train_batch_size"] == 1 * 4 * 2  # one rank x micro batch x accumulation
    assert filled["gradient_clipping"] == 0.5
    assert filled["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6,
                                             "weight_decay": 0.1}
    # warmup_steps 0.1 is a fraction of the 50 steps: ceil(5.0)
    assert filled["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                                             "warmup_num_steps": 5}
    assert filled["fp16"]["enabled"] is False and filled["bf16"]["enabled"] is False
    zero = filled["zero_optimization"]
    assert zero["reduce_bucket_size"] == 64 * 64
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64) == 3686
    assert zero["stage3_param_persistence_threshold"] == 10 * 64
    untouched = {k: v for k, v in STOCK_ZERO3_OFFLOAD["zero_optimization"].items() if v != "auto"}
    assert {k: zero[k] for k in untouched} == untouched
    # ... and tierstack reads the filled file as written.
    config = load_config(filled)
    train = config.train
    assert (train.micro_batch_size, train.gradient_accumulation_steps) == (4, 2)
    assert train.precision == "fp32" and train.gradient_clipping == 0.5
    assert (train.optimizer.lr, train.optimizer.betas) == (3e-4, [0.8, 0.95])
    assert (train.params.device, train.optimizer_state.device) == ("cpu", "cpu")
    assert train.lr_schedule.type == "WarmupLR"
    assert train.lr_schedule.params["warmup_num_steps"] == 5


@pytest.mark.parametrize("warmup_steps,expected", [(7, 7), (0, 1), (0.25, 25)])
def test_warmup_decay_lr_takes_the_runs_steps_and_warmup(tmp_path, warmup_steps, expected):
    args = _training_arguments(tmp_path, learning_rate=1e-3, warmup_steps=warmup_steps)
    stock = copy.deepcopy(STOCK_ZERO3_OFFLOAD)
    stock["scheduler"] = {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto"}}
    params = fill_auto(stock, args, _tiny_llama(), num_training_steps=100)["scheduler"]["params"]
    # DeepSpeed refuses 0 warmup steps, so HF fills at least 1.
    assert params == {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": expected,
                      "total_num_steps": 100}


def test_precision_follows_training_arguments(tmp_path):
    filled = fill_auto(STOCK_ZERO3_OFFLOAD, _training_arguments(tmp_path, fp16=True), _tiny_llama(), 10)
    assert (filled["fp16"]["enabled"], filled["bf16"]["enabled"]) == (True, False)
    config = load_config(filled)
    assert config.train.precision == "fp16"
    assert (config.train.fp16.loss_scale, config.train.fp16.initial_scale_power) == (0.0, 16)
    filled = fill_auto(STOCK_ZERO3_OFFLOAD, _training_arguments(tmp_path, bf16=True, use_cpu=True),
                       _tiny_llama(), 10)
    assert (filled["fp16"]["enabled"], filled["bf16"]["enabled"]) == (False, True)
    assert load_config(filled).train.precision == "bf16"


def test_values_written_must_agree_with_the_training_arguments(tmp_path):
    args = _training_arguments(tmp_path, learning_rate=3e-4, gradient_accumulation_steps=2)
    stock = copy.deepcopy(STOCK_ZERO3_OFFLOAD)
    stock["optimizer"]["params"]["lr"] = 0.1
    stock["gradient_accumulation_steps"] = 4
    stock["train_batch_size"] = 8  # 1 x 8 x 2 = 16 from the arguments
    with pytest.raises(ConfigError) as err:
        fill_auto(stock, args, _tiny_llama(), 10)
    message = str(err.value)
    assert "\n" not in message and message.startswith("the DeepSpeed config disagrees")
    for part in ("gradient_accumulation_steps=4 vs gradient_accumulation_steps=2",
                 "optimizer.params.lr=0.1 vs learning_rate=0.0003", "train_batch_size=8 vs"):
        assert part in message, part
    # Values that agree are fine, and a batch the Trainer may shrink itself is not checked.
    stock = copy.deepcopy(STOCK_ZERO3_OFFLOAD)
    stock.update(train_micro_batch_size_per_gpu=32, train_batch_size=64, gradient_clipping=1.0)
    args = _training_arguments(tmp_path, auto_find_batch_size=True, max_grad_norm=1.0)
    assert fill_auto(stock, args, _tiny_llama(), 10)["train_micro_batch_size_per_gpu"] == 32


def test_save_on_each_node_asks_for_node_local_checkpoints_which_tierstack_refuses(tmp_path):
    filled = fill_auto(STOCK_ZERO3_OFFLOAD, _training_arguments(tmp_path, save_on_each_node=True),
                       _tiny_llama(), 10)
    assert filled["checkpoint"] == {"use_node_local_storage": True}
    with pytest.raises(ConfigError, match=r"^checkpoint.use_node_local_storage: rank 0 writes"):
        load_config(filled)


# Duck-typed arguments: what fill_auto reads of TrainingArguments, with their defaults.
def _args(**changes):
    fields = dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, max_grad_norm=1.0,
                  learning_rate=5e-5, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                  weight_decay=0.0, warmup_steps=0, fp16=False, bf16=False, world_size=1)
    return SimpleNamespace(**{**fields, **changes})


def test_a_key_that_cannot_be_filled_is_named_with_what_it_needs():
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=32))
    with pytest.raises(ConfigError, match=r'^zero_optimization.reduce_bucket_size: "auto" cannot be '
                                          r"filled: it is sized from the model's hidden size: pass "
                                          r"the model to fill_auto"):
        fill_auto(STOCK_ZERO3_OFFLOAD, _args(), model=None, num_training_steps=10)
    with pytest.raises(ConfigError, match=r"^zero_optimization.reduce_bucket_size: .*neither "
                                          r"hidden_size nor hidden_sizes"):
        fill_auto(STOCK_ZERO3_OFFLOAD, _args(), model=torch.nn.Linear(2, 2), num_training_steps=10)
    with pytest.raises(ConfigError, match=r'^scheduler.params.warmup_num_steps: "auto" cannot be '
                                          r"filled: .*pass num_training_steps"):
        fill_auto(STOCK_ZERO3_OFFLOAD, _args(), model=model)
    stock = copy.deepcopy(STOCK_ZERO3_OFFLOAD)
    stock["scheduler"] = {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto",
                                                              "cos_min_ratio": "auto"}}
    with pytest.raises(ConfigError, match=r'^scheduler.params.cos_min_ratio: "auto" cannot be '
                                          r"filled: Hugging Face fills no TrainingArguments value"):
        fill_auto(stock, _args(), model=model, num_training_steps=10)


def test_hidden_size_as_hugging_face_finds_it():
    def sizes(config):
        zero = fill_auto(STOCK_ZERO3_OFFLOAD, _args(), SimpleNamespace(config=config), 10)["zero_optimization"]
        return zero["reduce_bucket_size"], zero["stage3_param_persistence_threshold"]

    assert sizes(SimpleNamespace(hidden_sizes=[16, 48, 32])) == (48 * 48, 480)  # the largest
    assert sizes(SimpleNamespace(text_config=SimpleNamespace(hidden_size=24))) == (24 * 24, 240)


def test_the_batch_counts_every_rank():
    assert fill_auto(STOCK_ZERO3_OFFLOAD, _args(world_size=2, gradient_accumulation_steps=3),
                     SimpleNamespace(config=SimpleNamespace(hidden_size=8)), 10)["train_batch_size"] == 2 * 8 * 3


def test_without_accelerate_the_launchers_world_size_counts(monkeypatch):
    class Arguments(SimpleNamespace):
        @property
        def world_size(self):
            raise ImportError("requires accelerate")

    monkeypatch.setenv("WORLD_SIZE", "3")
    args = Arguments(**{k: v for k, v in vars(_args()).items() if k != "world_size"})
    filled = fill_auto(STOCK_ZERO3_OFFLOAD, args, SimpleNamespace(config=SimpleNamespace(hidden_size=8)), 10)
    assert filled["train_batch_size"] == 3 * 8


def test_accelerates_default_fills_the_16bit_save_flag(monkeypatch):
    stock = copy.deepcopy(STOCK_ZERO3_OFFLOAD)
    stock["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = "auto"
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=8))
    zero = fill_auto(stock, _args(), model, 10)["zero_optimization"]
    assert zero["stage3_gather_16bit_weights_on_model_save"] is False
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "true")
    zero = fill_auto(stock, _args(), model, 10)["zero_optimization"]
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True


def test_importing_tierstack_modules_does_not_import_transformers():
    code = ("import sys, tierstack.hf_deepspeed, tierstack.config, tierstack.deepspeed_config, "
            "tierstack.lr_schedules; print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
