"""Hugging Face's Trainer, training through tierstack's engine: a Trainer script changes its
import and nothing else.

    from tierstack.worker.hf_trainer import Trainer  # was: from transformers import Trainer

The script keeps transformers' own `TrainingArguments` (and `HfArgumentParser`, as
run_clm does). `TrainingArguments(deepspeed=...)` takes the same DeepSpeed JSON as for
DeepSpeed (the stock ZeRO-2 or ZeRO-3 offload file with its "auto" values), or none:
tierstack's defaults with the arguments' knobs (tierstack/hf_arguments.py says which
config and optimizer a run gets, and what it refuses). transformers sets DeepSpeed up
while it makes the arguments (its __post_init__ wants DeepSpeed installed and hands the
JSON to accelerate's DeepSpeed plugin); importing this module has TrainingArguments read
the JSON for tierstack instead (`_json_read_by_tierstack`, on transformers' class, so its
subclasses and HfArgumentParser get it too): DeepSpeed need not be installed.
`gradient_checkpointing=True` asks the engine to recompute the offloaded blocks'
activations; the model's own checkpointing, which transformers' train() turns on, is turned
off again before the first step (the engine recomputes, once). The Trainer's own loop runs
unchanged — its data loading, loss (and `num_items_in_batch` scaling), gradient
accumulation, logging, evaluation, callbacks, checkpoint rotation and metrics — over
`tierstack.initialize`'s engine in place of the model, the way it runs over DeepSpeed's
engine:

- the engine is made at the first train() or evaluate() (the model's state goes to the
  tiers then; the node's tier manager is used, or one is started for the run);
- each micro-batch's backward is the engine's (the fp16 loss scale, the accumulation
  boundary), and at the boundary the engine steps right after it, clipping inside, as
  DeepSpeed's engine steps inside accelerate's backward; the Trainer's own clipping and
  optimizer.step() then have nothing left to do (its gradient norm is the engine's);
- the learning-rate schedule is stepped by the Trainer as usual, after each step the
  engine applied (not after an fp16 overflow, as DeepSpeed);
- save_model writes safetensors that from_pretrained loads; a checkpoint adds the engine's
  whole training state (worker/engine/checkpoint.py), which resume_from_checkpoint restores, so
  training goes on bit for bit;
- Trainer.end() (or the Trainer's collection, or the interpreter's exit) closes the engine
  and stops the tier manager it started. Until then the trained weights live in the tiers:
  read them with save_model or the model's state_dict() (its values come from the tiers);
  the offloaded blocks' parameter objects hold no values outside zero.GatheredParameters.

The user's guide: docs/guides/hf-trainer.md.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

import torch

from tierstack.errors import ConfigError, InvalidArgumentError, MissingExtraError, TierstackError

try:
    import transformers
    from transformers.trainer_pt_utils import remove_dummy_checkpoint
    from transformers.utils import SAFE_WEIGHTS_NAME, WEIGHTS_NAME
except ImportError as e:  # transformers and accelerate: the [hf] extra
    raise MissingExtraError(f"tierstack's Hugging Face Trainer integration needs transformers>=5 "
                            f"and accelerate: pip install 'tierstack[hf]' ({e})") from None

from tierstack.hf_arguments import (deepspeed_schedule, engine_config, has_optimizer,
                                    has_scheduler, read_deepspeed_json, refuse_unsupported)
from tierstack.lr_schedules import build_schedule
from tierstack.worker.api.initialize import initialize
from tierstack.worker.api.training_engine import TrainingEngine

log = logging.getLogger(__name__)

if int(transformers.__version__.split(".")[0]) < 5:
    raise MissingExtraError(f"tierstack's Trainer integration follows transformers 5's Trainer; this "
                            f"is transformers {transformers.__version__}: pip install 'tierstack[hf]'")


def _json_read_by_tierstack(post_init):
    """transformers.TrainingArguments.__post_init__, with `deepspeed` (a DeepSpeed JSON's
    path, a JSON string or a dict) read by tierstack (args.tierstack_deepspeed) and hidden
    from transformers meanwhile, so that it sets up neither DeepSpeed nor accelerate's
    DeepSpeed plugin; `deepspeed` is then left as the user gave it, as transformers does."""
    @functools.wraps(post_init)
    def __post_init__(self) -> None:
        self.tierstack_deepspeed = read_deepspeed_json(self.deepspeed)
        given, self.deepspeed = self.deepspeed, None
        try:
            post_init(self)
        finally:
            self.deepspeed = given
    __post_init__.reads_json_for_tierstack = True
    return __post_init__


if not getattr(transformers.TrainingArguments.__post_init__, "reads_json_for_tierstack", False):
    transformers.TrainingArguments.__post_init__ = _json_read_by_tierstack(
        transformers.TrainingArguments.__post_init__)

TrainingArguments = transformers.TrainingArguments
"""transformers' own class (its `deepspeed` read by tierstack once this module is imported),
named here too for scripts that import both names from tierstack."""


class Trainer(transformers.Trainer):
    """transformers' Trainer, with tierstack's engine in place of the model (module
    docstring). Every constructor argument is transformers'; `model_init` is refused."""

    def __init__(self, *args, **kwargs) -> None:
        self._engine: TrainingEngine | None = None
        self._parameter_count: int | None = None
        self._closer: weakref.finalize | None = None
        super().__init__(*args, **kwargs)
        # Its own optimizer (args.optim) only when neither `optimizers` nor
        # `optimizer_cls_and_kwargs` gives one and the JSON has none.
        refuse_unsupported(self.args, trainer_optimizer=self.optimizer is None
                           and self.optimizer_cls_and_kwargs is None
                           and not has_optimizer(self._deepspeed))
        if self.optimizer is not None and has_optimizer(self._deepspeed):
            raise ConfigError("Trainer(optimizers=...) and the DeepSpeed JSON's optimizer section "
                              "both give the optimizer; keep one of them")
        if self.lr_scheduler is not None and has_scheduler(self._deepspeed):
            raise ConfigError("Trainer(optimizers=(..., scheduler)) and the DeepSpeed JSON's "
                              "scheduler section both give the schedule; keep one of them")

    @property
    def _deepspeed(self) -> dict | None:
        """The run's DeepSpeed JSON (TrainingArguments.deepspeed), as given."""
        return getattr(self.args, "tierstack_deepspeed", None)

    def _leave_checkpointing_to_the_engine(self) -> None:
        """transformers' train() turned the model's own activation checkpointing on
        (TrainingArguments.gradient_checkpointing): the engine recomputes the offloaded
        blocks itself (train.activations.policy 'recompute'), so the model's is turned off
        again. (The input hook transformers adds with it stays: it only marks the
        embeddings' output as needing a gradient, which a trained embedding's has.)"""
        model = self.model
        on = getattr(model, "is_activation_checkpointing", None)
        if on is None:  # transformers 5 releases before the rename
            on = getattr(model, "is_gradient_checkpointing", False)
        if on:
            disable = getattr(model, "activation_checkpointing_disable", None) or \
                model.gradient_checkpointing_disable
            disable()

    # ---- set-up: an accelerator without DeepSpeed or autocast, the model left in place ------

    def _build_accelerator_args(self, **kwargs) -> dict[str, Any]:
        if self.args.deepspeed_plugin is not None:
            raise ConfigError(
                "TrainingArguments set DeepSpeed up itself: made before tierstack.worker.hf_trainer "
                "was imported (import it first: the JSON is then tierstack's), or under "
                "ACCELERATE_USE_DEEPSPEED=true (accelerate launch --use_deepspeed: unset it)")
        # The engine keeps the weights in the training precision with fp32 masters (and
        # fp16's loss scale): accelerate's autocast and GradScaler would do it twice.
        return {**super()._build_accelerator_args(**kwargs), "mixed_precision": "no"}

    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        """Nothing to move: the engine puts each tensor in its tier when it is made."""

    def call_model_init(self, trial: Any = None):
        raise ConfigError("Trainer(model_init=...) makes a new model at every train(), and the "
                          "engine holds one model's state; pass model= instead "
                          "(hyperparameter_search is not supported)")

    # ---- the engine -------------------------------------------------------------------------

    def _training_engine(self, total_steps: int | None = None) -> TrainingEngine:
        """The engine, made at the first need: the model's state goes to the tiers, with the
        Trainer's optimizer (or the JSON's) and the run's config; `total_steps`: the run's
        max_steps where train() made it (the dashboard's ETA)."""
        if self._engine is not None:
            return self._engine
        setup = engine_config(self.args, self._deepspeed, self.model)
        optimizer = self.optimizer
        if optimizer is None and not has_optimizer(self._deepspeed):
            optimizer = self.create_optimizer()  # HF's AdamW: no decay on biases and norms
        self._parameter_count = _parameter_count(self.model)  # before its blocks leave it
        try:
            engine, _, _, _ = initialize(model=self.model, optimizer=optimizer, config=setup.config,
                                         total_steps=total_steps)
        except TierstackError as e:  # named as the user wrote it: the JSON's key, the argument
            raise setup.keys.rename(e) from None
        self._engine = engine
        # Closed at Trainer.end(), when the Trainer is collected, or at the interpreter's
        # exit: a finalizer holds the engine, not the Trainer.
        self._closer = weakref.finalize(self, engine.close)
        self.optimizer = _SteppedOptimizer(engine)
        self.model_wrapped = engine
        # accelerate knows DeepSpeed's engine (its backward steps it, unwrap_model takes its
        # module out) and has no hook for another: it learns tierstack's here.
        self._unwrap = self.accelerator.unwrap_model
        self.accelerator.backward = self._backward
        self.accelerator.unwrap_model = self._unwrap_model
        return engine

    def _backward(self, loss: torch.Tensor, **kwargs) -> None:
        """One micro-batch's backward into the engine (the Trainer scaled the loss for the
        accumulation already), then the engine's step: at the accumulation boundary the
        optimizer step, clipping included, as DeepSpeed's engine under accelerate."""
        if kwargs:
            raise InvalidArgumentError(f"the engine's backward takes no {sorted(kwargs)}")
        engine = self._engine
        engine.set_gradient_accumulation_boundary(self.accelerator.sync_gradients)
        engine.backward(loss, scale_wrt_gas=False)
        engine.step()

    def _unwrap_model(self, model, *args, **kwargs):
        """accelerate's unwrap_model, the engine taken off too (the label smoother asks the
        model's class whether it is a causal LM, whose labels it shifts)."""
        return self._unwrap(model.module if model is self._engine else model, *args, **kwargs)

    def _schedule(self, num_training_steps: int) -> None:
        """The run's learning-rate schedule over the engine's param groups: the JSON's
        scheduler section, the one given to the Trainer, or the Trainer's own."""
        engine = self._engine
        if self._created_lr_scheduler:  # as transformers: made anew for every train()
            self.lr_scheduler, self._created_lr_scheduler = None, False
        schedule = getattr(self.lr_scheduler, "schedule", self.lr_scheduler)
        if schedule is None and has_scheduler(self._deepspeed):
            schedule = build_schedule(engine.optimizer, deepspeed_schedule(
                self.args, self._deepspeed, self.model, num_training_steps))
            self._created_lr_scheduler = True
        elif schedule is None:
            schedule = self.create_scheduler(num_training_steps, optimizer=engine.optimizer)
        # ReduceLROnPlateau and GreedyLR are stepped with evaluation metrics, which the
        # Trainer finds by their type: those are handed over as they are.
        plateau = (torch.optim.lr_scheduler.ReduceLROnPlateau, transformers.optimization.GreedyLR)
        self.lr_scheduler = schedule if isinstance(schedule, plateau) else _AppliedStepSchedule(schedule, engine)

    # ---- the Trainer's training loop, over the engine ------------------------------------------

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """transformers' set-up before the loop, with the engine in place of the wrapped
        model and its optimizer (as DeepSpeed's under the Trainer)."""
        self._leave_checkpointing_to_the_engine()
        engine = self._training_engine(max_steps if max_steps and max_steps > 0 else None)
        self._schedule(max_steps)
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return engine, train_dataloader

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        """Evaluation and prediction run through the engine (made here when evaluate()
        comes before train())."""
        return self._training_engine()

    def _clip_grad_norm(self, model) -> float | None:
        """The engine clipped in its step already; this is the norm before clipping."""
        return self._engine.get_global_grad_norm()

    def _get_grad_norm(self, model, grad_norm=None):
        """The engine's norm where it computed one (clipping, fp16), else none is logged:
        the model's own .grad are empty, the gradients are in the tiers."""
        return grad_norm if grad_norm is not None else self._engine.get_global_grad_norm()

    def _prepare_input(self, data):
        """As under DeepSpeed: floating inputs in the engine's training precision."""
        data = super()._prepare_input(data)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
            self._engine.config.precision if self._engine is not None else "fp32")
        if dtype is not None and isinstance(data, torch.Tensor) and torch.is_floating_point(data):
            return data.to(dtype)
        return data

    def floating_point_ops(self, inputs) -> int:
        """transformers' estimate (6 x tokens x parameters but embeddings), with the
        parameters the model had before the engine took its blocks' to the tiers."""
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if self._engine is None or self._parameter_count is None or main_input not in inputs:
            return super().floating_point_ops(inputs)
        return 6 * inputs[main_input].numel() * self._parameter_count

    # ---- saving and resuming ------------------------------------------------------------------

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The weights as safetensors that from_pretrained loads (the engine's export, one
        block at a time), with transformers' config, tokenizer and training arguments."""
        if self._engine is None:
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        # transformers writes everything but the weights (as for DeepSpeed ZeRO-3) ...
        super()._save(output_dir, state_dict={})
        remove_dummy_checkpoint(self.args.should_save, output_dir, [WEIGHTS_NAME, SAFE_WEIGHTS_NAME])
        self._engine.export(output_dir)  # ... and the engine writes those

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's whole training state (weights, fp32 masters, AdamW moments,
        counters) as `global_step<N>` in the checkpoint, as DeepSpeed's save_checkpoint
        under the Trainer; then transformers' optimizer.pt (the param groups'
        hyperparameters) and scheduler.pt."""
        self._engine.save_checkpoint(output_dir, tag=f"global_step{self.state.global_step}")
        super()._save_optimizer_and_scheduler(output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Nothing to load into the model: the engine's checkpoint brings the weights back
        with the rest of the training state (_load_optimizer_and_scheduler)."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path, _ = self._engine.load_checkpoint(checkpoint)
        if path is None:
            raise InvalidArgumentError(
                f"resume_from_checkpoint={checkpoint}: it holds no tierstack training state (no "
                f"'latest' file: saved with save_only_model=True, or not by this Trainer); resume "
                f"from a checkpoint this Trainer saved, or load its weights with from_pretrained")
        super()._load_optimizer_and_scheduler(checkpoint)

    def _load_best_model(self) -> None:
        """load_best_model_at_end: the best checkpoint's training state, as under DeepSpeed."""
        log.info("loading the best model from %s (score %s)", self.state.best_model_checkpoint,
                 self.state.best_metric)
        self._engine.load_checkpoint(self.state.best_model_checkpoint)

    # ---- the end ------------------------------------------------------------------------------

    def end(self) -> None:
        """transformers' end of the Trainer, then the engine's: its last updates waited for,
        the tier manager it started stopped and its files removed. Older transformers 5 releases
        (5.17) have no Trainer.end (train() ends it there): only the engine's end then."""
        parent_end = getattr(super(), "end", None)
        if parent_end is not None:
            parent_end()
        if self._closer is not None:
            self._closer()


