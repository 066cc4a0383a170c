"""Hugging Face causal language models for `tierstack train`, never whole in host memory.

The model is built from a local transformers config (a `config.json`-style file, or a
model directory; nothing is downloaded) on the meta device, so none of its tensors
exist yet. The engine then creates them one block at a time, just before the block is
stored with the tier manager, through `HfModel.initialize`: Hugging Face's own
initialisation of each submodule (`_init_weights`: normal weights, ones in the norms,
the rotary tables), then, when the directory holds weights, the checkpoint's tensors
read one by one from their safetensors (or memory-mapped PyTorch) files. Host memory
holds one block, never the model.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tierstack.errors import ConfigError
from tierstack.worker.engine.model_blocks import find_blocks

log = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_INDEX = "pytorch_model.bin.index.json"
SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("--hf-model needs the transformers package: pip install transformers") from None
    return transformers


class CheckpointTensors:
    """A local Hugging Face checkpoint's tensors, read one at a time by name.

    safetensors files are opened lazily (each `get` reads one tensor); PyTorch `.bin`
    files are memory-mapped, so neither reads the whole checkpoint into memory.
    """

    def __init__(self, directory: Path, prefix: str) -> None:
        self.directory = directory
        self.prefix = prefix  # the base model's prefix, which some checkpoints leave out
        self._where: dict[str, str] = {}
        self._open: dict[str, object] = {}
        for index in (SAFETENSORS_INDEX, TORCH_INDEX):
            if (directory / index).exists():
                self._where = json.loads((directory / index).read_text())["weight_map"]
                break
        else:
            for single in SINGLE_FILES:
                if (directory / single).exists():
                    self._where = {name: single for name in self._names_in(single)}
                    break
        if not self._where:
            raise ConfigError(f"--hf-model {directory}: no weights there ({', '.join(SINGLE_FILES)} "
                              f"or a sharded index); give --hf-init config to train from scratch")

    @staticmethod
    def present(directory: Path) -> bool:
        return any((directory / f).exists() for f in SINGLE_FILES + (SAFETENSORS_INDEX, TORCH_INDEX))

    def _file(self, name: str):
        if name not in self._open:
            path = self.directory / name
            if name.endswith(".safetensors"):
                from safetensors import safe_open
                self._open[name] = safe_open(str(path), framework="pt", device="cpu")
            else:
                self._open[name] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return self._open[name]

    def _names_in(self, file_name: str) -> list[str]:
        handle = self._file(file_name)
        return list(handle.keys())

    def get(self, name: str) -> torch.Tensor | None:
        """The tensor saved under `name` (or under `name` without the base model's prefix)."""
        for candidate in (name, name.removeprefix(self.prefix + ".") if self.prefix else name):
            file_name = self._where.get(candidate)
            if file_name is not None:
                handle = self._file(file_name)
                return (handle.get_tensor(candidate) if hasattr(handle, "get_tensor")
                        else handle[candidate])
        return None

    def close(self) -> None:
        self._open.clear()


@dataclass
class HfModel:
    """A Hugging Face causal LM on the meta device, with how to create its tensors."""

    model: torch.nn.Module
    blocks_attr: str
    """Dotted name of the ModuleList of decoder blocks (model.layers, transformer.h, ...)."""
    source: str
    """Where its weights come from: "config" (initialised) or "weights" (the checkpoint)."""
    path: Path
    weights: CheckpointTensors | None = None
    names: dict[int, str] = field(default_factory=dict)
    """id(module) -> its dotted name in the model (taken before the engine swaps blocks)."""

    def initialize(self, module: torch.nn.Module, device: torch.device) -> None:
        """Create the meta tensors of `module` on `device` (the engine's initialize hook):
        Hugging Face's init per submodule, then the checkpoint's values where it has them."""
        missing = []
        with torch.no_grad():
            for sub in module.modules():
                own = dict(sub.named_parameters(recurse=False)) | dict(sub.named_buffers(recurse=False))
                if not any(t.is_meta for t in own.values()):
                    continue
                sub.to_empty(device=device, recurse=False)
                self.model._init_weights(sub)
                _compute_rotary_table(sub, device)
                if self.weights is None:
                    continue
                prefix = self.names.get(id(sub), "")
                for leaf, tensor in list(sub.named_parameters(recurse=False)) + list(
                        sub.named_buffers(recurse=False)):
                    name = f"{prefix}.{leaf}" if prefix else leaf
                    saved = self.weights.get(name)
                    if saved is not None:
                        if tuple(saved.shape) != tuple(tensor.shape):
                            raise ConfigError(
                                f"--hf-model {self.path}: {name} is {list(saved.shape)} in the "
                                f"checkpoint but {list(tensor.shape)} in the model built from its "
                                f"config; the weights and config.json do not belong together")
                        tensor.copy_(saved)
                    elif leaf in sub._parameters:
                        missing.append(name)
        if module is self.model and hasattr(self.model, "tie_weights"):
            self.model.tie_weights()  # e.g. GPT-2's head is its token embedding
            missing = [n for n in missing if not _is_tied(self.model, n)]
        if missing:
            raise ConfigError(
                f"--hf-model {self.path}: the checkpoint has no tensor for {', '.join(missing[:5])}"
                f"{' ...' if len(missing) > 5 else ''}; it was saved from another architecture "
                f"(give --hf-init config to train from scratch)")

    def describe(self) -> str:
        config = self.model.config
        params = sum(p.numel() for p in self.model.parameters())
        return (f"{type(self.model).__name__} ({config.model_type}) "
                f"{len(self.model.get_submodule(self.blocks_attr))} x {getattr(config, 'hidden_size', '?')}, "
                f"{params / 1e6:.1f}M parameters, "
                f"{'weights from ' + str(self.path) if self.source == 'weights' else 'initialised from its config'}")


def _compute_rotary_table(module: torch.nn.Module, device: torch.device) -> None:
    """A transformers 4.x rotary embedding's `inv_freq`, which that release computes only in
    `__init__` (on the meta device: no values) and its `_init_weights` leaves alone (5.x's
    recomputes it; its rotary modules have no `rope_init_fn`, so this does nothing there)."""
    rope_init_fn = getattr(module, "rope_init_fn", None)
    if rope_init_fn is None or "inv_freq" not in module._buffers:
        return
    inv_freq, module.attention_scaling = rope_init_fn(module.config, device)
    module.inv_freq.copy_(inv_freq)
    if "original_inv_freq" in module._buffers:
        module.original_inv_freq.copy_(inv_freq)
    else:  # 4.x keeps it as a plain attribute, still the meta tensor
        module.original_inv_freq = module.inv_freq


def _is_tied(model: torch.nn.Module, name: str) -> bool:
    """Whether parameter `name` is the same tensor as another parameter of the model."""
    target = model.get_parameter(name)
    return sum(p is target for _, p in model.named_parameters(remove_duplicate=False)) > 1


def load_config(path: str | Path):
    """A transformers config from a JSON file or a model directory (local files only)."""
    transformers = _transformers()
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"--hf-model {path}: no such file or directory; give a transformers "
                          f"config.json or a model directory (nothing is downloaded)")
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"--hf-model {path}: the directory has no config.json")
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--hf-model {file}: not a readable JSON config ({e})") from None
    model_type = data.pop("model_type", None) if isinstance(data, dict) else None
    if not model_type:
        raise ConfigError(f"--hf-model {file}: the config has no \"model_type\" (e.g. \"llama\", "
                          f"\"gpt2\"); it is not a transformers config")
    try:
        return transformers.AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"--hf-model {file}: transformers cannot build model_type "
                          f"{model_type!r}: {e}") from None


