"""Checkpoints and Hugging Face export straight from the tiers, one block at a time.

Never is the whole model gathered: each block's state is read (from the tier manager, or
the device for a block the placement made resident: worker/engine/engine_state.py), written
to its own safetensors file, and dropped before the next one is read.

- `save_tagged` / `load_checkpoint`: DeepSpeed's layout, which the engine, `tierstack
  train` and the partitioned job share (tierstack/checkpoint_layout.py): a directory of
  tags and a `latest` file. A tag holds block i's weights, fp32 masters and AdamW
  moments in `block-<i>.safetensors`, the rest of the model's in `persistent.safetensors`
  (all under the model's names, so `tierstack zero-to-fp32` reads them without the
  model's code), and `engine.pt` with the step count, the param groups, fp16's loss scale
  and the caller's extra state. Values are stored exactly, so training resumed from a
  checkpoint continues bit for bit, whichever blocks are resident on either side.
  A tag is atomic: written into a staging directory beside its target, every file
  fsynced and listed with its size and crc32 in `checkpoint.json`, then swapped into place
  in one rename (and only then named by `latest`); `load_checkpoint` checks every file
  against that list before it changes anything. A save that dies leaves the previous
  checkpoint whole and removes what it wrote.
- `export_safetensors`: the model's weights as a sharded safetensors checkpoint with its
  index (`model.safetensors.index.json`), under the model's own parameter names, so
  Hugging Face `from_pretrained` loads it.

A partitioned engine (`ShardedEngine`) is saved the same way, into the same format: every
rank calls these functions (each block is gathered from the ranks' shards, a collective),
rank 0 alone writes, and no rank returns before the files are in place. On load every
rank reads the files and keeps its own slice, so a checkpoint written by N ranks resumes
on any number of ranks (the directory must be visible to every rank: the same host or a
shared filesystem).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tierstack.checkpoint_layout import (ENGINE_FILE, PERSISTENT_FILE, ModelMap, block_file, checked_tag,
                                         fsync, model_map, older_tags, remove_format1, swap_into_place,
                                         verify, weight_names, write_latest, write_listing)
from tierstack.errors import InvalidArgumentError
from tierstack.worker.engine.engine_state import (block_state, frozen_block_parameters, persistent_state,
                                                  put_block_state, put_persistent_state, shapes)
from tierstack.worker.engine.offload_engine import OffloadEngine


def save_tagged(engine: OffloadEngine, save_dir: str | Path, tag: str, extra: dict | None = None,
                save_latest: bool = True, keep: int = 0) -> Path:
    """Save the engine as `save_dir`/`tag` (save_checkpoint), then point `save_dir`/latest
    at it; with `keep`, remove the tags past the newest `keep` (and a format-1 checkpoint
    written straight into `save_dir`) once `latest` names the new one. Every rank calls."""
    save_dir = Path(save_dir)
    path = save_dir / checked_tag(tag)
    save_checkpoint(engine, path, extra)
    store = engine.store
    if save_latest:
        if store.writes_checkpoint:  # partitioned: rank 0 writes, as the checkpoint
            write_latest(save_dir, path.name)
            for old in older_tags(save_dir, keep):
                shutil.rmtree(save_dir / old)
            if keep:
                remove_format1(save_dir)
        store.barrier()  # no rank reads `latest` before it points at this one
    return path


def save_checkpoint(engine: OffloadEngine, directory: str | Path, extra: dict | None = None) -> None:
    """Write the engine's whole training state as checkpoint `directory` (one tag),
    replacing what was there only once every file of the new checkpoint is durable."""
    engine.wait_for_optimizer()
    target = Path(directory).absolute()
    staged = target.with_name(f".{target.name}.writing")
    writes = engine.store.writes_checkpoint
    if writes:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staged, ignore_errors=True)  # what a save killed outright left
        staged.mkdir()
    try:
        for i in range(len(engine.blocks.blocks)):
            tensors = block_state(engine, i)  # partitioned: gathered from every rank
            if writes:
                save_file({k: v.contiguous() for k, v in tensors.items()}, str(staged / block_file(i)))
        persistent, tied, frozen = persistent_state(engine)
        if writes:
            save_file({k: v.contiguous() for k, v in persistent.items()}, str(staged / PERSISTENT_FILE))
            torch.save(_engine_meta(engine, extra), staged / ENGINE_FILE)
            _save_model_config(engine, staged)
            write_listing(staged, ModelMap(
                blocks_attr=engine.blocks_attr, blocks=list(engine.blocks.positions),
                precision=engine.precision, steps=engine.block_optimizer.steps, tied=tied,
                frozen=frozen + frozen_block_parameters(engine)))
            swap_into_place(staged, target)
    except BaseException:
        if writes:
            shutil.rmtree(staged, ignore_errors=True)
        raise
    engine.store.barrier()


def _engine_meta(engine: OffloadEngine, extra: dict | None) -> dict:
    return {
        "steps": engine.block_optimizer.steps,
        # The groups' hyperparameters now (a schedule moved their lr) and fp16's loss scale.
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in engine.param_groups],
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "extra": extra or {},
    }


def load_checkpoint(engine: OffloadEngine, directory: str | Path) -> dict:
    """Restore checkpoint `directory` (one tag) into an engine built for the same model;
    returns `extra`."""
    directory = Path(directory)
    if not (directory / ENGINE_FILE).exists():
        raise InvalidArgumentError(f"{directory} holds no tierstack checkpoint ({ENGINE_FILE} is missing)")
    listing = verify(directory)
    meta = torch.load(directory / ENGINE_FILE, map_location="cpu", weights_only=False)
    groups = meta.get("param_groups", engine.param_groups)
    if len(groups) != len(engine.param_groups):
        raise InvalidArgumentError(
            f"checkpoint {directory} has {len(groups)} param groups but the engine "
            f"{len(engine.param_groups)}; give the engine the param groups it was saved with")
    if "model" in listing:
        _check_fits(engine, directory, model_map(directory, listing))
    elif meta["blocks"] != len(engine.blocks.blocks):
        raise InvalidArgumentError(
            f"checkpoint {directory} has {meta['blocks']} blocks but the model has "
            f"{len(engine.blocks.blocks)}; load it into the model it was saved from")
    engine.wait_for_optimizer()
    steps = meta["steps"]
    for i in range(len(engine.blocks.blocks)):
        put_block_state(engine, i, load_file(str(directory / block_file(i))), steps)
    if "model" in listing:
        put_persistent_state(engine, load_file(str(directory / PERSISTENT_FILE)), steps,
                             f"checkpoint {directory}")
    else:
        _load_format1_persistent(engine, meta)
    engine.block_optimizer.steps = steps
    for group, saved_group in zip(engine.param_groups, meta.get("param_groups", [])):
        group.update(saved_group)
    if engine.loss_scaler is not None and meta.get("loss_scaler") is not None:
        engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    return meta["extra"]


def _check_fits(engine: OffloadEngine, directory: Path, model: ModelMap) -> None:
    """Refuse, before anything changes, a checkpoint of another model (or of the same one
    with other blocks offloaded), naming the first tensor that differs (read from the
    files' headers only)."""
    if (model.blocks_attr, model.blocks) != (engine.blocks_attr, engine.blocks.positions):
        raise InvalidArgumentError(
            f"checkpoint {directory} offloads blocks {model.blocks} of {model.blocks_attr}, the engine "
            f"{engine.blocks.positions} of {engine.blocks_attr}; load it into the model it was saved "
            f"from, with the same tier overrides")
    mine = shapes(engine)
    saved: dict[str, tuple[int, ...]] = {}
    for path, prefix in [(directory / PERSISTENT_FILE, "")] + [
            (directory / block_file(i), model.block_prefix(i)) for i in range(len(model.blocks))]:
        with safe_open(str(path), "pt") as f:
            saved.update({prefix + name: tuple(f.get_slice(name).get_shape())
                          for name in weight_names(list(f.keys()))})
    for name, shape in saved.items():
        if mine.get(name, shape) != shape:
            raise InvalidArgumentError(f"checkpoint {directory} has {name!r} of shape {list(shape)}, "
                                       f"the model {list(mine[name])}; load it into the model it was "
                                       f"saved from (same sizes)")
    unknown = [n for n in saved if n not in mine]
    missing = [n for n in mine if n not in saved and n not in model.tied]
    if unknown or missing:
        what = f"has {unknown[0]!r}, which the model has not" if unknown else f"has no {missing[0]!r} of the model"
        raise InvalidArgumentError(f"checkpoint {directory} {what}; load it into the model it was saved from")


def _load_format1_persistent(engine: OffloadEngine, meta: dict) -> None:
    """The persistent part as format 1 kept it, in engine.pt (no block was resident then:
    such a save failed)."""
    engine.views.load_persistent_state_dict(meta["persistent"])
    engine.persistent_optimizer.load_state_dict(meta["persistent_optimizer"])
    with torch.no_grad():
        for m, saved_master in zip(engine.persistent_masters, meta["persistent_masters"]):
            m.copy_(saved_master)


def _model_parts(engine: OffloadEngine):
    """The model's weights one part at a time, as (file name, tensors): the persistent
    parameters and buffers first (tied weights once), then each block as stored
    (partitioned: gathered from every rank). One block in memory at a time."""
    engine.wait_for_optimizer()
    persistent, _, _ = persistent_state(engine, optimizer_state=False)
    yield "model-persistent.safetensors", persistent
    for i, position in enumerate(engine.blocks.positions):
        block = block_state(engine, i, optimizer_state=False)
        yield (f"model-block-{i:05d}.safetensors",
               {f"{engine.blocks_attr}.{position}.{n}": t.contiguous() for n, t in block.items()})


def export_safetensors(engine: OffloadEngine, directory: str | Path) -> Path:
    """Export the model's weights for `from_pretrained`; returns the index file's path."""
    directory = Path(directory)
    writes = engine.store.writes_checkpoint
    if writes:
        directory.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for file_name, tensors in _model_parts(engine):  # every rank reads (a collective)
        if writes:
            total += _write_weights(directory, file_name, tensors, weight_map)
    index = directory / "model.safetensors.index.json"
    if writes:
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        _save_model_config(engine, directory)
    engine.store.barrier()
    return index


def save_one_file(engine: OffloadEngine, directory: str | Path, file_name: str) -> Path:
    """The whole model's weights in one file, as DeepSpeed's save_16bit_model writes it:
    safetensors for a '.safetensors' name, else torch.save's state dict. The whole model
    is in host memory once while it is written (export_safetensors holds one block)."""
    if not file_name or file_name in (".", "..") or "/" in file_name or "\0" in file_name:
        raise InvalidArgumentError(f"save_16bit_model: save_filename {file_name!r} must be a plain "
                                   f"file name (no '/'), e.g. 'pytorch_model.bin' or 'model.safetensors'")
    directory = Path(directory)
    writes = engine.store.writes_checkpoint
    whole: dict[str, torch.Tensor] = {}
    for _, tensors in _model_parts(engine):
        if writes:
            whole.update(tensors)
    path = directory / file_name
    if writes:
        directory.mkdir(parents=True, exist_ok=True)
        staged = directory / f".{file_name}.partial"
        if file_name.endswith(".safetensors"):
            save_file(whole, str(staged), metadata={"format": "pt"})
        else:
            torch.save(whole, staged)
        fsync(staged)
        os.replace(staged, path)
        _save_model_config(engine, directory)
    engine.store.barrier()
    return path


def _save_model_config(engine: OffloadEngine, directory: Path) -> None:
    """A Hugging Face model's config beside its weights, so from_pretrained finds both."""
    config = getattr(engine.model, "config", None)
    if hasattr(config, "save_pretrained"):
        config.save_pretrained(directory)


def _write_weights(directory: Path, file_name: str, tensors: dict[str, torch.Tensor],
                   weight_map: dict[str, str]) -> int:
    """One safetensors file of the export, entered in `weight_map`; its bytes."""
    save_file(tensors, str(directory / file_name), metadata={"format": "pt"})
    weight_map.update({k: file_name for k in tensors})
    return sum(t.numel() * t.element_size() for t in tensors.values())