def _parameter_count(model: torch.nn.Module) -> int | None:
    """What transformers counts for its FLOP estimate: parameters but embeddings."""
    count = getattr(model, "num_parameters", None)
    return count(exclude_embeddings=True) if count is not None else None


class _SteppedOptimizer:
    """The optimizer the Trainer holds: the engine's, whose step already ran in the
    boundary micro-batch's backward (Trainer._backward), so the Trainer's step() and
    zero_grad() have nothing to do. State and param groups are the engine's optimizer's."""

    def __init__(self, engine: TrainingEngine) -> None:
        self.engine_optimizer = engine.optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.engine_optimizer.param_groups

    def step(self, closure=None) -> None:
        """Stepped already, in the boundary's backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine's step drops the window's gradients itself."""

    def state_dict(self) -> dict:
        return self.engine_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.engine_optimizer.load_state_dict(state_dict)


class _AppliedStepSchedule:
    """A learning-rate schedule that the Trainer steps after every optimizer step, moved
    only after those the engine applied: an fp16 step skipped on an overflow leaves it where
    it was, as DeepSpeed's engine does. Everything else is the schedule's own."""

    def __init__(self, schedule: Any, engine: TrainingEngine) -> None:
        self.schedule = schedule
        self._engine = engine

    def step(self, *args, **kwargs) -> None:
        if self._engine.was_step_applied():
            self.schedule.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.schedule, name)
