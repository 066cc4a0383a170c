"""A tierstack checkpoint on disk: a directory of tags with a `latest` file, as DeepSpeed lays one out.

The engine (`save_checkpoint`), `tierstack train --checkpoint-dir` and the partitioned job
all write this layout (worker/engine/checkpoint.py); `load_checkpoint`, `--resume` and
`tierstack zero-to-fp32` read it. Nothing here imports torch: `tierstack train` checks a
checkpoint to resume before its heavy imports.

    CHECKPOINT_DIR/
      latest                     the newest tag, written once that tag is whole
      global_step100/            one checkpoint (a tag)
        checkpoint.json          every file's size and crc32, and the model's map (ModelMap)
        block-00000.safetensors  block 0 of the model's blocks (`blocks_attr`.<position>), under
        ...                      the block's own names: each weight in the training dtype and,
                                 per trainable weight `w`, `w.master` (fp32, where the weights
                                 are not fp32), `w.exp_avg` and `w.exp_avg_sq` (from the first step)
        persistent.safetensors   the rest of the model (embeddings, norms, head, blocks kept on
                                 the device from the start) under full names, the same state
                                 beside each weight, and `w.step` (its AdamW step count)
        engine.pt                step count, param groups, fp16's loss scale, the caller's state
        config.json              a Hugging Face model's config, so the weights load on their own

A tag is written beside its place and swapped in with one rename, every file fsynced and
listed first; `latest` moves only after that. A crash leaves the previous tag whole and
`latest` pointing at a whole tag.

Format 1 (before this layout's model map) kept the persistent state inside engine.pt and
wrote `tierstack train`'s checkpoint straight into CHECKPOINT_DIR: it still loads (a
directory that holds a checkpoint itself is read as one tag), but names no model to
consolidate it by.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tierstack.errors import DataCorruptionError, InvalidArgumentError

LATEST_FILE = "latest"
LISTING_FILE = "checkpoint.json"
ENGINE_FILE = "engine.pt"
PERSISTENT_FILE = "persistent.safetensors"
CONFIG_FILE = "config.json"
FORMAT = 2
STATE_KINDS = ("master", "exp_avg", "exp_avg_sq", "step")
"""What is kept beside a weight `w` in a checkpoint's files, as `w.<kind>`."""
DEEPSPEED_MODEL_STATES = "*_model_states.pt"
"""A DeepSpeed checkpoint's tag holds one or more of these (worker/engine/deepspeed_checkpoint.py)."""


def block_file(index: int) -> str:
    return f"block-{index:05d}.safetensors"


@dataclass
class ModelMap:
    """Where a checkpoint's tensors sit in the model: enough to name every weight without
    the model's code (tierstack zero-to-fp32)."""

    blocks_attr: str
    """The module list of the offloaded blocks, e.g. 'model.layers'."""
    blocks: list[int]
    """Block file i holds `blocks_attr`.<blocks[i]>."""
    precision: str
    steps: int
    """Optimizer steps applied (the blocks' AdamW step count)."""
    tied: dict[str, str] = field(default_factory=dict)
    """Names that share another's tensor (GPT-2's lm_head.weight -> transformer.wte.weight):
    stored once, under the name they point to."""
    frozen: list[str] = field(default_factory=list)
    """Parameters that do not train (no master, no moments)."""

    def block_prefix(self, index: int) -> str:
        return f"{self.blocks_attr}.{self.blocks[index]}."


def weight_names(keys) -> list[str]:
    """The weights among a checkpoint file's keys: `w.master`, `w.exp_avg`, ... are state
    of `w` when `w` is a key too (a name cannot be both a weight and a module of one)."""
    present = set(keys)
    return [k for k in keys if not any(k.endswith(f".{kind}") and k[:-len(kind) - 1] in present
                                       for kind in STATE_KINDS)]


def checked_tag(tag: object) -> str:
    """A checkpoint tag as a directory name of its own: no path tricks."""
    text = str(tag)
    if not text or text in (".", "..") or "/" in text or "\0" in text or text.startswith("."):
        raise InvalidArgumentError(f"checkpoint tag {text!r} must be a plain name (no '/', not "
                                   f"empty, not starting with '.'), e.g. global_step100")
    return text


def holds_checkpoint(directory: Path) -> bool:
    """Whether `directory` is one checkpoint (a tag's directory), tierstack's or DeepSpeed's."""
    return ((directory / LISTING_FILE).is_file() or (directory / ENGINE_FILE).is_file()
            or any(directory.glob(DEEPSPEED_MODEL_STATES)))


def latest_tag(directory: Path) -> str | None:
    """The tag `directory`/latest names, or None where there is no such file."""
    latest = Path(directory) / LATEST_FILE
    return checked_tag(latest.read_text().strip()) if latest.is_file() else None