def build(path: str | Path, init: str = "auto") -> HfModel:
    """A causal LM from a local config on the meta device; `init`: "weights" (the model
    directory's checkpoint), "config" (fresh initialisation) or "auto" (weights when the
    directory has them)."""
    path = Path(path)
    config = load_config(path)
    has_weights = path.is_dir() and CheckpointTensors.present(path)
    if init == "auto":
        init = "weights" if has_weights else "config"
    if init == "weights" and not has_weights:
        raise ConfigError(f"--hf-model {path}: --hf-init weights needs a model directory with "
                          f"{' or '.join(SINGLE_FILES)} (or a sharded index)")
    hf = from_config(config, path)
    if init == "weights":
        hf.source, hf.weights = "weights", CheckpointTensors(path, hf.model.base_model_prefix)
    return hf


def from_config(config, path: str | Path = "") -> HfModel:
    """A causal LM for a transformers config object on the meta device, initialised by its
    own init when the engine creates its tensors (`path`: where the config came from, for
    messages)."""
    try:
        with torch.device("meta"):
            model = _transformers().AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        where = f"--hf-model {path}: " if path else ""
        raise ConfigError(f"{where}no causal language model for this config ({e})") from None
    names = {id(m): n for n, m in model.named_modules()}
    return HfModel(model, find_blocks(model), "config", Path(path), None, names)


def tokenizer_for(path: str | Path):
    """The model directory's tokenizer (local files only), or None: bytes are the tokens."""
    path = Path(path)
    if not path.is_dir() or not any((path / f).exists() for f in (
            "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
        return None
    transformers = _transformers()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--hf-model {path}: its tokenizer files cannot be loaded ({e})") from None
