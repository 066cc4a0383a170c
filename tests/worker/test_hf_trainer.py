"""Hugging Face's Trainer through tierstack (worker/api/hf_trainer.py), against transformers' own
Trainer without DeepSpeed on the same seed and data: a real tier manager, real offloaded
blocks, a tiny LlamaForCausalLM built from its config (no downloads), fp32, no dropout."""

from __future__ import annotations

import ast
import copy
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

from safetensors.torch import load_file  # noqa: E402  (transformers brings it)

from tests.test_hf_deepspeed import STOCK_ZERO3_OFFLOAD  # noqa: E402
from tierstack.errors import ConfigError, InvalidArgumentError  # noqa: E402
from tierstack.lr_schedules import WarmupLR  # noqa: E402
from tierstack.worker.api import hf_trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_trainer_clm.py"
STOCK_JSON = ROOT / "examples" / "ds_config_zero3.json"
STOCK_ZERO2_JSON = ROOT / "examples" / "ds_config_zero2.json"
VOCAB, SEQ = 97, 12


def _model(seed: int = 0, dropout: float = 0.0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attention_dropout=dropout))


class _Tokens(torch.utils.data.Dataset):
    """Random token rows, inputs and labels alike (the Trainer's causal-LM loss shifts them)."""

    def __init__(self, rows: int, seed: int) -> None:
        self.ids = torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _Logs(transformers.TrainerCallback):
    """Every dict the Trainer logs."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        self.logs.append(dict(logs))

    def values(self, key: str) -> list[float]:
        return [log[key] for log in self.logs if key in log]


RUN = dict(report_to=[], use_cpu=True, disable_tqdm=True, seed=0, per_device_train_batch_size=4,
           gradient_accumulation_steps=2, max_steps=6, learning_rate=3e-3, logging_steps=1,
           save_strategy="no")


def _train(trainer_cls, args, model, eval_dataset=None, rows=48, **kwargs):
    """(trainer, logs) after trainer.train() on `rows` rows."""
    logs = _Logs()
    trainer = trainer_cls(model=model, args=args, train_dataset=_Tokens(rows, 1),
                          eval_dataset=eval_dataset, callbacks=[logs], **kwargs)
    trainer.train()
    return trainer, logs


@pytest.fixture
def node_tier_manager(shared_daemon, monkeypatch):
    """The node's tier manager, found as a user's script finds it ($TIERSTACK_TIER_MANAGER)."""
    monkeypatch.setenv("TIERSTACK_TIER_MANAGER", shared_daemon.address)
    return shared_daemon


def _assert_same(ours: list[float], theirs: list[float], rtol: float = 1e-5) -> None:
    assert len(ours) == len(theirs) and ours
    torch.testing.assert_close(torch.tensor(ours, dtype=torch.float64),
                               torch.tensor(theirs, dtype=torch.float64), rtol=rtol, atol=0)


def test_a_trainer_script_trains_as_transformers_own_trainer_and_saves_a_model_from_pretrained_loads(
        node_tier_manager, tmp_path):
    """No DeepSpeed JSON: HF's AdamW with no decay on norms, warmup + linear decay, gradient
    accumulation (11 micro-batches an epoch in windows of 3: the last one short), clipping,
    label smoothing, eval and checkpoints during training, the best checkpoint loaded at the
    end: the same losses, gradient norms, learning rates, eval losses and metrics as
    transformers' Trainer, and a saved model with its weights."""
    knobs = dict(RUN, max_steps=-1, num_train_epochs=2, gradient_accumulation_steps=3,
                 warmup_steps=2, lr_scheduler_type="linear", weight_decay=0.1, max_grad_norm=0.5,
                 label_smoothing_factor=0.1, eval_strategy="steps", eval_steps=2,
                 save_strategy="steps", save_steps=2, save_total_limit=2,
                 # "best" is the highest eval loss: an early checkpoint, loaded at the end
                 load_best_model_at_end=True, metric_for_best_model="eval_loss",
                 greater_is_better=True)
    evaluation = _Tokens(8, 2)
    plain, expected = _train(transformers.Trainer, transformers.TrainingArguments(
        output_dir=str(tmp_path / "plain"), **knobs), _model(), evaluation, rows=44)
    model = _model()
    names = {id(p): n for n, p in model.named_parameters()}
    trainer, logs = _train(hf_trainer.Trainer, hf_trainer.TrainingArguments(
        output_dir=str(tmp_path / "ours"), **knobs), model, evaluation, rows=44)
    try:
        assert trainer.state.global_step == 8
        best = Path(trainer.state.best_model_checkpoint).name
        assert best == Path(plain.state.best_model_checkpoint).name != "checkpoint-8"
        for key in ("loss", "grad_norm", "eval_loss", "train_loss"):
            _assert_same(logs.values(key), expected.values(key))
        assert logs.values("learning_rate") == expected.values("learning_rate")
        assert max(logs.values("grad_norm")) > 0.5  # clipping was at work
        assert logs.values("total_flos") == expected.values("total_flos")
        assert logs.values("train_samples_per_second")[0] > 0
        _assert_same([trainer.evaluate()["eval_loss"]], [plain.evaluate()["eval_loss"]])
        # HF's param groups, followed by the tiers' AdamW: no weight decay on the norms.
        no_decay = {names[id(p)] for g in trainer.optimizer.param_groups if g["weight_decay"] == 0
                    for p in g["params"]}
        assert no_decay == {n for n in names.values() if "norm" in n}
        assert {g["weight_decay"] for g in trainer.optimizer.param_groups} == {0.0, 0.1}

        trainer.save_model(str(tmp_path / "saved"))
        reloaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "saved"))
        trained = plain.model.state_dict()
        assert reloaded.state_dict().keys() == trained.keys()
        for name, tensor in reloaded.state_dict().items():
            torch.testing.assert_close(tensor, trained[name], rtol=1e-5, atol=1e-6, msg=name)
    finally:
        trainer.end()


