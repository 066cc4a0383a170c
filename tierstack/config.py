"""tierstack's typed configuration, and the one place that loads and validates it.

Config is plain dataclasses with defaults. `load_config` accepts a dict, a JSON file
path, or nothing (defaults), rejects unknown keys by their dotted name, and parses
human sizes ("4GiB", "512MB", 1048576).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierstack.errors import ConfigError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": KiB,
    "m": 1000**2, "mb": 1000**2, "mib": MiB,
    "g": 1000**3, "gb": 1000**3, "gib": GiB,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(value: Any, name: str = "size") -> int:
    """Bytes from an int or a string such as '4GiB', '1.5GB', '4096'."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size in bytes, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if not m or unit not in _SIZE_UNITS:
            raise ConfigError(
                f"{name}: cannot read {value!r} as a size; write bytes (4294967296) "
                f"or a number with a unit (4GiB, 512MiB, 1.5GB)"
            )
        n = int(float(m.group(1)) * _SIZE_UNITS[unit])
    else:
        raise ConfigError(f"{name}: expected a size in bytes, got {value!r}")
    if n < 0:
        raise ConfigError(f"{name}: a size cannot be negative, got {value!r}")
    return n


@dataclass
class AioConfig:
    """NVMe IO settings; names and meanings follow DeepSpeed's `aio` section."""

    block_size: int = 1 * MiB
    """Bytes per IO request; a multiple of 4096."""
    queue_depth: int = 8
    """Requests each IO thread keeps in flight."""
    thread_count: int = 1
    """IO submitter threads; thread_count x queue_depth requests are in flight at most."""
    engine: str = "auto"
    """'native' (the compiled block-IO loop), 'threads' (Python threads), or 'auto'."""

    def validate(self, prefix: str = "aio") -> None:
        if self.engine not in ("auto", "native", "threads"):
            raise ConfigError(f"{prefix}.engine: {self.engine!r} is not one of auto, native, threads")
        if self.block_size < 4096 or self.block_size % 4096:
            raise ConfigError(
                f"{prefix}.block_size: {self.block_size} is not a positive multiple of 4096; "
                f"O_DIRECT needs 4 KiB-aligned requests (1MiB is a good default)"
            )
        for name in ("queue_depth", "thread_count"):
            value = getattr(self, name)
            if not 1 <= value <= 1024:
                raise ConfigError(f"{prefix}.{name}: {value} must be between 1 and 1024")


@dataclass
class CpuPoolConfig:
    """The node's pool of CPU memory: shared-memory arenas that workers map."""

    size: int = 2 * GiB
    """Hard bound on the bytes the pool ever holds."""
    arena_size: int = 1 * GiB
    """Bytes per arena file; the pool is ceil(size / arena_size) arenas."""
    shm_dir: str = "/dev/shm"
    """Directory of the arena files (a tmpfs)."""
    alignment: int = 4096
    """Alignment of every buffer handed out (O_DIRECT and cudaHostRegister want 4 KiB)."""

    def validate(self, prefix: str = "cpu_pool") -> None:
        if self.size <= 0:
            raise ConfigError(f"{prefix}.size must be positive, got {self.size}")
        if self.alignment < 64 or self.alignment & (self.alignment - 1):
            raise ConfigError(f"{prefix}.alignment must be a power of two >= 64, got {self.alignment}")
        if self.arena_size < self.alignment or self.arena_size % self.alignment:
            raise ConfigError(
                f"{prefix}.arena_size: {self.arena_size} must be a positive multiple of "
                f"{prefix}.alignment ({self.alignment})"
            )


@dataclass
class NvmePoolConfig:
    """The node's NVMe pool: one directory per drive, extents striped across them."""

    paths: list[str] = field(default_factory=lambda: ["/var/tmp/tierstack/nvme"])
    size: int = 8 * GiB
    """Total bytes over all paths; each path preallocates size / len(paths)."""
    aio: AioConfig = field(default_factory=AioConfig)

    def validate(self, prefix: str = "nvme_pool") -> None:
        if not self.paths:
            raise ConfigError(f"{prefix}.paths: give at least one directory")
        if len(set(os.path.realpath(p) for p in self.paths)) != len(self.paths):
            raise ConfigError(f"{prefix}.paths: the same directory is listed twice: {self.paths}")
        if self.size < self.aio.block_size * len(self.paths):
            raise ConfigError(
                f"{prefix}.size: {self.size} bytes is less than one block "
                f"({self.aio.block_size}) per path"
            )
        self.aio.validate(f"{prefix}.aio")


@dataclass
class TierManagerConfig:
    """Everything one node's tier manager owns."""

    cpu_pool: CpuPoolConfig = field(default_factory=CpuPoolConfig)
    nvme_pool: NvmePoolConfig = field(default_factory=NvmePoolConfig)
    manifest_path: str = ""
    """sqlite manifest of NVMe-resident tensors; default: <first nvme path>/manifest.sqlite."""
    listen: str = ""
    """gRPC address: a unix socket path (unix:/path) or host:port; default: the node's
    socket, $TIERSTACK_TIER_MANAGER or /tmp/tierstack-<uid>/tier-manager.sock."""
    shutdown_grace_seconds: int = 30
    """On SIGTERM, how long in-flight requests (writes) may take to finish."""

    def validate(self, prefix: str = "tier_manager") -> None:
        self.cpu_pool.validate(f"{prefix}.cpu_pool")
        self.nvme_pool.validate(f"{prefix}.nvme_pool")

    def resolved_manifest_path(self) -> Path:
        if self.manifest_path:
            return Path(self.manifest_path)
        return Path(self.nvme_pool.paths[0]) / "manifest.sqlite"


@dataclass
class TierstackConfig:
    """The root of a tierstack config file."""

    tier_manager: TierManagerConfig = field(default_factory=TierManagerConfig)

    def validate(self) -> None:
        self.tier_manager.validate("tier_manager")


_SIZE_FIELDS = {"size", "arena_size", "block_size", "alignment"}


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(
            f"unknown config key {where}{unknown[0]}; known keys here: {', '.join(sorted(names))}"
        )
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, key)
        elif name in _SIZE_FIELDS:
            kwargs[name] = parse_size(value, key)
        elif hint is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{key}: expected an integer, got {value!r}")
            kwargs[name] = value
        elif hint is str:
            if not isinstance(value, str):
                raise ConfigError(f"{key}: expected a string, got {value!r}")
            kwargs[name] = value
        elif hint == list[str]:
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{key}: expected a list of strings, got {value!r}")
            kwargs[name] = list(value)
        else:  # pragma: no cover - a field type this loader was not taught
            raise TypeError(f"config loader cannot read field {key} of type {hint}")
    return cls(**kwargs)


def load_config(source: dict | str | os.PathLike | None = None) -> TierstackConfig:
    """Load, validate and return the config from a dict, a JSON file, or defaults."""
    if source is None:
        data: dict = {}
    elif isinstance(source, dict):
        data = source
    else:
        path = Path(source)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {path} is not valid JSON: {e}") from None
    config = _build(TierstackConfig, data, "")
    config.validate()
    return config


def section(config_cls: type, data: dict | None, prefix: str) -> Any:
    """Build and validate one config section (e.g. a pool's) from a dict."""
    obj = _build(config_cls, data or {}, prefix)
    obj.validate(prefix)
    return obj
