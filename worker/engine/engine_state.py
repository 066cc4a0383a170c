"""An engine's training state by name, one block at a time, wherever it lives.

A block's state is with the tier manager while the block is offloaded, and on the device
(with the device's AdamW) once the placement made it resident; the rest of the model
(the persistent part) is always on the device. Checkpoints, the export and the import of
a DeepSpeed checkpoint read and write it here, as plain CPU tensors under the model's
own names, so none of them cares where a block lives:

- a weight `w` in the training dtype (buffers too);
- per trainable weight, `w.master` (its fp32 master, where the weights are not fp32),
  `w.exp_avg` and `w.exp_avg_sq` (AdamW's moments, once a step made them), and for the
  persistent part `w.step` (its AdamW step count; the blocks share the engine's).

Blocks go by their index in the engine (`blocks_attr`.<positions[i]> in the model), under
the block's own names; the persistent part by full names. A partitioned engine gathers a
block from every rank's shard (every rank must call, in the same order) and keeps its own
slice of what it is given.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import torch

from tierstack.checkpoint_layout import weight_names
from tierstack.dtypes import dtype_from_name
from tierstack.errors import InvalidArgumentError
from tierstack.worker.engine.offload_engine import OffloadEngine
from tierstack.worker.engine.tiered_adamw import MOMENTS


def block_state(engine: OffloadEngine, index: int, optimizer_state: bool = True) -> dict[str, torch.Tensor]:
    """Block `index`'s weights and (with `optimizer_state`) masters and moments, CPU
    tensors under the block's names. Call `engine.wait_for_optimizer()` first."""
    if index in engine.blocks.resident:
        return _resident_block_state(engine, index, optimizer_state)
    store, optimizer = engine.store, engine.block_optimizer
    tensors = dict(store.read_layer(index))
    if optimizer_state:
        for kind in (("master",) if optimizer.masters else ()) + (MOMENTS if optimizer.steps else ()):
            tensors.update(store.read_layer(index, kind))
    return tensors


def _resident_block_state(engine: OffloadEngine, index: int, optimizer_state: bool) -> dict[str, torch.Tensor]:
    block = engine.blocks.blocks[index]
    tensors = {}
    masters = _masters(engine)
    for name, tensor, trainable in _named_tensors(block):
        tensors[name] = _cpu(tensor)
        if optimizer_state and trainable:
            tensors.update(_optimizer_state(engine, name, masters[id(tensor)], per_weight_step=False))
    return tensors


def persistent_state(engine: OffloadEngine, optimizer_state: bool = True
                     ) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """The model's tensors outside the blocks, by full name, with (`optimizer_state`) each
    trainable weight's master, moments and step; the tied names (a name -> the name its
    tensor is kept under); the frozen parameters."""
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    first: dict[int, str] = {}
    frozen: list[str] = []
    masters = _masters(engine)
    for name, tensor, trainable in _named_tensors(engine.model, skip=set(_block_paths(engine))):
        if id(tensor) in first:  # tied weights (GPT-2's head and embedding): kept once
            tied[name] = first[id(tensor)]
            continue
        first[id(tensor)] = name
        tensors[name] = _cpu(tensor)
        if trainable and optimizer_state:
            tensors.update(_optimizer_state(engine, name, masters[id(tensor)], per_weight_step=True))
        elif isinstance(tensor, torch.nn.Parameter) and not trainable:
            frozen.append(name)
    return tensors, tied, frozen