def test_a_checkpoint_saved_mid_run_resumes_bit_for_bit(node_tier_manager, tmp_path):
    """save_steps=3 of 6, dropout on: a new Trainer (other weights) resumed from checkpoint-3
    logs the same losses, norms and lrs bit for bit, and ends with the same weights."""
    knobs = dict(RUN, warmup_steps=2, weight_decay=0.1, max_grad_norm=0.5, save_strategy="steps",
                 save_steps=3)
    first, logs = _train(hf_trainer.Trainer, hf_trainer.TrainingArguments(
        output_dir=str(tmp_path / "a"), **knobs), _model(dropout=0.2))
    first.end()
    checkpoint = tmp_path / "a" / "checkpoint-3"
    assert {"latest", "global_step3", "model.safetensors.index.json", "config.json",
            "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= set(os.listdir(checkpoint))
    assert (checkpoint / "latest").read_text() == "global_step3"

    resumed_logs = _Logs()
    resumed = hf_trainer.Trainer(model=_model(seed=1, dropout=0.2), args=hf_trainer.TrainingArguments(
        output_dir=str(tmp_path / "b"), **knobs), train_dataset=_Tokens(48, 1), callbacks=[resumed_logs])
    try:
        resumed.train(resume_from_checkpoint=str(checkpoint))
        for key in ("loss", "grad_norm", "learning_rate"):
            assert resumed_logs.values(key) == logs.values(key)[3:]
        ends = [load_file(tmp_path / run / "checkpoint-6" / "model-block-00001.safetensors")
                for run in ("a", "b")]
        assert all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])

        # A checkpoint with the weights only (save_only_model=True) cannot resume training.
        weights_only = tmp_path / "weights-only"
        shutil.copytree(checkpoint, weights_only, ignore=shutil.ignore_patterns("latest", "global_step*"))
        with pytest.raises(InvalidArgumentError, match="no tierstack training state"):
            resumed.train(resume_from_checkpoint=str(weights_only))
    finally:
        resumed.end()


