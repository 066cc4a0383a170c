"""Checkpoints and Hugging Face export straight from the tiers, one block at a time.

Never is the whole model gathered: each block's state is read from the tier manager,
written to its own safetensors file, and dropped before the next one is read.

- `save_checkpoint` / `load_checkpoint`: block i's parameters and AdamW moments in
  `block-<i>.safetensors`, plus `engine.pt` with what lives on the device (persistent
  parameters and their optimizer state), the step count and the caller's extra state.
  Values are stored exactly, so training resumed from a checkpoint continues bit for bit.
- `export_safetensors`: the model's weights as a sharded safetensors checkpoint with its
  index (`model.safetensors.index.json`), under the model's own parameter names, so
  Hugging Face `from_pretrained` loads it.
"""

from __future__ import annotations

import json
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file

from tierstack.errors import InvalidArgumentError
from tierstack.worker.engine import OffloadEngine
from tierstack.worker.tiered_adamw import MOMENTS

ENGINE_FILE = "engine.pt"  # train_flags.py names it too (without importing torch)


def _block_file(directory: Path, index: int) -> Path:
    return directory / f"block-{index:05d}.safetensors"


def save_checkpoint(engine: OffloadEngine, directory: str | Path, extra: dict | None = None) -> None:
    """Write the engine's whole training state under `directory`."""
    engine.wait_for_optimizer()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    store, optimizer = engine.store, engine.block_optimizer
    for i in range(len(engine.blocks.blocks)):
        tensors = dict(store.read_layer(i))
        kinds = (MOMENTS if optimizer.steps else ()) + (("master",) if optimizer.masters else ())
        for kind in kinds:
            tensors.update(store.read_layer(i, kind))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(_block_file(directory, i)))
    torch.save({
        "blocks": len(engine.blocks.blocks),
        "steps": optimizer.steps,
        "persistent": engine.model.state_dict(),
        "persistent_optimizer": engine.persistent_optimizer.state_dict(),
        "persistent_masters": [m.detach().cpu() for m in engine.persistent_masters],
        "extra": extra or {},
    }, directory / ENGINE_FILE)


def load_checkpoint(engine: OffloadEngine, directory: str | Path) -> dict:
    """Restore a checkpoint into an engine built for the same model; returns `extra`."""
    directory = Path(directory)
    if not (directory / ENGINE_FILE).exists():
        raise InvalidArgumentError(f"{directory} holds no tierstack checkpoint ({ENGINE_FILE} is missing)")
    meta = torch.load(directory / ENGINE_FILE, map_location="cpu", weights_only=False)
    if meta["blocks"] != len(engine.blocks.blocks):
        raise InvalidArgumentError(
            f"checkpoint {directory} has {meta['blocks']} blocks but the model has "
            f"{len(engine.blocks.blocks)}; load it into the model it was saved from")
    engine.wait_for_optimizer()
    store, optimizer = engine.store, engine.block_optimizer
    for i in range(meta["blocks"]):
        saved = load_file(str(_block_file(directory, i)))
        layout_names = {s.name for s in store.layouts[i].slots}
        store.write_back(i, {n: saved[n] for n in layout_names})
        kinds = (MOMENTS if meta["steps"] else ()) + (("master",) if optimizer.masters else ())
        for kind in kinds:
            store.write_back(i, {k: v for k, v in saved.items() if k.endswith(f".{kind}")}, kind=kind)
    engine.model.load_state_dict(meta["persistent"])
    engine.persistent_optimizer.load_state_dict(meta["persistent_optimizer"])
    with torch.no_grad():
        for m, saved_master in zip(engine.persistent_masters, meta["persistent_masters"]):
            m.copy_(saved_master)
    optimizer.steps = meta["steps"]
    return meta["extra"]


def export_safetensors(engine: OffloadEngine, directory: str | Path) -> Path:
    """Export the model's weights for `from_pretrained`; returns the index file's path."""
    engine.wait_for_optimizer()
    blocks_attr = engine.blocks_attr
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    seen: set[int] = set()
    persistent = {}
    for name, tensor in engine.model.state_dict().items():
        if tensor.data_ptr() in seen:  # tied weights (e.g. GPT-2's head): stored once
            continue
        seen.add(tensor.data_ptr())
        persistent[name] = tensor.detach().cpu().contiguous()
    shards = [("model-persistent.safetensors", persistent)]
    for i in range(len(engine.blocks.blocks)):
        shards.append((f"model-block-{i:05d}.safetensors",
                       {f"{blocks_attr}.{i}.{n}": t.contiguous()
                        for n, t in engine.store.read_layer(i).items()}))
        file_name, tensors = shards.pop()
        save_file(tensors, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update({k: file_name for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    file_name, tensors = shards.pop()
    save_file(tensors, str(directory / file_name), metadata={"format": "pt"})
    weight_map.update({k: file_name for k in tensors})
    total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config = getattr(engine.model, "config", None)
    if hasattr(config, "save_pretrained"):
        config.save_pretrained(directory)
    return index
