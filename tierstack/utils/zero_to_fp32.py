"""DeepSpeed's `deepspeed.utils.zero_to_fp32` for tierstack checkpoints: fp32 weights from a checkpoint, offline.

    from tierstack.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state_dict = get_fp32_state_dict_from_zero_checkpoint("runs/ckpt")      # the `latest` tag
    model.load_state_dict(state_dict)

or, on the command line, `tierstack zero-to-fp32 runs/ckpt out/ [--tag T] [--safetensors]`,
which writes what `from_pretrained` loads (the weights in shards of at most
--max-shard-size, their index, and the model's config.json where the checkpoint has one).

The same names and arguments as DeepSpeed's module. A tierstack checkpoint
(tierstack/checkpoint_layout.py) is read without a tier manager and without the model's
code: its checkpoint.json says which block of the model each file holds. Each weight is
its fp32 master where it has one (trained in bf16 or fp16), else the weight itself
widened; floating buffers are widened too and the rest kept as they are, as DeepSpeed
does. Writing goes one shard at a time, each tensor read from its file as the shard needs
it: memory holds one shard (small shards: one block). A tied weight (GPT-2's lm_head.weight
is transformer.wte.weight) is in the state dict under both names; safetensors files keep
it once, as `save_pretrained` does (from_pretrained ties it again), torch files under both.
Every file is checked against its crc32 first.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tierstack.checkpoint_layout import (CONFIG_FILE, LISTING_FILE, PERSISTENT_FILE, block_file, find,
                                         holds_checkpoint, model_map, verify, weight_names)
from tierstack.config import parse_size
from tierstack.errors import InvalidArgumentError

log = logging.getLogger(__name__)

_FLOATING = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class _Weight:
    """One tensor of the consolidated state dict and where its fp32 value is read."""

    name: str
    file: Path
    key: str
    """The key read: the weight's master where it has one, else the weight."""
    floating: bool
    nbytes: int
    """Its bytes in the output (fp32 when floating)."""

    def read(self, files: dict[Path, object]) -> torch.Tensor:
        tensor = files[self.file].get_tensor(self.key)
        return tensor.float() if self.floating else tensor


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The model's fp32 state dict from a tierstack checkpoint: `checkpoint_dir`/`tag`, by
    default the tag `checkpoint_dir`/latest names (or `checkpoint_dir` itself where it is
    one tag). Tied weights share one tensor under both names. The whole model is in memory
    once; convert_zero_checkpoint_to_fp32_state_dict writes it a shard at a time."""
    if lazy_mode:
        raise InvalidArgumentError("get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True) is not "
                                   "supported; convert_zero_checkpoint_to_fp32_state_dict (or tierstack "
                                   "zero-to-fp32) writes the weights a shard at a time")
    weights, tied = _weights(_tag_directory(checkpoint_dir, tag), exclude_frozen_parameters)
    with _opened(weights) as files:
        state = {w.name: w.read(files) for w in weights}
    state.update({alias: state[name] for alias, name in tied.items() if name in state})
    return state


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike,
                                               output_dir: str | os.PathLike,
                                               max_shard_size: int | str = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> list[Path]:
    """Write the checkpoint's fp32 weights into `output_dir` as Hugging Face names them
    (`model.safetensors` with `safe_serialization`, else `pytorch_model.bin`; over
    `max_shard_size`, shards and their index) with the model's config.json where the
    checkpoint has one; returns the files written. A failure removes what it wrote."""
    directory = _tag_directory(checkpoint_dir, tag)
    weights, tied = _weights(directory, exclude_frozen_parameters)
    limit = parse_size(max_shard_size, "max_shard_size")
    if limit <= 0:
        raise InvalidArgumentError(f"max_shard_size must be more than 0 bytes, got {max_shard_size!r}")
    shards = _shards(weights, limit)
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    names = ([f"{stem}.{ext}"] if len(shards) == 1 else
             [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}" for i in range(len(shards))])
    aliases_of: dict[str, list[str]] = {}
    for alias, name in tied.items():
        aliases_of.setdefault(name, []).append(alias)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    weight_map: dict[str, str] = {}
    try:
        for shard, file_name in zip(shards, names):
            with _opened(shard) as files:
                tensors = {w.name: w.read(files) for w in shard}
            if safe_serialization:
                _write(out, file_name, written, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
            else:  # a tied weight under each of its names, one tensor in the file
                tensors.update({a: tensors[n] for n in list(tensors) for a in aliases_of.get(n, ())})
                _write(out, file_name, written, lambda p: torch.save(tensors, p))
            weight_map.update({name: file_name for name in tensors})
            del tensors
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(w.nbytes for w in weights)},
                     "weight_map": dict(sorted(weight_map.items()))}
            _write(out, f"{stem}.{ext}.index.json", written,
                   lambda p: p.write_text(json.dumps(index, indent=2) + "\n"))
        if (directory / CONFIG_FILE).is_file():
            _write(out, CONFIG_FILE, written, lambda p: shutil.copyfile(directory / CONFIG_FILE, p))
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    return written


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str | os.PathLike,
                                         tag: str | None = None) -> torch.nn.Module:
    """Move `model` to the CPU and load the checkpoint's fp32 weights into it (strict=False,
    as DeepSpeed does); returns the model."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