def test_the_stock_auto_json_trains_unchanged_as_deepspeed_would(node_tier_manager, tmp_path):
    """TrainingArguments(deepspeed=<HF's stock ZeRO-3 offload JSON, "auto" values and all>):
    DeepSpeed's AdamW over every parameter and its WarmupLR, filled from the arguments as
    HF fills them; the same losses as transformers' Trainer given that optimizer and schedule."""
    assert json.loads(STOCK_JSON.read_text()) == STOCK_ZERO3_OFFLOAD
    knobs = dict(RUN, warmup_steps=3, weight_decay=0.1, max_grad_norm=0.5, adam_beta2=0.95)
    reference_model = _model()
    optimizer = torch.optim.AdamW(reference_model.parameters(), lr=3e-3, betas=(0.9, 0.95),
                                  eps=1e-8, weight_decay=0.1)
    schedule = WarmupLR(optimizer, warmup_min_lr=0, warmup_max_lr=3e-3, warmup_num_steps=3)
    _, expected = _train(transformers.Trainer, transformers.TrainingArguments(
        output_dir=str(tmp_path / "plain"), **knobs), reference_model, optimizers=(optimizer, schedule))
    trainer, logs = _train(hf_trainer.Trainer, hf_trainer.TrainingArguments(
        output_dir=str(tmp_path / "ours"), deepspeed=str(STOCK_JSON), **knobs), _model())
    try:
        _assert_same(logs.values("loss"), expected.values("loss"))
        _assert_same(logs.values("learning_rate"), expected.values("learning_rate"), rtol=1e-12)
        engine = trainer.model_wrapped
        assert engine.gradient_accumulation_steps() == 2 and engine.gradient_clipping() == 0.5
        assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
        assert isinstance(trainer.lr_scheduler.schedule, WarmupLR)
        assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.1]
    finally:
        trainer.end()


def test_transformers_own_arguments_with_the_stock_zero2_json_and_gradient_checkpointing_train_as_its_trainer(
        node_tier_manager, tmp_path):
    """transformers' own TrainingArguments (no DeepSpeed installed), HF's stock ZeRO-2 JSON
    (offload_optimizer cpu, "auto" values) and gradient_checkpointing=True: the blocks'
    parameters on the device and their optimizer state in the tier manager (ZeRO-Offload),
    recomputed by the engine (the model's own checkpointing turned off again); the same
    losses and learning rates as transformers' Trainer with checkpointing, DeepSpeed's AdamW
    and WarmupLR."""
    assert json.loads(STOCK_ZERO2_JSON.read_text())["zero_optimization"]["stage"] == 2
    knobs = dict(RUN, warmup_steps=3, weight_decay=0.1, max_grad_norm=0.5, adam_beta2=0.95,
                 gradient_checkpointing=True)
    reference_model = _model()
    optimizer = torch.optim.AdamW(reference_model.parameters(), lr=3e-3, betas=(0.9, 0.95),
                                  eps=1e-8, weight_decay=0.1)
    schedule = WarmupLR(optimizer, warmup_min_lr=0, warmup_max_lr=3e-3, warmup_num_steps=3)
    plain, expected = _train(transformers.Trainer, transformers.TrainingArguments(
        output_dir=str(tmp_path / "plain"), **knobs), reference_model, optimizers=(optimizer, schedule))
    assert plain.model.is_activation_checkpointing  # transformers' own run checkpointed
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "ours"),
                                          deepspeed=str(STOCK_ZERO2_JSON), **knobs)
    assert args.deepspeed == str(STOCK_ZERO2_JSON) and args.deepspeed_plugin is None
    trainer, logs = _train(hf_trainer.Trainer, args, _model())
    try:
        _assert_same(logs.values("loss"), expected.values("loss"))
        _assert_same(logs.values("learning_rate"), expected.values("learning_rate"), rtol=1e-12)
        core = trainer.model_wrapped.core
        assert core.tiers == core.state_tiers == ["cpu", "cpu"]  # ZeRO-Offload's placement
        assert core.activation_policy == "recompute"
        assert not trainer.model.is_activation_checkpointing  # the engine's, not the model's
    finally:
        trainer.end()


