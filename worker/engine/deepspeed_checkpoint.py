"""A DeepSpeed ZeRO-3 checkpoint read into tierstack's engine: weights, AdamW moments and step.

DeepSpeed's stage 3 saves, for each data-parallel rank r of N, into the tag's directory:
- `zero_pp_rank_<r>_mp_rank_00_model_states.pt`: the module's buffers (its parameters are
  empty there: partitioned), `param_shapes` (each param group's parameter names and
  shapes, in order), `shared_params`, the frozen parameters' shapes and this rank's
  fragments of them, `global_steps`, `global_samples`, `skipped_steps`, `lr_scheduler`,
  and the caller's client state;
- `[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`: `fp32_flat_groups` (this rank's
  flat fp32 partitions, one per sub-group) and the inner optimizer's state (`exp_avg`,
  `exp_avg_sq` laid out as those partitions, and `step`).

A parameter of n elements is cut into N parts of ceil(n / N) elements (the last one
padded); rank r's flat partitions hold part r of every parameter, one after another in
param_shapes' order (DeepSpeed's own zero_to_fp32.py reads them the same way). Here each
block's parameters and moments are put together from the ranks' parts and written into
the engine (engine_state.py): the fp32 partitions are the masters, the weights are them in
the engine's dtype. The files are memory-mapped, so one block's state is in memory at a
time.

The files are pickles that name DeepSpeed's classes (its ZeRO stage enum, its loss
scaler); they are read with stand-ins for those, so DeepSpeed is never imported and need
not be installed. A pickle can run code when read: load only checkpoints you trust, as
with DeepSpeed itself.
"""

from __future__ import annotations

import logging
import math
import pickle
import re
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tierstack.checkpoint_layout import DEEPSPEED_MODEL_STATES
from tierstack.errors import InvalidArgumentError
from tierstack.worker.engine.engine_state import block_names, put_block_state, put_persistent_state, shapes
from tierstack.worker.engine.offload_engine import OffloadEngine
from tierstack.worker.engine.tiered_adamw import MOMENTS

log = logging.getLogger(__name__)

_RANK_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(model|optim)_states\.pt$")
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
DEEPSPEED_STATES = ("module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size",
                    "data_sampler", "random_ltd", "lr_scheduler", "optimizer")
"""The model states' own entries; the rest is the caller's client_state (DeepSpeed's
load_checkpoint returns it the same way)."""


def is_deepspeed_checkpoint(directory: Path) -> bool:
    """Whether `directory` is one of DeepSpeed's checkpoints (a tag's directory)."""
    return any(Path(directory).glob(DEEPSPEED_MODEL_STATES))


@dataclass
class DeepSpeedCounters:
    """What DeepSpeed's engine kept beside the model and optimizer state."""

    global_steps: int
    global_samples: int
    skipped_steps: int
    lr_scheduler: dict | None
    client_state: dict = field(default_factory=dict)


def load_deepspeed_checkpoint(engine: OffloadEngine, directory: str | Path) -> DeepSpeedCounters:
    """Put DeepSpeed ZeRO-3 checkpoint `directory` (one tag) into an engine built for the
    same model: every weight, its fp32 master, its AdamW moments, the step count and each
    param group's hyperparameters (lr as the schedule had moved it), as DeepSpeed's own
    load_checkpoint restores them. Refused in one line, before anything changes, where the
    checkpoint is not ZeRO-3 or holds another model or other param groups (naming the first
    parameter that differs)."""
    directory = Path(directory)
    checkpoint = _Checkpoint(directory)
    checkpoint.check_fits(engine)
    hyperparameters = checkpoint.group_hyperparameters(engine)
    engine.wait_for_optimizer()
    steps = checkpoint.step
    for i, position in enumerate(engine.blocks.positions):
        prefix = f"{engine.blocks_attr}.{position}."
        put_block_state(engine, i, checkpoint.tensors(prefix, block_names(engine, i)), steps)
    put_persistent_state(engine, checkpoint.tensors("", checkpoint.outside_blocks(engine)), steps,
                         f"DeepSpeed checkpoint {directory}")
    engine.block_optimizer.steps = steps
    for group, saved in zip(engine.param_groups, hyperparameters):
        group.update({k: saved[k] for k in HYPERPARAMETERS if k in saved})
    states = checkpoint.model_states
    return DeepSpeedCounters(
        global_steps=int(states.get("global_steps", steps)),
        global_samples=int(states.get("global_samples", 0)),
        skipped_steps=int(states.get("skipped_steps", 0)),
        lr_scheduler=states.get("lr_scheduler"),
        client_state={k: v for k, v in states.items() if k not in DEEPSPEED_STATES})


