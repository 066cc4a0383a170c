"""DeepSpeed's training surface over the offload engine: the user's own loop drives it.

`tierstack.initialize` returns a `TrainingEngine`, which a script written for
`deepspeed.initialize` drives unchanged:

    for batch in loader:
        loss = my_loss(engine(batch["input_ids"], attention_mask=batch["attention_mask"]), batch)
        engine.backward(loss)      # / gradient_accumulation_steps, x the fp16 loss scale
        engine.step()              # an optimizer step at each accumulation boundary

It is the same engine as `tierstack train`'s (worker/engine/offload_engine.py), not a side door: the first
training forward measures and places what fits the HBM budget, blocks stream with their
prefetches, each block's AdamW step starts in the tier manager during the last backward of
a window (unless clipping or fp16's overflow check needs every gradient first), and its
updates overlap the next forward. What it adds is DeepSpeed's bookkeeping, with DeepSpeed's
conventions: micro steps and the accumulation boundary, the learning-rate schedule stepped
after each applied optimizer step, fp16's dynamic loss scale (an overflowed step is
skipped, the scale lowered), checkpoints by tag with a `latest` file and the caller's
client state, and what DeepSpeed prints and records of each step (train.monitor: step
lines, phase timers, `engine.monitor`'s events; worker/api/step_report.py), from the same
figures the node's dashboard gets.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from tierstack import checkpointing
from tierstack.checkpoint_layout import LATEST_FILE, checked_tag, find, holds_checkpoint, latest_tag
from tierstack.config import TrainConfig
from tierstack.errors import ConfigError, InvalidArgumentError
from tierstack.monitor import MonitorMaster
from tierstack.worker.api.step_report import StepFigures, StepReport
from tierstack.worker.engine import checkpoint
from tierstack.worker.engine.deepspeed_checkpoint import is_deepspeed_checkpoint, load_deepspeed_checkpoint
from tierstack.worker.engine.param_groups import HYPER_KEYS
from tierstack.worker.job import Job

log = logging.getLogger(__name__)


class EngineOptimizer(torch.optim.Optimizer):
    """The optimizer `initialize` returns: the engine's param groups (the same dicts the
    engine reads at every step, so any torch LR scheduler built on it drives the tiers'
    AdamW), with `step()` the engine's optimizer step of the current window. Its AdamW
    state lives where the engine keeps it (the device, the tier managers), not here."""

    def __init__(self, engine: "TrainingEngine") -> None:
        groups = engine.core.param_groups
        super().__init__([dict(g) for g in groups], defaults={k: groups[0][k] for k in HYPER_KEYS})
        self.param_groups = groups  # one owner of the hyperparameters: the engine's groups
        self._engine = engine

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """The optimizer step of the window's gradients (engine.step() calls it at each
        accumulation boundary; a closure is run first, as torch optimizers do)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._engine._apply_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.zero_grad()

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_engine", None) is not None:
            raise InvalidArgumentError(
                "the engine's param groups are fixed by initialize(): give every group in "
                "model_parameters (or the optimizer) passed to tierstack.initialize")
        super().add_param_group(param_group)

    def state_dict(self) -> dict:
        """The groups' hyperparameters (the AdamW state is in the engine's checkpoint)."""
        return {"param_groups": [{k: g[k] for k in g if k != "params"}
                                 for g in self.param_groups], "state": {}}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise InvalidArgumentError(f"the state has {len(saved)} param groups, the engine "
                                       f"{len(self.param_groups)}; load the state of this model's optimizer")
        for group, values in zip(self.param_groups, saved):
            group.update({k: v for k, v in values.items() if k != "params"})