def test_a_directory_the_run_cannot_make_is_named_by_the_jsons_key(tmp_path, monkeypatch):
    """The error, one line, names the key the user wrote (the JSON's nvme_path), not the
    tier manager's setting it became."""
    monkeypatch.setenv("TIERSTACK_TIER_MANAGER", f"unix:{tmp_path}/nobody-here.sock")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    (tmp_path / "a-file").write_text("")
    ds = {"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "nvme", "nvme_path": str(tmp_path / "a-file")}}}
    trainer = hf_trainer.Trainer(model=_model(), args=transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), deepspeed=ds, **RUN), train_dataset=_Tokens(8, 1))
    with pytest.raises(ConfigError) as info:
        trainer.train()
    assert str(info.value).startswith(
        f"zero_optimization.offload_optimizer.nvme_path {tmp_path / 'a-file'} is a file, not a "
        f"directory"), str(info.value)
    assert "\n" not in str(info.value) and "nvme_pool" not in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_precision_flags_set_the_engines_precision(node_tier_manager, tmp_path, precision):
    """bf16=True / fp16=True: the engine trains in that precision (fp32 masters; fp16 with
    DeepSpeed's dynamic loss scale) and its losses follow fp32 training's closely."""
    knobs = dict(RUN, max_steps=3, max_grad_norm=1.0)
    _, expected = _train(transformers.Trainer, transformers.TrainingArguments(
        output_dir=str(tmp_path / "plain"), **knobs), _model())
    trainer, logs = _train(hf_trainer.Trainer, hf_trainer.TrainingArguments(
        output_dir=str(tmp_path / "ours"), **{precision: True}, **knobs), _model())
    try:
        engine = trainer.model_wrapped
        assert engine.bfloat16_enabled() == (precision == "bf16")
        assert engine.fp16_enabled() == (precision == "fp16")
        assert engine.loss_scale() == (2.0 ** 16 if precision == "fp16" else 1.0)
        assert trainer.accelerator.mixed_precision == "no"  # no autocast on top of the engine's
        _assert_same(logs.values("loss"), expected.values("loss"), rtol=2e-2)
    finally:
        trainer.end()


def test_an_fp16_overflow_skips_its_step_and_holds_the_schedule(node_tier_manager, tmp_path):
    """fp16 from a loss scale of 2^19: one early step's gradients overflow, so it changes
    nothing, halves the scale (hysteresis 1) and leaves HF's warmup + linear schedule where it
    was; the schedule then runs one step behind, as under DeepSpeed."""
    ds = {"zero_optimization": {"stage": 3},
          "fp16": {"enabled": "auto", "initial_scale_power": 19, "hysteresis": 1}}
    trainer, logs = _train(hf_trainer.Trainer, hf_trainer.TrainingArguments(
        output_dir=str(tmp_path), deepspeed=ds, **dict(
            RUN, gradient_accumulation_steps=1, fp16=True, warmup_steps=3, learning_rate=1e-2)),
        _model())
    try:
        engine = trainer.model_wrapped
        skipped = [i for i, norm in enumerate(logs.values("grad_norm")) if not math.isfinite(norm)]
        assert len(skipped) == engine.skipped_steps == 1 and skipped[0] < 5
        assert engine.fp16_enabled() and engine.global_steps == 6
        assert engine.loss_scale() == 2.0 ** 18
        # Step i runs at HF's linear schedule (warmup 3, 6 steps) after the steps applied before it.
        linear = lambda k: k / 3 if k < 3 else (6 - k) / 3  # noqa: E731
        applied = [i - sum(s < i for s in skipped) for i in range(6)]
        assert logs.values("learning_rate") == pytest.approx([1e-2 * linear(k) for k in applied])
        assert all(math.isfinite(loss) for loss in logs.values("loss"))
    finally:
        trainer.end()


@pytest.mark.parametrize("arguments, trainer_kwargs, named", [
    ({"torch_compile": True}, {}, "TrainingArguments.torch_compile"),
    ({"auto_find_batch_size": True}, {}, "TrainingArguments.auto_find_batch_size"),
    ({"bf16_full_eval": True}, {}, "TrainingArguments.bf16_full_eval"),
    ({"optim": "sgd"}, {}, "TrainingArguments.optim='sgd'"),
    ({"deepspeed": {"train": {"micro_batch_size": 8}}}, {}, "none of DeepSpeed's keys"),
    ({"deepspeed": "/nonexistent/ds.json"}, {}, "file /nonexistent/ds.json does not exist"),
    ({}, {"model_init": lambda: _model()}, "model_init"),
])
def test_what_tierstack_cannot_do_is_refused_in_one_line_naming_it(tmp_path, arguments,
                                                                    trainer_kwargs, named):
    with pytest.raises(ConfigError) as info:
        args = hf_trainer.TrainingArguments(output_dir=str(tmp_path), **dict(RUN, **arguments))
        kwargs = {"model": _model(), **trainer_kwargs}
        if "model_init" in trainer_kwargs:
            del kwargs["model"]
        hf_trainer.Trainer(args=args, train_dataset=_Tokens(8, 1), **kwargs)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_a_json_that_disagrees_with_the_arguments_is_refused_before_any_state_moves(tmp_path):
    stock = copy.deepcopy(STOCK_ZERO3_OFFLOAD)
    stock["gradient_accumulation_steps"] = 4
    args = hf_trainer.TrainingArguments(output_dir=str(tmp_path), deepspeed=stock, **RUN)
    trainer = hf_trainer.Trainer(model=_model(), args=args, train_dataset=_Tokens(8, 1))
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=4 vs gradient_accumulation_steps=2"):
        trainer.train()
    assert trainer.model_wrapped is trainer.model  # no engine was made