def shapes(engine: OffloadEngine, parameters_only: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor the state holds (each parameter and persistent buffer; with
    `parameters_only`, the parameters) by full name, tied ones once under their first
    name, in the model's order, with its shape: an offloaded block's from its layout (its
    module holds placeholders)."""
    out: dict[str, tuple[int, ...]] = {}
    blocks = {path: i for i, path in enumerate(_block_paths(engine))}
    seen: set[int] = set()

    def walk(module: torch.nn.Module, prefix: str) -> None:
        for name, tensor, _ in _named_tensors(module, prefix, skip=set(blocks), recurse=False):
            if id(tensor) not in seen and (isinstance(tensor, torch.nn.Parameter) or not parameters_only):
                seen.add(id(tensor))
                out[name] = tuple(tensor.shape)
        for name, child in module._modules.items():
            path = prefix + name
            if path in blocks:
                index = blocks[path]
                block = engine.blocks.blocks[index]
                laid_out = {} if index in engine.blocks.resident else {
                    slot.name: tuple(slot.shape) for slot in engine.store.layout(index).slots}
                for n, tensor, _ in _named_tensors(block):
                    if isinstance(tensor, torch.nn.Parameter) or not parameters_only:
                        out[f"{path}.{n}"] = laid_out.get(n, tuple(tensor.shape))
            elif child is not None:
                walk(child, path + ".")

    walk(engine.model, "")
    return out


def block_names(engine: OffloadEngine, index: int) -> list[str]:
    """The names block `index` keeps: its parameters and persistent buffers."""
    return [name for name, _, _ in _named_tensors(engine.blocks.blocks[index])]


def frozen_block_parameters(engine: OffloadEngine) -> list[str]:
    """The blocks' parameters that do not train, by full name."""
    return [f"{block_path}.{name}" for block_path, block in zip(_block_paths(engine), engine.blocks.blocks)
            for name, p in block.named_parameters() if not p.requires_grad]


def put_block_state(engine: OffloadEngine, index: int, tensors: Mapping[str, torch.Tensor],
                    steps: int) -> None:
    """Make block `index`'s state `tensors` (block_state's names; weights not given keep
    their values, as a checkpoint without a model's non-persistent buffers has none).
    `steps`: the AdamW steps the moments were made over. Call `engine.wait_for_optimizer()`
    first."""
    trainable = [n for n, _, _ in engine.blocks.trainable(index)]
    moments = _moments_given(tensors, trainable, f"block {index}")
    if index in engine.blocks.resident:
        _put_resident_block(engine, index, tensors, steps)
        return
    store, optimizer = engine.store, engine.block_optimizer
    slots = store.layout(index).slots
    current = None
    if any(s.name not in tensors for s in slots):
        current = store.read_layer(index)
    weights = {s.name: (_weight(tensors, s.name, optimizer.masters) if s.name in tensors else current[s.name]
                        ).to(dtype_from_name(s.dtype)) for s in slots}
    store.write_back(index, weights)
    if optimizer.masters:
        store.write_back(index, {f"{n}.master": _fp32(tensors, n) for n in trainable}, kind="master")
    if moments:
        for kind in MOMENTS:
            store.write_back(index, {f"{n}.{kind}": tensors[f"{n}.{kind}"].float() for n in trainable},
                             kind=kind)


def _put_resident_block(engine: OffloadEngine, index: int, tensors: Mapping[str, torch.Tensor],
                        steps: int) -> None:
    masters = _masters(engine)
    with torch.no_grad():
        for name, target, trainable in _named_tensors(engine.blocks.blocks[index]):
            if name not in tensors:
                continue
            _put_weight(engine, name, target, trainable, masters, tensors, steps)


def put_persistent_state(engine: OffloadEngine, tensors: Mapping[str, torch.Tensor], steps: int,
                         what: str) -> None:
    """Make the persistent part's state `tensors` (persistent_state's names; tied weights
    under either name). Every parameter of the model's persistent part must be there (a
    buffer not given keeps its value), and nothing the model has not; `what` names the
    source in the error that says otherwise. `steps`: as for put_block_state."""
    masters = _masters(engine)
    targets: dict[str, tuple[torch.Tensor, bool]] = {}
    kept_as: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor, trainable in _named_tensors(engine.model, skip=set(_block_paths(engine))):
        if id(tensor) in kept_as:
            aliases[name] = kept_as[id(tensor)]
        else:
            kept_as[id(tensor)] = name
            targets[name] = (tensor, trainable)
    tensors = dict(tensors)
    for alias, name in aliases.items():  # a tied weight given under its other name
        if name not in tensors and alias in tensors:
            tensors.update({name + k[len(alias):]: v for k, v in tensors.items()
                            if k == alias or k.startswith(alias + ".")})
    unknown = [n for n in weight_names(list(tensors)) if n not in targets and n not in aliases]
    if unknown:
        raise InvalidArgumentError(f"{what} has {unknown[0]!r}, which the model has not (outside "
                                   f"its blocks); load it into the model it was saved from")
    missing = [n for n, (t, _) in targets.items() if n not in tensors and isinstance(t, torch.nn.Parameter)]
    if missing:
        raise InvalidArgumentError(f"{what} has no {missing[0]!r}, which the model has; load it "
                                   f"into the model it was saved from")
    with torch.no_grad():
        for name, (target, trainable) in targets.items():
            if name in tensors:
                _put_weight(engine, name, target, trainable, masters, tensors, steps)


# ---- helpers ------------------------------------------------------------------------------


def _put_weight(engine: OffloadEngine, name: str, target: torch.Tensor, trainable: bool,
                masters: dict[int, torch.Tensor], tensors: Mapping[str, torch.Tensor],
                steps: int) -> None:
    """One device weight, its master and its AdamW state (under torch.no_grad). A device
    weight's moments go weight by weight: torch's AdamW makes none for a weight no
    gradient reached."""
    master = masters.get(id(target)) if trainable else None
    separate = master is not None and master is not target
    target.copy_(_weight(tensors, name, separate) if trainable else tensors[name])
    if separate:
        master.copy_(_fp32(tensors, name))
    if master is not None and f"{name}.exp_avg" in tensors:
        step = tensors.get(f"{name}.step")
        engine.persistent_optimizer.state[master] = {
            "step": torch.tensor(float(steps if step is None else step), dtype=torch.float32,
                                 device=master.device),
            **{kind: tensors[f"{name}.{kind}"].to(device=master.device, dtype=master.dtype)
               for kind in MOMENTS}}
    elif master is not None:
        engine.persistent_optimizer.state.pop(master, None)


def _weight(tensors: Mapping[str, torch.Tensor], name: str, keeps_masters: bool) -> torch.Tensor:
    """A weight as the engine keeps it: the stored weight where the engine keeps masters
    beside its weights (the weights are the masters rounded: exact), else the fp32 master
    where one was saved (the engine trains in fp32)."""
    if keeps_masters:
        return tensors[name]
    return tensors.get(f"{name}.master", tensors[name])


def _fp32(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """A weight's fp32 master: the saved one, else the weight widened (an fp32 checkpoint)."""
    return tensors.get(f"{name}.master", tensors[name]).float()


def _moments_given(tensors: Mapping[str, torch.Tensor], trainable: list[str], what: str) -> bool:
    """Whether `tensors` carry AdamW moments for a block's trainable weights: all or none
    (the tier manager steps a block whole)."""
    have = [n for n in trainable if f"{n}.exp_avg" in tensors and f"{n}.exp_avg_sq" in tensors]
    if have and len(have) != len(trainable):
        missing = next(n for n in trainable if n not in have)
        raise InvalidArgumentError(f"{what} has AdamW moments for some weights but not for "
                                   f"{missing!r}; load a checkpoint saved whole")
    return bool(have)


def _optimizer_state(engine: OffloadEngine, name: str, master: torch.Tensor,
                     per_weight_step: bool) -> dict[str, torch.Tensor]:
    """A device weight's master (where it is not the weight) and AdamW state."""
    out = {}
    weight_is_master = engine.persistent_masters is engine.persistent
    if not weight_is_master:
        out[f"{name}.master"] = _cpu(master)
    state = engine.persistent_optimizer.state.get(master)
    if state:
        for kind in MOMENTS:
            out[f"{name}.{kind}"] = _cpu(state[kind])
        if per_weight_step:
            out[f"{name}.step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
    return out


def _masters(engine: OffloadEngine) -> dict[int, torch.Tensor]:
    """Each device parameter's fp32 master (the parameter itself in fp32), by identity."""
    return {id(p): m for p, m in zip(engine.persistent, engine.persistent_masters)}


def _block_paths(engine: OffloadEngine) -> list[str]:
    """Where each offloaded block sits in the model, in block order."""
    return [f"{engine.blocks_attr}.{p}" for p in engine.blocks.positions]


def _named_tensors(module: torch.nn.Module, prefix: str = "", skip: set[str] = frozenset(),
                   recurse: bool = True) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, trainable) of every parameter and persistent buffer of `module` (and,
    with `recurse`, of its submodules), tied ones under each name, leaving out the
    submodules at the `skip` paths (the blocks). Walked through the modules' own tables,
    not state_dict(): the same tensors whatever a model's state_dict hooks show."""
    for name, p in module._parameters.items():
        if p is not None:
            yield prefix + name, p, p.requires_grad
    for name, b in module._buffers.items():
        if b is not None and name not in module._non_persistent_buffers_set:
            yield prefix + name, b, False
    for name, child in module._modules.items() if recurse else ():
        path = prefix + name
        if child is not None and path not in skip:
            yield from _named_tensors(child, path + ".", skip)


def _cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy that shares no memory with the live tensor."""
    tensor = tensor.detach()
    return tensor.clone() if tensor.device.type == "cpu" else tensor.cpu()