class TrainingEngine(torch.nn.Module):
    """A model trained with its blocks' state in the tiers, driven by the caller's loop
    (DeepSpeed's DeepSpeedEngine surface) over `job` (worker/job.py): `core` is its offload
    engine doing the work. The job closes with `close`, or when the engine is collected or
    the interpreter exits (a script need not call close: DeepSpeed has none)."""

    def __init__(self, job: Job, lr_scheduler: Any = None, training_dataloader: Any = None) -> None:
        super().__init__()
        core = job.engine
        self.module = core.model
        self.core = core
        self.config: TrainConfig = job.spec.config.train
        self.optimizer = EngineOptimizer(self)
        # A callable makes the schedule over this engine's optimizer (initialize's).
        self.lr_scheduler = lr_scheduler(self.optimizer) if callable(lr_scheduler) and not hasattr(
            lr_scheduler, "step") else lr_scheduler
        self.training_dataloader = training_dataloader
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._boundary: bool | None = None
        self._step_applied = False
        self._job = job
        self._close_job = job.close_with(self)
        self._closed = False
        self._last_step_end: float | None = None  # monotonic seconds, for the plans' step times
        # The window's losses as the script computed them (each its share of the step's loss)
        # and tokens, for the node's dashboard.
        self._window_losses: list[torch.Tensor] = []
        self._window_tokens = 0
        # What DeepSpeed prints and records of each step (train.monitor), from the figures
        # the dashboard gets (_step_ended).
        monitoring = self.config.monitor
        self.monitor = MonitorMaster(monitoring)
        self._report = StepReport(monitoring, self.monitor, self.global_rank, self.train_batch_size(),
                                  core.time_phases() if monitoring.wall_clock_breakdown else None)
        self._report.started(self._figures(loss=None))
        checkpointing.engine_built(core.model.get_submodule(job.spec.blocks_attr))

    # ---- what DeepSpeed's engine tells ------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.core.store.device

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def global_rank(self) -> int:
        """This rank among the job's (the process group's; 0 for one rank)."""
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        """The job's ranks, all data-parallel (the process group's; 1 for one rank)."""
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def dp_world_size(self) -> int:
        return self.world_size

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.micro_batch_size

    def train_batch_size(self) -> int:
        """Rows per optimizer step over every rank, as DeepSpeed counts it."""
        return self.config.micro_batch_size * self.config.gradient_accumulation_steps * self.world_size

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def fp16_enabled(self) -> bool:
        return self.config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.config.precision == "bf16"

    def zero_optimization_stage(self) -> int:
        return 3

    def get_lr(self) -> list[float]:
        """Each param group's learning rate now (the next optimizer step's)."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_mom(self) -> list:
        """Each param group's AdamW betas (DeepSpeed's momentum for Adam)."""
        return [group["betas"] for group in self.optimizer.param_groups]

    def steps_per_print(self) -> int | None:
        return self.config.monitor.steps_per_print or None

    def wall_clock_breakdown(self) -> bool:
        return self.config.monitor.wall_clock_breakdown

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last optimizer step (before clipping), as DeepSpeed
        reports it every step; None before the first."""
        return self.core.last_gradient_norm

    def was_step_applied(self) -> bool:
        """Whether the last accumulation boundary updated the weights (fp16: not after an
        overflow)."""
        return self._step_applied

    @property
    def loss_scaler(self):
        """fp16's loss scaler (the engine's), else None."""
        return self.core.loss_scaler

    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next step() is an optimizer step: every gradient_accumulation_steps-th
        micro step (or as set_gradient_accumulation_boundary says)."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary = bool(is_boundary)

    # ---- the loop -------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        """The model's own forward, its own output (any loss computed from it works). The
        first training forward first measures one forward and backward on this batch and
        places what fits the HBM budget (the RNG is put back after it)."""
        if torch.is_grad_enabled():
            kwargs = _without_cache(self.module, kwargs)
            if self.module.training and self.core.placement_pending:
                self.core.place_with(lambda: _probe_loss(self.module(*args, **kwargs)))
            if self.module.training:
                self._window_tokens += _tokens(args, kwargs)
                with self._report.forward():
                    return self.module(*args, **kwargs)
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Gradients of `loss`, added to the accumulation window's: the loss is divided by
        gradient_accumulation_steps (scale_wrt_gas) and multiplied by the fp16 loss scale,
        as DeepSpeed does. Returns `loss` as given."""
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.requires_grad:
            raise InvalidArgumentError(
                f"engine.backward needs the scalar loss computed from the engine's output (a 0-d "
                f"tensor that requires grad); got {_describe(loss)}")
        if retain_graph:
            raise InvalidArgumentError("engine.backward(retain_graph=True) is not supported: an "
                                       "offloaded block frees its tensors after its backward")
        scaled = loss
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            scaled = scaled / self.gradient_accumulation_steps()
        # The step's loss is the window's shares added up: a script's own mean over its
        # micro-batches (DeepSpeed divides each by the accumulation steps, as above), or the
        # Trainer's, whose losses come divided already (scale_wrt_gas False).
        self._window_losses.append(scaled.detach())
        if self.loss_scaler is not None:
            scaled = scaled * self.loss_scaler.scale
        with self._report.backward():
            self.core.backward(scaled, boundary=self.is_gradient_accumulation_boundary())
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """End a micro step: at an accumulation boundary, the optimizer step (clipping,
        fp16 unscaling and overflow check), then the learning-rate schedule; every step
        counts toward the boundary."""
        figures = None
        with self._report.step():
            if self.is_gradient_accumulation_boundary():
                self.optimizer.step()  # through the optimizer: torch schedulers see it stepped
                if self._step_applied and self.lr_scheduler is not None:
                    self._step_schedule(lr_kwargs or {})
                self.global_steps += 1
                self.global_samples += self.train_batch_size()
                figures = self._step_ended()
        self.micro_steps += 1
        self._report.micro_step_ended(figures)

    def _step_ended(self) -> StepFigures:
        """An optimizer step ended: its time (since the last one ended, the caller's loop
        included, as a plan's step is) goes to the job's plans, and it with its loss,
        tokens and learning rate to the node's dashboard; the same figures, returned, are
        the step lines' and monitors' (StepReport)."""
        now = time.monotonic()
        losses, self._window_losses = self._window_losses, []
        tokens, self._window_tokens = self._window_tokens, 0
        figures = self._figures(loss=float(torch.stack(losses).sum()) if losses else None)
        seconds = None if self._last_step_end is None else now - self._last_step_end
        self._job.step_done(figures.step, seconds, figures.loss, tokens, figures.lrs[0])
        self._last_step_end = time.monotonic()
        return figures

    def _figures(self, loss: float | None) -> StepFigures:
        return StepFigures(step=self.global_steps, samples=self.global_samples,
                           skipped=self.skipped_steps, loss=loss,
                           lrs=self.get_lr(), moms=self.get_mom(),
                           loss_scale=self.loss_scale() if self.loss_scaler is not None else None)

    def _step_schedule(self, lr_kwargs: dict) -> None:
        """The LR schedule's step. A torch scheduler built on the caller's own optimizer
        (before initialize) never sees that optimizer stepped (the engine steps in its
        place) and would warn that the schedule steps first: not so, so not said."""
        with warnings.catch_warnings():
            if getattr(self.lr_scheduler, "optimizer", self.optimizer) is not self.optimizer:
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` "
                                        r"before `optimizer\.step\(\)`", category=UserWarning)
            self.lr_scheduler.step(**lr_kwargs)

    def _apply_step(self) -> None:
        """The optimizer step of the window (EngineOptimizer.step)."""
        scale = self.loss_scale()
        applied = self.core.step(scale)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=not applied)
        if not applied:
            self.skipped_steps += 1
            log.info("step %d skipped: the gradients overflowed at loss scale %g; the scale is "
                     "now %g", self.global_steps + 1, scale, self.loss_scale())
        self._step_applied = applied
        self.core.zero_grad()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the accumulated gradients (after a step they are dropped already)."""
        self.core.zero_grad()

    def train(self, mode: bool = True) -> "TrainingEngine":
        super().train(mode)
        return self

    def eval(self) -> "TrainingEngine":
        return self.train(False)

    def no_sync(self):
        """DeepSpeed's: nothing to put off. One rank reduces nothing; partitioned ranks
        reduce-scatter each block's gradients as its backward stores them (the window's
        sum is kept as shards), so there is no reduction left for the boundary."""
        return contextlib.nullcontext()

    # ---- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: Any = None,
                        client_state: dict | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """The whole training state as `save_dir`/`tag` (default global_step<N>), atomic and
        verified (worker/engine/checkpoint.py), with `client_state`; `save_latest` points
        `save_dir`/latest at it."""
        tag = checked_tag(f"global_step{self.global_steps}" if tag is None else tag)
        state = {
            "client_state": dict(client_state or {}),
            "global_steps": self.global_steps, "global_samples": self.global_samples,
            "micro_steps": self.micro_steps, "skipped_steps": self.skipped_steps,
            "lr_scheduler": (self.lr_scheduler.state_dict()
                             if hasattr(self.lr_scheduler, "state_dict") else None),
        }
        checkpoint.save_tagged(self.core, save_dir, tag, extra={"engine": state},
                               save_latest=save_latest)
        return True

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: Any = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False
                        ) -> tuple[str | None, dict | None]:
        """Restore `load_dir`/`tag` (default: the tag in `load_dir`/latest, or `load_dir`
        itself where it is one checkpoint); returns (its path, its client_state), or (None,
        None) when there is nothing to load (as DeepSpeed does). A tierstack checkpoint
        resumes bit for bit; a DeepSpeed ZeRO-3 checkpoint (its `*_model_states.pt` and
        `*_optim_states.pt`) brings its weights, fp32 masters, AdamW moments, step counters
        and schedule, so a DeepSpeed run goes on here (worker/engine/deepspeed_checkpoint.py)."""
        load_dir = Path(load_dir)
        if tag is None and latest_tag(load_dir) is None and not holds_checkpoint(load_dir):
            log.warning("no checkpoint to load: %s has no %r file (save_checkpoint writes "
                        "it); starting from the model as it is", load_dir, LATEST_FILE)
            return None, None
        path = find(load_dir, tag)
        if not (load_module_strict and load_optimizer_states and load_lr_scheduler_states) or load_module_only:
            raise InvalidArgumentError(
                "load_checkpoint restores the whole training state (weights, optimizer, schedule) "
                "or nothing; call it with the defaults (partial loads are not supported)")
        if is_deepspeed_checkpoint(path):
            return str(path), self._load_deepspeed(path)
        extra = checkpoint.load_checkpoint(self.core, path)
        state = extra.get("engine")
        if state is None:
            raise InvalidArgumentError(f"{path} was saved by `tierstack train`, not by an engine "
                                       f"from tierstack.initialize; resume it with tierstack train")
        for name in ("global_steps", "global_samples", "micro_steps", "skipped_steps"):
            setattr(self, name, state[name])
        if state["lr_scheduler"] is not None and hasattr(self.lr_scheduler, "load_state_dict"):
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        return str(path), state["client_state"]

    def _load_deepspeed(self, path: Path) -> dict:
        """A DeepSpeed ZeRO-3 checkpoint into this engine, with DeepSpeed's counters and
        schedule; its client state."""
        counters = load_deepspeed_checkpoint(self.core, path)
        self.global_steps, self.skipped_steps = counters.global_steps, counters.skipped_steps
        self.global_samples = counters.global_samples or self.global_steps * self.train_batch_size()
        self.micro_steps = self.global_steps * self.gradient_accumulation_steps()
        if counters.lr_scheduler is not None and hasattr(self.lr_scheduler, "load_state_dict"):
            self.lr_scheduler.load_state_dict(counters.lr_scheduler)
        log.info("loaded DeepSpeed checkpoint %s at step %d", path, self.global_steps)
        return counters.client_state

    def export(self, directory: str | os.PathLike) -> Path:
        """The weights as safetensors that Hugging Face's from_pretrained loads (with the
        model's config when it has one); returns the index file."""
        return checkpoint.export_safetensors(self.core, directory)

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str | None = None,
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's export of the weights (in the dtype they train in). With
        `save_filename` ('pytorch_model.bin', 'model.safetensors'), one file of the whole
        state dict there, as DeepSpeed writes it (the whole model in host memory once);
        without, safetensors shards and their index (one block in memory at a time)."""
        if exclude_frozen_parameters:
            raise InvalidArgumentError("save_16bit_model(exclude_frozen_parameters=True) is not supported: "
                                       "leave it False (every weight is saved)")
        if save_filename is None:
            self.export(save_dir)
        else:
            checkpoint.save_one_file(self.core, save_dir, save_filename)
        return True

    # ---- the end -------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the last updates, then close the job: the engine, its store and what
        was started for it (worker/job.py)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.core.wait_for_optimizer()
        finally:
            self._report.close()
            self._close_job()

    def __enter__(self) -> "TrainingEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _without_cache(model: torch.nn.Module, kwargs: dict) -> dict:
    """A Hugging Face model trains without its key/value cache (the offloaded blocks'
    recompute would extend it twice), unless the caller asked otherwise."""
    if "use_cache" not in kwargs and getattr(getattr(model, "config", None), "use_cache", None):
        return {**kwargs, "use_cache": False}
    return kwargs


def _probe_loss(output: Any) -> torch.Tensor:
    """A scalar to run the placement probe's backward from: the output's own loss where it
    has one (a Hugging Face model given labels), else the mean of its first floating tensor
    that needs gradients (logits), which back-propagates through every block alike."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss.float()
    for value in _tensors(output):
        if value.is_floating_point() and value.requires_grad:
            return value.float().mean()
    raise ConfigError(f"the model's output ({type(output).__name__}) holds no tensor that needs "
                      f"gradients: nothing to train through")


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict) or hasattr(value, "values") and hasattr(value, "keys"):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


def _tokens(args: tuple, kwargs: dict) -> int:
    """Tokens in a forward's input: the first integer tensor's elements (token ids: input_ids
    or the first argument), else the first tensor's rows."""
    tensors = [a for a in (*args, kwargs.get("input_ids"), *kwargs.values())
               if isinstance(a, torch.Tensor)]
    for t in tensors:
        if not t.is_floating_point() and not t.is_complex() and t.dim() > 0:
            return t.numel()
    return tensors[0].shape[0] if tensors and tensors[0].dim() > 0 else 0


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return (f"a tensor of shape {tuple(value.shape)}"
                + ("" if value.requires_grad else " that does not require grad"))
    return type(value).__name__