def test_with_no_tier_manager_running_the_trainer_starts_one_and_end_stops_it(tmp_path, monkeypatch):
    """evaluate() before train() makes the engine (the same eval loss as transformers'
    Trainer); the tier manager it started keeps its NVMe pool under the JSON's nvme_path,
    in a directory named by the job, until Trainer.end() removes both."""
    monkeypatch.setenv("TIERSTACK_TIER_MANAGER", f"unix:{tmp_path}/nobody-here.sock")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("TIERSTACK_JOB", "hf-trainer-job")
    nvme = tmp_path / "nvme"
    offload = {"device": "nvme", "nvme_path": str(nvme)}
    ds = {"zero_optimization": {"stage": 3, "offload_param": offload, "offload_optimizer": offload},
          "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto"}
    knobs = dict(RUN, max_steps=2)
    plain = transformers.Trainer(model=_model(), args=transformers.TrainingArguments(
        output_dir=str(tmp_path / "plain"), **knobs), eval_dataset=_Tokens(8, 2))
    trainer = hf_trainer.Trainer(model=_model(), args=hf_trainer.TrainingArguments(
        output_dir=str(tmp_path / "ours"), deepspeed=ds, **knobs), train_dataset=_Tokens(16, 1),
        eval_dataset=_Tokens(8, 2))
    try:
        _assert_same([trainer.evaluate()["eval_loss"]], [plain.evaluate()["eval_loss"]])
        assert any((nvme / "hf-trainer-job").iterdir())  # the pool's files
        assert trainer.train().global_step == 2
    finally:
        trainer.end()
    assert not nvme.exists()
    assert not list((tmp_path / "state" / "tierstack" / "runs").glob("*.json"))


@pytest.mark.parametrize("flags", [
    ["--deepspeed", str(STOCK_JSON)],
    ["--deepspeed", str(STOCK_ZERO2_JSON), "--gradient_checkpointing"],
], ids=["zero3", "zero2-gradient-checkpointing"])
def test_the_example_script_runs_as_written_and_cleans_up_at_exit(tmp_path, flags):
    """examples/hf_trainer_clm.py (HfArgumentParser over transformers' own TrainingArguments,
    tierstack's Trainer) with a stock JSON, as its docstring runs it, with no tier manager
    running: it learns, saves a model from_pretrained loads, and its exit (no Trainer.end()
    in the script) stops the tier manager it started and removes its files."""
    job = f"hf-example-{os.getpid()}"
    env = {**os.environ, "TIERSTACK_TIER_MANAGER": f"unix:{tmp_path}/nobody-here.sock",
           "XDG_STATE_HOME": str(tmp_path / "state"), "TIERSTACK_JOB": job}
    out = tmp_path / "clm"
    run = subprocess.run([sys.executable, str(EXAMPLE), "--output_dir", str(out), *flags],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    printed = [ast.literal_eval(line) for line in run.stdout.splitlines() if line.startswith("{")]
    train = [p for p in printed if "train_samples_per_second" in p][-1]  # the script's prints
    evaluation = [p for p in printed if "eval_loss" in p][-1]
    assert float(train["train_samples_per_second"]) > 0
    assert float(evaluation["eval_loss"]) < math.log(256) - 1  # it learned the text's bytes
    assert "Traceback" not in run.stderr, run.stderr[-3000:]  # no "deepspeed not found"
    transformers.LlamaForCausalLM.from_pretrained(str(out))
    from tierstack.config import NvmePoolConfig
    assert not any((Path(p) / job).exists() for p in NvmePoolConfig().paths)
    assert not list((tmp_path / "state" / "tierstack" / "runs").glob("*.json"))