class _Checkpoint:
    """One DeepSpeed ZeRO-3 tag: its ranks' files, read lazily (memory-mapped)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        models, optims = self._rank_files()
        self.model_states = _load(models[0])
        self.world = len(models)
        self.optims = [self._optimizer_state(_load(f, mmap=True)) for f in optims]
        stage = _stage(self.optims[0].get("zero_stage"))
        if stage != 3:
            raise InvalidArgumentError(
                f"{directory} is a DeepSpeed ZeRO stage {stage} checkpoint; tierstack reads ZeRO-3 "
                f"checkpoints (zero_optimization.stage 3): convert it with DeepSpeed's "
                f"zero_to_fp32.py and load the weights into the model before initialize")
        self.frozen_fragments = [_load(f).get("frozen_param_fragments") or {} for f in models] \
            if self.model_states.get("frozen_param_shapes") else []
        self.shapes: dict[str, torch.Size] = {}
        for group in self.model_states["param_shapes"]:
            self.shapes.update(group)
        self.frozen_shapes: dict[str, torch.Size] = dict(self.model_states.get("frozen_param_shapes") or {})
        self.shared: dict[str, str] = dict(self.model_states.get("shared_params") or {})
        buffer_names = set(self.model_states.get("buffer_names") or ())
        self.buffers = {k: v for k, v in self.model_states["module"].items() if k in buffer_names}
        self._flat = [_Flat(o["fp32_flat_groups"]) for o in self.optims]
        self._moments = self._read_moments()
        self._offsets = self._lay_out()

    def _rank_files(self) -> tuple[list[Path], list[Path]]:
        files: dict[str, dict[int, Path]] = {"model": {}, "optim": {}}
        for path in self.directory.iterdir():
            match = _RANK_FILE.match(path.name)
            if match is None:
                continue
            if int(match.group(2)) != 0:
                raise InvalidArgumentError(f"{self.directory} holds model-parallel ranks ({path.name}); "
                                           f"tierstack reads data-parallel ZeRO-3 checkpoints")
            files[match.group(3)][int(match.group(1))] = path
        if not files["model"]:
            stage12 = self.directory / "mp_rank_00_model_states.pt"
            raise InvalidArgumentError(
                f"{self.directory} is a DeepSpeed ZeRO stage 1/2 checkpoint ({stage12.name}); tierstack "
                f"reads ZeRO-3 checkpoints: convert it with DeepSpeed's zero_to_fp32.py and load the "
                f"weights into the model before initialize" if stage12.exists() else
                f"{self.directory} holds no DeepSpeed ZeRO-3 model states (zero_pp_rank_*_mp_rank_00_"
                f"model_states.pt); give a tag's directory that DeepSpeed's save_checkpoint wrote")
        ranks = sorted(files["model"])
        if ranks != list(range(len(ranks))) or sorted(files["optim"]) != ranks:
            raise InvalidArgumentError(
                f"{self.directory} has model states of ranks {ranks} and optimizer states of ranks "
                f"{sorted(files['optim'])}: a checkpoint one or more ranks did not finish saving; "
                f"load another tag")
        return [files["model"][r] for r in ranks], [files["optim"][r] for r in ranks]

    def _optimizer_state(self, states: dict) -> dict:
        inner = states.get("optimizer_state_dict")
        if not isinstance(inner, dict) or "fp32_flat_groups" not in inner:
            raise InvalidArgumentError(f"{self.directory}: its optimizer states hold no fp32 partitions "
                                       f"(fp32_flat_groups); give a tag a ZeRO-3 run saved")
        partitions = inner.get("partition_count")
        if partitions is not None and max(_listed(partitions)) != self.world:
            raise InvalidArgumentError(f"{self.directory} was saved by {max(_listed(partitions))} ranks "
                                       f"but holds the files of {self.world}; load another tag")
        return inner

    def _read_moments(self) -> list[dict[str, _Flat]] | None:
        """Each rank's moments, laid out as its fp32 partitions; None before the first step."""
        out = []
        for optim, flat in zip(self.optims, self._flat):
            state = (optim.get("optimizer_state_dict") or {}).get("state") or {}
            if not state:
                return None
            groups = [state[j] for j in sorted(state)]
            moments = {kind: _Flat([g[kind] for g in groups]) for kind in MOMENTS}
            if any(m.numel != flat.numel for m in moments.values()):
                raise InvalidArgumentError(f"{self.directory}: the optimizer's moments do not match "
                                           f"its fp32 partitions; not a checkpoint tierstack can read")
            out.append(moments)
        return out

    @property
    def step(self) -> int:
        if self._moments is None:
            return 0
        state = self.optims[0]["optimizer_state_dict"]["state"]
        return int(float(state[min(state)]["step"]))

    def group_hyperparameters(self, engine: OffloadEngine) -> list[dict]:
        """Each param group's hyperparameters as saved, once the engine's groups are found
        to hold the same parameters. DeepSpeed keeps a group's partitions in one or more
        sub-groups (sub_group_size), each an optimizer group of its own: a group's are the
        sub-groups its parameters' parts fill, in order."""
        groups = self.model_states["param_shapes"]
        if len(groups) != len(engine.param_groups):
            raise InvalidArgumentError(
                f"DeepSpeed checkpoint {self.directory} has {len(groups)} param groups, the engine "
                f"{len(engine.param_groups)}; give initialize the param groups it was saved with")
        mine = engine._group_of  # each parameter's group by name (the engine keeps no public view)
        for g, group in enumerate(groups):
            for name in group:
                if mine.get(name, g) != g:
                    raise InvalidArgumentError(
                        f"DeepSpeed checkpoint {self.directory} has parameter {name!r} in param group "
                        f"{g}, the engine in group {mine[name]}; give initialize the param groups it "
                        f"was saved with")
        saved = (self.optims[0].get("optimizer_state_dict") or {}).get("param_groups") or []
        sizes = [t.numel() for t in self._flat[0].tensors]
        if len(saved) != len(sizes):
            return []  # no hyperparameters to go by: the engine's stay
        out, filled = [], 0
        for group in groups:
            out.append(dict(saved[min(len(saved) - 1, _sub_group_at(sizes, filled))]))
            filled += sum(math.ceil(math.prod(shape) / self.world) for shape in group.values())
        return out

    def _lay_out(self) -> dict[str, int]:
        """Each trainable parameter's offset into every rank's flat partitions."""
        offsets, offset = {}, 0
        for name, shape in self.shapes.items():
            offsets[name] = offset
            offset += math.ceil(math.prod(shape) / self.world)
        held = self._flat[0].numel
        if offset != held:
            raise InvalidArgumentError(
                f"{self.directory}: its parameters' parts add up to {offset} elements per rank but "
                f"the fp32 partitions hold {held}; not a ZeRO-3 layout tierstack can read")
        return offsets

    def check_fits(self, engine: OffloadEngine) -> None:
        """Refuse a checkpoint of another model, naming the first parameter that differs."""
        mine = shapes(engine, parameters_only=True)
        theirs = {**self.shapes, **self.frozen_shapes}
        for name, shape in theirs.items():
            if name not in mine:
                raise InvalidArgumentError(
                    f"DeepSpeed checkpoint {self.directory} has parameter {name!r} {list(shape)}, which "
                    f"the model has not; load it into the model it was saved from")
            if tuple(mine[name]) != tuple(shape):
                raise InvalidArgumentError(
                    f"DeepSpeed checkpoint {self.directory} has parameter {name!r} of shape "
                    f"{list(shape)}, the model {list(mine[name])}; load it into the model it was "
                    f"saved from (same sizes)")
        for name in mine:
            if name not in theirs and name not in self.shared:
                raise InvalidArgumentError(
                    f"DeepSpeed checkpoint {self.directory} has no parameter {name!r} of the model; "
                    f"load it into the model it was saved from")
        every = shapes(engine)
        for name, buffer in self.buffers.items():
            if tuple(every.get(name, buffer.shape)) != tuple(buffer.shape) or name not in every:
                raise InvalidArgumentError(
                    f"DeepSpeed checkpoint {self.directory} has buffer {name!r} {list(buffer.shape)}, "
                    + (f"the model {list(every[name])}" if name in every else "which the model has not")
                    + "; load it into the model it was saved from")

    def outside_blocks(self, engine: OffloadEngine) -> list[str]:
        prefixes = tuple(f"{engine.blocks_attr}.{p}." for p in engine.blocks.positions)
        names = [*self.shapes, *self.frozen_shapes, *self.buffers]
        return [n for n in names if not n.startswith(prefixes)]

    def tensors(self, prefix: str, names: list[str]) -> dict[str, torch.Tensor]:
        """The state of the weights `prefix`+name, under their names without the prefix:
        fp32 value and moments of a trainable one, the value of a frozen one or a buffer."""
        out = {}
        for name in names:
            full = prefix + name
            if full in self.shapes:
                out[name] = self._gather(self._flat, full)
                if self._moments is not None:
                    for kind in MOMENTS:
                        out[f"{name}.{kind}"] = self._gather([m[kind] for m in self._moments], full)
            elif full in self.frozen_shapes:
                shape = self.frozen_shapes[full]
                parts = [fragments[full].flatten() for fragments in self.frozen_fragments]
                out[name] = torch.cat(parts)[:math.prod(shape)].view(shape)
            elif full in self.buffers:
                out[name] = self.buffers[full]
        return out

    def _gather(self, flats: list[_Flat], name: str) -> torch.Tensor:
        shape = self.shapes[name]
        part = math.ceil(math.prod(shape) / self.world)
        whole = torch.cat([flat.narrow(self._offsets[name], part) for flat in flats])
        return whole[:math.prod(shape)].view(shape)