# ---- reading a checkpoint ------------------------------------------------------------------


def _tag_directory(checkpoint_dir: str | os.PathLike, tag: str | None) -> Path:
    directory = find(checkpoint_dir, tag)
    if not (directory / LISTING_FILE).is_file() and holds_checkpoint(directory):
        raise InvalidArgumentError(
            f"{directory} is a DeepSpeed checkpoint, not tierstack's: use the zero_to_fp32.py "
            f"DeepSpeed saved beside it, or load it into tierstack's engine with engine.load_checkpoint")
    return directory


def _weights(directory: Path, exclude_frozen: bool) -> tuple[list[_Weight], dict[str, str]]:
    """Every tensor of the model's state dict in the checkpoint `directory` (tied names
    left out: returned apart, a name -> the name it shares a tensor with)."""
    model = model_map(directory, verify(directory))
    frozen = set(model.frozen) if exclude_frozen else set()
    parts = [(directory / PERSISTENT_FILE, "")] + [
        (directory / block_file(i), model.block_prefix(i)) for i in range(len(model.blocks))]
    weights = []
    for path, prefix in parts:
        with safe_open(str(path), "pt") as f:
            keys = list(f.keys())
            for name in weight_names(keys):
                if prefix + name in frozen:
                    continue
                key = f"{name}.master" if f"{name}.master" in keys else name
                sliced = f.get_slice(key)
                dtype, numel = sliced.get_dtype(), _numel(sliced.get_shape())
                floating = dtype in _FLOATING
                weights.append(_Weight(prefix + name, path, key, floating,
                                       numel * (4 if floating else _ITEMSIZE.get(dtype, 8))))
    return weights, {a: n for a, n in model.tied.items() if a not in frozen}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@contextmanager
def _opened(weights: list[_Weight]):
    """The weights' files, each open once while the body reads them."""
    with ExitStack() as stack:
        yield {path: stack.enter_context(safe_open(str(path), "pt"))
               for path in dict.fromkeys(w.file for w in weights)}


def _shards(weights: list[_Weight], limit: int) -> list[list[_Weight]]:
    """The weights in order, cut into shards of at most `limit` bytes (a larger tensor has
    a shard of its own)."""
    shards: list[list[_Weight]] = [[]]
    size = 0
    for w in weights:
        if shards[-1] and size + w.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(w)
        size += w.nbytes
    return shards


def _write(directory: Path, name: str, written: list[Path], write) -> None:
    """Write `name` beside its place, then rename it there: a reader never sees half a file."""
    staged = directory / f".{name}.partial"
    written.append(staged)
    write(staged)
    staged.replace(directory / name)
    written[-1] = directory / name