def tags(directory: Path) -> list[str]:
    """The tags in `directory` that hold a checkpoint, oldest step first (global_step9
    before global_step10)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p.name for p in directory.iterdir()
             if p.is_dir() and not p.name.startswith(".") and holds_checkpoint(p)]
    return sorted(found, key=lambda name: [int(part) if part.isdigit() else part
                                           for part in re.split(r"(\d+)", name)])


def find(directory: str | os.PathLike, tag: object = None) -> Path:
    """The checkpoint to read: `directory`/`tag`; without a tag, the one `latest` names, or
    `directory` itself where it is a checkpoint (a tag's directory, or format 1's layout).
    Anything else is refused in one line that says what to give."""
    directory = Path(directory)
    if not directory.is_dir():
        raise InvalidArgumentError(f"no checkpoint directory {directory}: give the directory "
                                   f"save_checkpoint or --checkpoint-dir wrote")
    there = tags(directory)
    listed = f" (tags there: {', '.join(there)})" if there else ""
    if tag is None:
        tag = latest_tag(directory)
        if tag is None:
            if holds_checkpoint(directory):
                return directory
            raise InvalidArgumentError(
                f"{directory} has no '{LATEST_FILE}' file and holds no checkpoint itself; "
                + (f"give a tag{listed}" if there else "save a checkpoint there first"))
        what = f"{directory / LATEST_FILE} names tag {tag!r}, but"
    else:
        tag = checked_tag(tag)
        what = f"no checkpoint {tag!r} in {directory}:"
    path = directory / tag
    if not path.is_dir() or not holds_checkpoint(path):
        raise InvalidArgumentError(f"{what} {path} is not a checkpoint; give a tag saved there"
                                   f"{listed or ' (there is none)'}")
    return path


def write_latest(directory: Path, tag: str) -> None:
    """Point `directory`/latest at `tag` in one rename (a reader sees the old tag or the new)."""
    staged = Path(directory) / f".{LATEST_FILE}.writing"
    staged.write_text(checked_tag(tag))
    fsync(staged)
    staged.replace(Path(directory) / LATEST_FILE)
    fsync(Path(directory))


def older_tags(directory: Path, keep: int) -> list[str]:
    """The tags of `directory` past the newest `keep` (the one `latest` names is always kept)."""
    if keep <= 0:
        return []
    current = latest_tag(directory)
    others = [t for t in tags(directory) if t != current]
    return others[:max(0, len(others) - (keep - (current is not None)))]


# ---- the listing: every file's size and crc32, and the model's map ------------------------


def write_listing(directory: Path, model: ModelMap | None) -> None:
    """List every file of the staged checkpoint `directory` (each fsynced first)."""
    files = {}
    for path in sorted(directory.iterdir()):
        files[path.name] = {"bytes": path.stat().st_size, "crc32": crc32(path)}
        fsync(path)
    listing = {"format": FORMAT, "files": files}
    if model is not None:
        listing["model"] = asdict(model)
    (directory / LISTING_FILE).write_text(json.dumps(listing, indent=1))
    fsync(directory / LISTING_FILE)
    fsync(directory)


def verify(directory: Path) -> dict:
    """The listing of checkpoint `directory`, once every file it lists is there with its size
    and crc32."""
    try:
        listing = json.loads((directory / LISTING_FILE).read_text())
        files = listing["files"]
    except (OSError, ValueError, KeyError):
        raise InvalidArgumentError(
            f"{directory} is not a complete tierstack checkpoint ({LISTING_FILE} is missing or "
            f"unreadable: an interrupted save, or one from before checkpoints were verified)") from None
    for name, expected in files.items():
        path = directory / name
        if not path.exists() or path.stat().st_size != expected["bytes"] or crc32(path) != expected["crc32"]:
            raise DataCorruptionError(f"checkpoint file {path} is missing or does not match its "
                                      f"size and crc32 in {LISTING_FILE}; load another checkpoint")
    return listing


def model_map(directory: Path, listing: dict) -> ModelMap:
    """The model's map of a verified checkpoint; format 1 has none."""
    if "model" not in listing:
        raise InvalidArgumentError(
            f"{directory} was saved before tierstack checkpoints named their model's blocks "
            f"(format 1): load it with load_checkpoint or --resume and save it again")
    return ModelMap(**listing["model"])


def crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def swap_into_place(staged: Path, target: Path) -> None:
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
    fsync(target.parent)


def remove_format1(directory: Path) -> None:
    """Remove a format-1 checkpoint written straight into `directory` (`tierstack train`'s
    layout before tags): the files its listing names, then the listing. Called once a tag
    of `directory` replaced it."""
    listing = Path(directory) / LISTING_FILE
    if not listing.is_file():
        return
    try:
        files = json.loads(listing.read_text())["files"]
    except (OSError, ValueError, KeyError):
        return  # not a listing we wrote: leave it
    for name in files:
        if "/" not in name and name != LISTING_FILE:
            (Path(directory) / name).unlink(missing_ok=True)
    listing.unlink()