class _Flat:
    """One rank's flat partitions (one tensor per sub-group) as one run of elements."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = [t.flatten() for t in tensors]
        self.starts = [0]
        for t in self.tensors:
            self.starts.append(self.starts[-1] + t.numel())
        self.numel = self.starts[-1]

    def narrow(self, offset: int, length: int) -> torch.Tensor:
        pieces = []
        for start, t in zip(self.starts, self.tensors):
            lo, hi = max(offset, start), min(offset + length, start + t.numel())
            if lo < hi:
                pieces.append(t[lo - start:hi - start])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _sub_group_at(sizes: list[int], offset: int) -> int:
    """The sub-group whose elements include `offset` (of all of a rank's, in order)."""
    start = 0
    for j, size in enumerate(sizes):
        if offset < start + size:
            return j
        start += size
    return len(sizes) - 1


def _listed(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _stage(value: Any) -> int | None:
    """The ZeRO stage: an int, or DeepSpeed's ZeroStageEnum read as a stand-in."""
    if isinstance(value, int):
        return int(value)
    args = getattr(value, "args", ())
    return int(args[0]) if args and isinstance(args[0], int) else None


# ---- reading DeepSpeed's pickles without DeepSpeed ----------------------------------------


class _StandIn:
    """What a DeepSpeed object of the checkpoint is read as: its constructor's arguments
    (`args`) and its pickled attributes (`state`)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "_StandIn":
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<DeepSpeed {type(self).__module__}.{type(self).__qualname__} {self.args or self.state}>"


class _Unpickler(pickle.Unpickler):
    """pickle's, with every class of DeepSpeed's read as a _StandIn subclass of its name."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "deepspeed" or module.startswith("deepspeed."):
            return type(name, (_StandIn,), {"__module__": module, "__qualname__": name})
        return super().find_class(module, name)


_PICKLE = types.ModuleType("tierstack_deepspeed_pickle")
_PICKLE.Unpickler = _Unpickler
_PICKLE.load = lambda f, **kwargs: _Unpickler(f, **kwargs).load()
_PICKLE.__dict__.update({k: getattr(pickle, k) for k in ("UnpicklingError", "HIGHEST_PROTOCOL")})


def _load(path: Path, mmap: bool = False) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap, pickle_module=_PICKLE)
