"""Checkpoints and Hugging Face export straight from the tiers, one block at a time.

Never is the whole model gathered: each block's state is read from the tier manager,
written to its own safetensors file, and dropped before the next one is read.

- `save_checkpoint` / `load_checkpoint`: block i's parameters and AdamW moments in
  `block-<i>.safetensors`, plus `engine.pt` with what lives on the device (persistent
  parameters and their optimizer state), the step count and the caller's extra state.
  Values are stored exactly, so training resumed from a checkpoint continues bit for bit.
  A checkpoint is atomic: written into a staging directory beside its target, every file
  fsynced and listed with its size and crc32 in `checkpoint.json`, then swapped into place
  in one rename; `load_checkpoint` checks every file against that list before it changes
  anything. A save that dies leaves the previous checkpoint whole.
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

import ctypes
import json
import os
import shutil
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tierstack.errors import DataCorruptionError, InvalidArgumentError
from tierstack.worker.engine.offload_engine import OffloadEngine
from tierstack.worker.engine.tiered_adamw import MOMENTS

ENGINE_FILE = "engine.pt"  # train_flags.py names it too (without importing torch)


def _block_file(directory: Path, index: int) -> Path:
    return directory / f"block-{index:05d}.safetensors"


def save_checkpoint(engine: OffloadEngine, directory: str | Path, extra: dict | None = None) -> None:
    """Write the engine's whole training state as `directory`, replacing what was there
    only once every file of the new checkpoint is durable."""
    engine.wait_for_optimizer()
    target = Path(directory).absolute()
    directory = target.with_name(f".{target.name}.writing")
    writes = engine.store.writes_checkpoint
    if writes:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(directory, ignore_errors=True)  # what a save that died left
        directory.mkdir()
    store, optimizer = engine.store, engine.block_optimizer
    for i in range(len(engine.blocks.blocks)):
        tensors = dict(store.read_layer(i))  # partitioned: gathered from every rank
        kinds = (MOMENTS if optimizer.steps else ()) + (("master",) if optimizer.masters else ())
        for kind in kinds:
            tensors.update(store.read_layer(i, kind))
        if writes:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(_block_file(directory, i)))
    if not writes:
        engine.store.barrier()
        return
    torch.save({
        "blocks": len(engine.blocks.blocks),
        "steps": optimizer.steps,
        "persistent": engine.views.persistent_state_dict(),
        "persistent_optimizer": engine.persistent_optimizer.state_dict(),
        "persistent_masters": [m.detach().cpu() for m in engine.persistent_masters],
        # The groups' hyperparameters now (a schedule moved their lr) and fp16's loss scale.
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in engine.param_groups],
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "extra": extra or {},
    }, directory / ENGINE_FILE)
    files = {}
    for path in sorted(directory.iterdir()):
        files[path.name] = {"bytes": path.stat().st_size, "crc32": _crc32(path)}
        _fsync(path)
    (directory / LISTING_FILE).write_text(json.dumps({"files": files}, indent=1))
    _fsync(directory / LISTING_FILE)
    _fsync(directory)
    _swap_into_place(directory, target)
    engine.store.barrier()


LISTING_FILE = "checkpoint.json"


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swap_into_place(staged: Path, target: Path) -> None:
    """`staged` becomes `target` in one step: renameat2(RENAME_EXCHANGE) swaps the two
    directories atomically where the old one exists (a crash leaves one whole checkpoint
    or the other under the name), a plain rename where it does not."""
    if target.exists():
        libc = ctypes.CDLL(None, use_errno=True)
        at_fdcwd, rename_exchange = -100, 2
        if libc.renameat2(at_fdcwd, bytes(staged), at_fdcwd, bytes(target), rename_exchange) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"cannot replace checkpoint {target}: {os.strerror(error)}")
        shutil.rmtree(staged)  # now the old checkpoint
    else:
        staged.rename(target)
    _fsync(target.parent)


def _verify(directory: Path) -> None:
    """Every file the checkpoint lists is there with its size and crc32."""
    try:
        listing = json.loads((directory / LISTING_FILE).read_text())["files"]
    except (OSError, ValueError, KeyError):
        raise InvalidArgumentError(
            f"{directory} is not a complete tierstack checkpoint ({LISTING_FILE} is missing or "
            f"unreadable: an interrupted save, or one from before checkpoints were verified)") from None
    for name, expected in listing.items():
        path = directory / name
        if not path.exists() or path.stat().st_size != expected["bytes"] or _crc32(path) != expected["crc32"]:
            raise DataCorruptionError(f"checkpoint file {path} is missing or does not match its "
                                      f"size and crc32 in {LISTING_FILE}; load another checkpoint")


def load_checkpoint(engine: OffloadEngine, directory: str | Path) -> dict:
    """Restore a checkpoint into an engine built for the same model; returns `extra`."""
    directory = Path(directory)
    if not (directory / ENGINE_FILE).exists():
        raise InvalidArgumentError(f"{directory} holds no tierstack checkpoint ({ENGINE_FILE} is missing)")
    _verify(directory)
    meta = torch.load(directory / ENGINE_FILE, map_location="cpu", weights_only=False)
    groups = meta.get("param_groups", engine.param_groups)
    if len(groups) != len(engine.param_groups):
        raise InvalidArgumentError(
            f"checkpoint {directory} has {len(groups)} param groups but the engine "
            f"{len(engine.param_groups)}; give the engine the param groups it was saved with")
    if meta["blocks"] != len(engine.blocks.blocks):
        raise InvalidArgumentError(
            f"checkpoint {directory} has {meta['blocks']} blocks but the model has "
            f"{len(engine.blocks.blocks)}; load it into the model it was saved from")
    engine.wait_for_optimizer()
    store, optimizer = engine.store, engine.block_optimizer
    for i in range(meta["blocks"]):
        saved = load_file(str(_block_file(directory, i)))
        layout_names = {s.name for s in store.layout(i).slots}
        store.write_back(i, {n: saved[n] for n in layout_names})
        kinds = (MOMENTS if meta["steps"] else ()) + (("master",) if optimizer.masters else ())
        for kind in kinds:
            store.write_back(i, {k: v for k, v in saved.items() if k.endswith(f".{kind}")}, kind=kind)
    engine.views.load_persistent_state_dict(meta["persistent"])
    engine.persistent_optimizer.load_state_dict(meta["persistent_optimizer"])
    with torch.no_grad():
        for m, saved_master in zip(engine.persistent_masters, meta["persistent_masters"]):
            m.copy_(saved_master)
    optimizer.steps = meta["steps"]
    for group, saved_group in zip(engine.param_groups, meta.get("param_groups", [])):
        group.update(saved_group)
    if engine.loss_scaler is not None and meta.get("loss_scaler") is not None:
        engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    return meta["extra"]


def _model_parts(engine: OffloadEngine):
    """The model's weights one part at a time, as (file name, tensors): the persistent
    parameters and buffers first (tied weights once), then each block as stored
    (partitioned: gathered from every rank). One block in memory at a time."""
    engine.wait_for_optimizer()
    seen: set[int] = set()
    persistent = {}
    for name, tensor in engine.views.persistent_state_dict().items():
        if tensor.data_ptr() in seen:  # tied weights (e.g. GPT-2's head): stored once
            continue
        seen.add(tensor.data_ptr())
        persistent[name] = tensor.detach().cpu().contiguous()
    yield "model-persistent.safetensors", persistent
    for i in range(len(engine.blocks.blocks)):
        block = engine.store.read_layer(i)
        yield (f"model-block-{i:05d}.safetensors",
               {f"{engine.blocks_attr}.{engine.blocks.positions[i]}.{n}": t.contiguous()
                for n, t in block.items()})


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
        _fsync(staged)
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
